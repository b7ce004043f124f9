#pragma once
// Timing and output helpers shared by the benchmark programs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace zero::bench {

/// The fastest of repeats runs of fn, in seconds (the minimum is the least disturbed by noise).
template <class Fn>
double best_seconds(int repeats, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

/// Prints one result as a JSON line: {"bench", "config": {config}, "value", "unit"} plus extra
/// (already-formatted `, "key": value` pairs, e.g. the same run's baseline), and flushes.
inline void line(const char* bench, const std::string& config, double value, const char* unit,
                 const std::string& extra = "") {
  std::printf("{\"bench\": \"%s\", \"config\": {%s}, \"value\": %.4g, \"unit\": \"%s\"%s}\n", bench,
              config.c_str(), value, unit, extra.c_str());
  std::fflush(stdout);
}

}  // namespace zero::bench
