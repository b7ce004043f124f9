#pragma once
// CommLogger: counts ops, bytes and time per (op, group) on one rank, switchable at run time.
// Bytes follow nccl-tests: S is the whole buffer (count*size for reduce_scatter, all_gather and
// all_to_all), and bus bytes = S * bus_factor(op, n) are what each rank moves over its links in
// a ring, so the engine can hold totals per step to the ZeRO formulas (2Ψ, 3Ψ, ...).
// Rows are also kept per message size, for DeepSpeed's comms_logger summary (log_summary: per
// op, group and size, the count, total and mean latency, algbw and busbw); a filter records
// only chosen ops (comms_logger.prof_ops), and a verbose sink sees one line per op.
// Beside the per-op sums (concurrent ops each count their own latency), the logger keeps the
// time during which at least one op was in flight: the union of the ops' issue-to-completion
// intervals, which the wall-clock breakdown sets against the time the engine waited.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/comm_options.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// The op named name ("all_reduce", as name_of spells it); throws CommError listing the names
/// otherwise (comms_logger.prof_ops names ops this way).
inline CommOp comm_op_named(std::string_view name) {
  std::string names;
  for (int i = 0; i < comm_op_count; ++i) {
    const auto op = static_cast<CommOp>(i);
    if (name_of(op) == name) return op;
    names += (i ? ", " : "") + std::string(name_of(op));
  }
  raise<CommError>("comm op '", std::string(name), "' is not one of ", names);
}

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

  /// Records only the ops listed (empty: every op; comms_logger's prof_all / prof_ops).
  void record_only(std::vector<CommOp> ops) {
    std::lock_guard lock(mutex_);
    only_ = std::move(ops);
  }
  /// Hands one line per recorded op to sink (comms_logger.verbose); null: none.
  void set_verbose(std::function<void(const std::string&)> sink) {
    std::lock_guard lock(mutex_);
    verbose_ = std::move(sink);
  }

  /// Records one op of S = bytes on group (ranks ranks) that took seconds and ended now.
  void record(CommOp op, std::string_view group, int ranks, std::size_t bytes, double seconds) {
    const auto end = CommClock::now();
    record(op, group, ranks, bytes,
           end - std::chrono::duration_cast<CommClock::duration>(
                     std::chrono::duration<double>(std::max(seconds, 0.0))),
           end);
  }

  /// Records one op of S = bytes on group (ranks ranks) issued at start and seen complete at end.
  void record(CommOp op, std::string_view group, int ranks, std::size_t bytes,
              CommClock::time_point start, CommClock::time_point end) {
    if (!enabled()) return;
    const double seconds = std::chrono::duration<double>(end - start).count();
    std::function<void(const std::string&)> sink;
    {
      std::lock_guard lock(mutex_);
      every_op_s_ += seconds;
      add_in_flight(start, end);
      if (!only_.empty() && std::find(only_.begin(), only_.end(), op) == only_.end()) return;
      for (auto* row : {&rows_[{static_cast<int>(op), std::string(group)}],
                        &sized_[{{static_cast<int>(op), std::string(group)}, bytes}]}) {
        row->ranks = ranks;
        row->stats.count += 1;
        row->stats.bytes += bytes;
        row->stats.bus_bytes += static_cast<double>(bytes) * bus_factor(op, ranks);
        row->stats.time_s += seconds;
      }
      sink = verbose_;
    }
    if (sink) {
      CommStats one{1, bytes, static_cast<double>(bytes) * bus_factor(op, ranks), seconds};
      char line[256];
      std::snprintf(line, sizeof line,
                    "comm op: %s | group: %s (%d ranks) | time (ms): %.3f | msg size: %s | "
                    "algbw (GB/s): %.3f | busbw (GB/s): %.3f",
                    std::string(name_of(op)).c_str(), std::string(group).c_str(), ranks,
                    seconds * 1e3, size_text(bytes).c_str(), one.algbw_gbps(), one.busbw_gbps());
      sink(line);
    }
  }

  /// Totals of op over every group.
  CommStats total(CommOp op) const {
    return sum_if([&](CommOp o, const std::string&) { return o == op; });
  }
  /// Totals of op on the group named group.
  CommStats total(CommOp op, std::string_view group) const {
    return sum_if([&](CommOp o, const std::string& g) { return o == op && g == group; });
  }
  /// Seconds of every op recorded while enabled, record_only's filter aside; ops in flight
  /// together each count their own.
  double seconds_of_every_op() const {
    std::lock_guard lock(mutex_);
    return every_op_s_;
  }
  /// Seconds during which at least one op recorded while enabled was in flight (the union of
  /// their issue-to-completion intervals; record_only's filter aside). Never more than the wall
  /// time that passed, where seconds_of_every_op counts overlapping ops once each.
  double seconds_in_flight() const {
    std::lock_guard lock(mutex_);
    return in_flight_s_;
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

  /// Every (op, group, message size) row, ordered by op, group, then size.
  std::vector<std::pair<CommRecord, std::size_t>> records_by_size() const {
    std::lock_guard lock(mutex_);
    std::vector<std::pair<CommRecord, std::size_t>> out;
    for (const auto& [key, row] : sized_) {
      out.push_back({{static_cast<CommOp>(key.first.first), key.first.second, row.ranks, row.stats},
                     key.second});
    }
    return out;
  }

  /// Forgets everything recorded (e.g. at the start of a step).
  void reset() {
    std::lock_guard lock(mutex_);
    rows_.clear();
    sized_.clear();
    every_op_s_ = 0;
    in_flight_s_ = 0;
    intervals_.clear();
  }

  /// DeepSpeed's comms summary (deepspeed.comm.log_summary): per op and group, one line per
  /// message size with the count, total and mean latency, algorithm and bus bandwidth.
  std::string log_summary() const {
    const auto rows = records_by_size();
    std::ostringstream out;
    char line[256];
    std::snprintf(line, sizeof line, "%-20s%-14s%-10s%-20s%-18s%-16s%-16s\n", "Comm. Op",
                  "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "algbw (GB/s)",
                  "busbw (GB/s)");
    out << line;
    std::string current;
    for (const auto& [r, size] : rows) {
      const std::string title =
          std::string(name_of(r.op)) + " [" + r.group + ", " + std::to_string(r.ranks) + " ranks]";
      if (title != current) {
        out << title << "\n";
        current = title;
      }
      std::snprintf(line, sizeof line, "%-20s%-14s%-10llu%-20.3f%-18.3f%-16.3f%-16.3f\n", "",
                    size_text(size).c_str(), static_cast<unsigned long long>(r.stats.count),
                    r.stats.time_s * 1e3,
                    r.stats.count ? r.stats.time_s * 1e3 / static_cast<double>(r.stats.count) : 0.0,
                    r.stats.algbw_gbps(), r.stats.busbw_gbps());
      out << line;
    }
    return std::move(out).str();
  }

  /// A message size as DeepSpeed prints it ("4.0 KB", "1.5 MB").
  static std::string size_text(std::size_t bytes) {
    static constexpr const char* units[] = {"B", "KB", "MB", "GB", "TB"};
    double v = static_cast<double>(bytes);
    int i = 0;
    while (v >= 1024.0 && i < 4) {
      v /= 1024.0;
      ++i;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[i]);
    return buf;
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

  /// Adds to in_flight_s_ the part of [start, end] that no earlier op covered. intervals_ holds
  /// the union so far as disjoint [begin, end] pairs keyed by begin (seconds since epoch_); the
  /// oldest are dropped beyond max_intervals, as a later op rarely reaches back that far.
  void add_in_flight(CommClock::time_point start, CommClock::time_point end) {
    static constexpr std::size_t max_intervals = 1024;
    const double s = std::chrono::duration<double>(start - epoch_).count();
    const double e = std::max(s, std::chrono::duration<double>(end - epoch_).count());
    double lo = s, hi = e, covered = 0;
    auto it = intervals_.upper_bound(s);
    if (it != intervals_.begin() && std::prev(it)->second >= s) --it;
    while (it != intervals_.end() && it->first <= e) {
      covered += std::min(it->second, e) - std::max(it->first, s);
      lo = std::min(lo, it->first);
      hi = std::max(hi, it->second);
      it = intervals_.erase(it);
    }
    intervals_[lo] = hi;
    in_flight_s_ += (e - s) - covered;
    while (intervals_.size() > max_intervals) intervals_.erase(intervals_.begin());
  }

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
  std::map<std::pair<std::pair<int, std::string>, std::size_t>, Row> sized_;
  std::vector<CommOp> only_;
  double every_op_s_ = 0;   ///< seconds_of_every_op()
  double in_flight_s_ = 0;  ///< seconds_in_flight()
  const CommClock::time_point epoch_ = CommClock::now();
  std::map<double, double> intervals_;  ///< the in-flight union's recent intervals (begin: end)
  std::function<void(const std::string&)> verbose_;
};

}  // namespace zero::parallel
