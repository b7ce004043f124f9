#pragma once
// Timing helper shared by the benchmark programs.
#include <algorithm>
#include <chrono>

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

}  // namespace zero::bench
