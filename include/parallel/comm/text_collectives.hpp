#pragma once
// Collectives on text: every rank's string gathered on every rank, and one rank's string
// broadcast to all. Ranks use them to agree: on a checkpoint's success or on the same error
// (so none is left waiting in a collective another rank skipped), on a failure's message, or to
// put every pipeline stage's report in one place. Each is two collectives: the sizes, then the
// bytes (padded to the longest string for the gather).

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace zero::parallel {

/// A communicator the text collectives can use: they only gather and broadcast bytes and sizes,
/// so any Communicator qualifies, and so does the type-erased AnyComm.
template <class C>
concept TextComm = requires(C& c, const C& cc, std::span<const std::uint8_t> in8,
                            std::span<std::uint8_t> out8, std::span<const std::int64_t> in64,
                            std::span<std::int64_t> out64) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.all_gather(in8, out8);
  c.all_gather(in64, out64);
  c.broadcast(out8, 0);
  c.broadcast(out64, 0);
};

/// Every rank's text, indexed by rank (a collective; empty strings included).
template <TextComm Comm>
std::vector<std::string> all_gather_text(Comm& comm, const std::string& mine) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto my_size = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(n);
  comm.all_gather(std::span<const std::int64_t>(&my_size, 1), std::span<std::int64_t>(sizes));
  std::int64_t widest = 0;
  for (std::int64_t s : sizes) widest = std::max(widest, s);
  const auto width = static_cast<std::size_t>(widest);
  std::vector<std::uint8_t> send(width), all(width * n);
  std::copy(mine.begin(), mine.end(), send.begin());
  if (width > 0) {
    comm.all_gather(std::span<const std::uint8_t>(send), std::span<std::uint8_t>(all));
  }
  std::vector<std::string> out(n);
  for (std::size_t r = 0; r < n; ++r) {
    const auto* p = reinterpret_cast<const char*>(all.data() + r * width);
    out[r].assign(p, static_cast<std::size_t>(sizes[r]));
  }
  return out;
}

/// The text of the lowest rank whose text is not empty, or an empty string when every rank's is
/// (a collective): how ranks agree on one failure to report, each passing its own or nothing.
template <TextComm Comm>
std::string first_nonempty_text(Comm& comm, const std::string& mine) {
  for (std::string& text : all_gather_text(comm, mine)) {
    if (!text.empty()) return std::move(text);
  }
  return {};
}

/// root's text on every rank (a collective; the others' text is not read).
template <TextComm Comm>
std::string broadcast_text(Comm& comm, const std::string& text, int root) {
  std::int64_t size = static_cast<std::int64_t>(text.size());
  comm.broadcast(std::span<std::int64_t>(&size, 1), root);
  std::vector<std::uint8_t> bytes(text.begin(), text.end());
  bytes.resize(static_cast<std::size_t>(size));
  if (size > 0) comm.broadcast(std::span<std::uint8_t>(bytes), root);
  return {bytes.begin(), bytes.end()};
}

}  // namespace zero::parallel
