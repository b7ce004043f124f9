#pragma once
// Run-time options shared by every communicator backend.

#include <chrono>

namespace zero::parallel {

/// Options of a communicator; split children inherit their parent's.
struct CommOptions {
  /// Deadline of every blocking wait, in seconds: past it the op raises a CommError that names
  /// the op, the group, the ranks and the bytes instead of hanging (config key comm_timeout_s).
  double timeout_s = 300.0;
  /// Debug mode of MpiComm: before each collective, every rank all-gathers a hash of (op,
  /// group, count, dtype, sequence number), so ranks that issue different collectives fail at
  /// the first divergence, naming both ops (one extra small collective per op). LocalComm
  /// always compares its ranks' ops; NcclComm ignores it.
  bool verify_sequence = false;

  friend bool operator==(const CommOptions&, const CommOptions&) = default;
};

/// Clock of every deadline: steady, so wall-clock changes cannot fire or stall a timeout.
using CommClock = std::chrono::steady_clock;

/// The longest wait a deadline stands for: about 31.7 years. A longer timeout_s (1e12 or
/// infinity for "never") waits this long; converted as it is, it would overflow the clock's
/// 64-bit nanoseconds into a deadline in the past, and every wait would time out at once.
inline constexpr double max_timeout_s = 1e9;

/// The time point timeout_s from now (max_timeout_s at most; NaN counts as that too).
inline CommClock::time_point deadline_after(double timeout_s) {
  const double s = timeout_s < max_timeout_s ? timeout_s : max_timeout_s;
  return CommClock::now() +
         std::chrono::duration_cast<CommClock::duration>(std::chrono::duration<double>(s));
}

}  // namespace zero::parallel
