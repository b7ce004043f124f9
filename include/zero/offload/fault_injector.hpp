#pragma once
// FaultInjector: makes a file-I/O engine fail chosen requests, so tests can check what the user
// sees when the disk reports EIO, fills up (ENOSPC) or writes only part of a request. Every
// backend consults it for each block-sized request before issuing it; a short fault really
// transfers the first bytes and then reports the shortfall, as a full device does.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

#include <zero/offload/io_error.hpp>

namespace zero::offload {

/// Fails the nth request (counting from 0, reads and writes counted separately or together).
class FaultInjector {
 public:
  /// What to do with one request.
  struct Decision {
    int error = 0;                           ///< errno to report without doing the I/O
    std::optional<std::size_t> short_bytes;  ///< transfer only this many bytes, then fail
  };

  /// Requests of op (or of both when op is empty) number n fails with errno error; with
  /// short_bytes, it instead transfers short_bytes bytes and reports a short transfer.
  FaultInjector(std::uint64_t nth, int error, std::optional<IoOp> op = std::nullopt,
                std::optional<std::size_t> short_bytes = std::nullopt, bool repeat = false)
      : nth_(nth), error_(error), op_(op), short_bytes_(short_bytes), repeat_(repeat) {}

  /// Called by a backend for every request, from any thread.
  Decision decide(IoOp op) {
    if (op_ && *op_ != op) return {};
    const std::uint64_t index = count_.fetch_add(1);
    if (index < nth_ || (index > nth_ && !repeat_)) return {};
    fired_.fetch_add(1);
    if (short_bytes_) return {0, short_bytes_};
    return {error_, std::nullopt};
  }
  /// Moves the fault to the request after the next `after` matching ones (0: the very next),
  /// counted from now. Call while no I/O is in flight (between passes).
  void arm(std::uint64_t after = 0) { nth_ = count_.load() + after; }
  /// How many requests the fault was applied to.
  std::uint64_t fired() const { return fired_.load(); }
  /// How many matching requests were seen.
  std::uint64_t seen() const { return count_.load(); }

 private:
  std::uint64_t nth_;
  int error_;
  std::optional<IoOp> op_;
  std::optional<std::size_t> short_bytes_;
  bool repeat_;
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::uint64_t> fired_{0};
};

}  // namespace zero::offload
