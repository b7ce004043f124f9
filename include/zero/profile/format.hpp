#pragma once
// Number formatting of the profiler reports, as DeepSpeed prints them: counts with a metric
// prefix ("834.43 K", "1.2 G"), latencies in the unit that fits ("38.1 ms", "12.5 us").

#include <cmath>
#include <cstdio>
#include <string>

namespace zero::profile {

/// value with a metric prefix and unit ("1.23 GFLOPS"); 2 decimals.
inline std::string with_prefix(double value, const char* unit = "") {
  static constexpr const char* prefixes[] = {"", " K", " M", " G", " T", " P"};
  int i = 0;
  double v = value;
  while (std::abs(v) >= 1000.0 && i < 5) {
    v /= 1000.0;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f%s%s%s", v, prefixes[i], i == 0 && unit[0] ? " " : "", unit);
  return buf;
}
/// seconds as "12.34 ms", "5.6 us" or "1.2 s".
inline std::string latency(double seconds) {
  char buf[64];
  if (seconds >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  } else if (seconds >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.2f ms", seconds * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f us", seconds * 1e6);
  }
  return buf;
}
/// "label:" padded to width, then value, then a newline (DeepSpeed's summary lines).
inline std::string summary_line(const std::string& label, const std::string& value,
                                std::size_t width = 62) {
  std::string line = label + ":";
  if (line.size() < width) line.append(width - line.size(), ' ');
  return line + " " + value + "\n";
}

}  // namespace zero::profile
