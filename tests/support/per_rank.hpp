#pragma once
// Catch2's assertions are not thread-safe, and LocalComm runs every rank on a thread of its own
// (even a single rank). So a rank never asserts: it records what it saw (values, or the message
// of what it threw) in its own slot, and the test asserts on the main thread after run returns.

#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <parallel/comm/local_comm.hpp>

namespace zero::testing {

/// Runs fn(comm) on n ranks of Comm (LocalComm, or another BasicLocalComm such as
/// CudaLocalComm) and returns each rank's result, indexed by rank.
template <class R, class Comm = parallel::LocalComm>
std::vector<R> per_rank(int n, const std::type_identity_t<std::function<R(Comm&)>>& fn,
                        parallel::CommOptions options = {}) {
  // std::vector<bool> packs ranks' slots into shared words: concurrent writes would race.
  static_assert(!std::is_same_v<R, bool>, "per_rank<bool> races; return int or a struct");
  std::vector<R> out(static_cast<std::size_t>(n));
  Comm::run(
      n, [&](Comm& comm) { out[static_cast<std::size_t>(comm.rank())] = fn(comm); }, options);
  return out;
}

/// What thrown_message records when fn returns normally.
inline constexpr std::string_view nothing_thrown = "(nothing thrown)";

/// The message of the exception fn throws, or nothing_thrown: a rank records it and the main
/// thread checks it, e.g. CHECK_THAT(msg, Contains(...)) for CHECK_THROWS_WITH and
/// CHECK(msg == nothing_thrown) for CHECK_NOTHROW.
template <class Fn>
std::string thrown_message(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "(an exception not derived from std::exception)";
  }
  return std::string(nothing_thrown);
}

}  // namespace zero::testing
