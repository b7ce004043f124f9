#pragma once
// CommLogger: counts ops, bytes and time per (op, group) on one rank, switchable at run time.
// Bytes follow nccl-tests: S is the whole buffer (count*size for reduce_scatter, all_gather and
// all_to_all), and bus bytes = S * bus_factor(op, n) are what each rank moves over its links in
// a ring, so the engine can hold totals per step to the ZeRO formulas (2Ψ, 3Ψ, ...).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <parallel/comm/comm_op.hpp>

namespace zero::parallel {

/// Totals of one (op, group) pair, or of several summed.
struct CommStats {
  std::uint64_t count = 0;  ///< ops issued
  std::uint64_t bytes = 0;  ///< nccl-tests S summed over the ops
  double bus_bytes = 0.0;   ///< S * bus_factor summed over the ops (per-rank link volume)
  double time_s = 0.0;      ///< wall time from issue to completion, summed

  /// Algorithm bandwidth S/t in GB/s (1e9 bytes/s); 0 when no time was recorded.
  double algbw_gbps() const { return time_s > 0 ? static_cast<double>(bytes) / time_s / 1e9 : 0; }
  /// Bus bandwidth in GB/s (nccl-tests busbw).
  double busbw_gbps() const { return time_s > 0 ? bus_bytes / time_s / 1e9 : 0; }

  /// Adds other's totals to these.
  CommStats& operator+=(const CommStats& other) {
    count += other.count;
    bytes += other.bytes;
    bus_bytes += other.bus_bytes;
    time_s += other.time_s;
    return *this;
  }
};

/// One row of the logger: an op on a named group of `ranks` ranks.
struct CommRecord {
  CommOp op;          ///< which op
  std::string group;  ///< the communicator's name ("world", "dp", ...)
  int ranks = 0;      ///< size of the group
  CommStats stats;    ///< totals
};

/// Per-rank communication log; thread-safe (async ops complete on other threads).
class CommLogger {
 public:
  /// A logger that records only once enabled.
  explicit CommLogger(bool enabled = true) : enabled_(enabled) {}

  /// Switches recording on or off at run time; off costs one relaxed load per op.
  void enable(bool on = true) { enabled_.store(on, std::memory_order_relaxed); }
  /// True while recording.
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  /// Records one op of S = bytes on group (ranks ranks) that took seconds.
  void record(CommOp op, std::string_view group, int ranks, std::size_t bytes, double seconds) {
    if (!enabled()) return;
    std::lock_guard lock(mutex_);
    auto& row = rows_[{static_cast<int>(op), std::string(group)}];
    row.ranks = ranks;
    row.stats.count += 1;
    row.stats.bytes += bytes;
    row.stats.bus_bytes += static_cast<double>(bytes) * bus_factor(op, ranks);
    row.stats.time_s += seconds;
  }

  /// Totals of op over every group.
  CommStats total(CommOp op) const {
    return sum_if([&](CommOp o, const std::string&) { return o == op; });
  }
  /// Totals of op on the group named group.
  CommStats total(CommOp op, std::string_view group) const {
    return sum_if([&](CommOp o, const std::string& g) { return o == op && g == group; });
  }
  /// Totals of every op on every group.
  CommStats total() const {
    return sum_if([](CommOp, const std::string&) { return true; });
  }

  /// Every (op, group) row, ordered by op then group name.
  std::vector<CommRecord> records() const {
    std::lock_guard lock(mutex_);
    std::vector<CommRecord> out;
    for (const auto& [key, row] : rows_) {
      out.push_back({static_cast<CommOp>(key.first), key.second, row.ranks, row.stats});
    }
    return out;
  }

  /// Forgets everything recorded (e.g. at the start of a step).
  void reset() {
    std::lock_guard lock(mutex_);
    rows_.clear();
  }

  /// One JSON object per row: op, group, ranks, count, bytes, bus_bytes, time_s, algbw, busbw.
  std::string report() const {
    std::ostringstream out;
    for (const auto& r : records()) {
      out << "{\"op\":\"" << name_of(r.op) << "\",\"group\":\"" << r.group
          << "\",\"ranks\":" << r.ranks << ",\"count\":" << r.stats.count
          << ",\"bytes\":" << r.stats.bytes << ",\"bus_bytes\":" << r.stats.bus_bytes
          << ",\"time_s\":" << r.stats.time_s << ",\"algbw_gbps\":" << r.stats.algbw_gbps()
          << ",\"busbw_gbps\":" << r.stats.busbw_gbps() << "}\n";
    }
    return std::move(out).str();
  }

 private:
  struct Row {
    int ranks = 0;
    CommStats stats;
  };

  template <class Pred>
  CommStats sum_if(Pred pred) const {
    std::lock_guard lock(mutex_);
    CommStats sum;
    for (const auto& [key, row] : rows_) {
      if (pred(static_cast<CommOp>(key.first), key.second)) sum += row.stats;
    }
    return sum;
  }

  std::atomic<bool> enabled_;
  mutable std::mutex mutex_;
  std::map<std::pair<int, std::string>, Row> rows_;
};

}  // namespace zero::parallel
