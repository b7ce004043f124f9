#pragma once
// Numbers from the command line of the examples, read strictly: the whole text must be the
// number ("1e-3x", "", "12abc" and out-of-range values are errors naming the flag), where atoi
// and atof would read a prefix or 0 and run with it.
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include <zero/core/error.hpp>

namespace zero::examples {

/// text as a whole integer in [min, max]; ConfigError naming flag otherwise.
inline std::int64_t parse_integer(const std::string& flag, const std::string& text,
                                  std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                                  std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  expect<ConfigError>(end != text.c_str() && *end == '\0' && errno != ERANGE, flag,
                      " expects an integer, got '", text, "'");
  expect<ConfigError>(v >= min && v <= max, flag, " must be in [", min, ", ", max, "], got ", v);
  return v;
}

/// text as a whole finite number in [min, max]; ConfigError naming flag otherwise.
inline double parse_real(const std::string& flag, const std::string& text,
                         double min = -std::numeric_limits<double>::max(),
                         double max = std::numeric_limits<double>::max()) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  expect<ConfigError>(end != text.c_str() && *end == '\0' && std::isfinite(v), flag,
                      " expects a finite number, got '", text, "'");
  expect<ConfigError>(v >= min && v <= max, flag, " must be in [", min, ", ", max, "], got ", v);
  return v;
}

/// A count written as an integer or in scientific notation ("7.5e9"), whole and in [min, max].
inline std::int64_t parse_count(const std::string& flag, const std::string& text,
                                std::int64_t min = 1) {
  const double v = parse_real(flag, text, static_cast<double>(min), 9.0e18);
  expect<ConfigError>(v == std::floor(v), flag, " expects a whole number, got '", text, "'");
  return static_cast<std::int64_t>(v);
}

}  // namespace zero::examples
