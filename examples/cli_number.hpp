#pragma once
// Numbers from the command line of the examples, read strictly: the whole text must be the
// number ("1e-3x", "", "12abc", " 8" and out-of-range values are errors naming the flag), where
// atoi and atof would read a prefix or 0 and run with it. Reals are decimal: strtod's
// hexadecimal form ("0x1p-3") is refused, and so is a value it can only round to 0 or a
// subnormal ("1e-400").
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include <zero/core/error.hpp>

namespace zero::examples {

namespace detail {
// strto* skip leading white space: " 8" would read as 8.
inline bool starts_with_space(const std::string& text) {
  return !text.empty() && std::isspace(static_cast<unsigned char>(text.front())) != 0;
}
}  // namespace detail

/// text as a whole integer in [min, max]; ConfigError naming flag otherwise.
inline std::int64_t parse_integer(const std::string& flag, const std::string& text,
                                  std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                                  std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  expect<ConfigError>(
      end != text.c_str() && *end == '\0' && errno != ERANGE && !detail::starts_with_space(text),
      flag, " expects an integer, got '", text, "'");
  expect<ConfigError>(v >= min && v <= max, flag, " must be in [", min, ", ", max, "], got ", v);
  return v;
}

/// text as a whole finite number in [min, max]; ConfigError naming flag otherwise.
inline double parse_real(const std::string& flag, const std::string& text,
                         double min = -std::numeric_limits<double>::max(),
                         double max = std::numeric_limits<double>::max()) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  expect<ConfigError>(end != text.c_str() && *end == '\0' && std::isfinite(v) &&
                          !detail::starts_with_space(text) &&
                          text.find_first_of("xX") == std::string::npos,
                      flag, " expects a finite number, got '", text, "'");
  expect<ConfigError>(errno != ERANGE, flag, " '", text,
                      "' is too small for a double (it would read as ", v, ")");
  expect<ConfigError>(v >= min && v <= max, flag, " must be in [", min, ", ", max, "], got ", v);
  return v;
}

/// A count written as an integer or in scientific notation ("7.5e9"), whole and in [min, max].
/// Digits alone are read as an integer, exactly (a double rounds past 2^53).
inline std::int64_t parse_count(const std::string& flag, const std::string& text,
                                std::int64_t min = 1) {
  if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos) {
    return parse_integer(flag, text, min, 9'000'000'000'000'000'000);
  }
  const double v = parse_real(flag, text, static_cast<double>(min), 9.0e18);
  expect<ConfigError>(v == std::floor(v), flag, " expects a whole number, got '", text, "'");
  return static_cast<std::int64_t>(v);
}

}  // namespace zero::examples
