#pragma once
// Command-line flags of the benchmark programs: each takes "--name value" pairs, each flag bound
// to a variable; an unknown flag or a value that is not a number is an error naming it.
// integer_arg and real_arg read one number strictly for programs that parse their own flags:
// atoi and atof read "8x" as 8 and "x" as 0, and the benchmark ran with that.
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <variant>

namespace zero::bench {

/// text as a whole integer, or nothing (empty, trailing characters, out of range).
inline std::optional<std::int64_t> whole_integer(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE) return std::nullopt;
  return v;
}

/// The value text of flag as a whole integer in [min, max]; otherwise prints
/// "<program>: <flag> ..." and exits with status 2.
inline std::int64_t integer_arg(const char* program, const std::string& flag, const char* text,
                                std::int64_t min = 1,
                                std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
  const std::optional<std::int64_t> v = whole_integer(text);
  if (!v || *v < min || *v > max) {
    std::fprintf(stderr, "%s: %s expects an integer in [%lld, %lld], got '%s'\n", program,
                 flag.c_str(), static_cast<long long>(min), static_cast<long long>(max), text);
    std::exit(2);
  }
  return *v;
}

/// The value text of flag as a finite number >= min; otherwise prints "<program>: <flag> ..."
/// and exits with status 2.
inline double real_arg(const char* program, const std::string& flag, const char* text,
                       double min = 0.0) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(v) || v < min) {
    std::fprintf(stderr, "%s: %s expects a finite number >= %g, got '%s'\n", program, flag.c_str(),
                 min, text);
    std::exit(2);
  }
  return v;
}

/// argv[i + 1], the value of flag argv[i]; prints "<program>: <flag> needs a value" and exits
/// with status 2 when it is missing (a loop to i + 1 < argc never looked at a last flag, so
/// "--help" ran the whole benchmark).
inline const char* value_arg(const char* program, int argc, char** argv, int i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "%s: %s needs a value\n", program, argv[i]);
    std::exit(2);
  }
  return argv[i + 1];
}

/// The index of text among choices; otherwise prints "<program>: <flag> must be one of ..." and
/// exits with status 2 (a misspelt value ran with the default).
inline std::size_t choice_arg(const char* program, const std::string& flag, const std::string& text,
                              std::initializer_list<const char*> choices) {
  std::size_t k = 0;
  std::string known;
  for (const char* c : choices) {
    if (text == c) return k;
    if (k++ > 0) known += '|';
    known += c;
  }
  std::fprintf(stderr, "%s: %s must be one of %s, got '%s'\n", program, flag.c_str(), known.c_str(),
               text.c_str());
  std::exit(2);
}

/// One flag and the variable its value goes into.
struct Flag {
  const char* name;  ///< "--layers"
  std::variant<std::int64_t*, int*, std::string*> into;
};

/// Reads "--name value" pairs of argv into flags; on an unknown flag, a missing value or a
/// number that is not a whole count in range prints "<program>: ..." and returns false.
inline bool parse_flags(int argc, char** argv, const char* program,
                        std::initializer_list<Flag> flags) {
  for (int i = 1; i < argc; i += 2) {
    const std::string name = argv[i];
    const Flag* flag = nullptr;
    for (const Flag& f : flags) {
      if (name == f.name) flag = &f;
    }
    if (flag == nullptr || i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s %s\n", program,
                   flag == nullptr ? "unknown flag" : "no value for", name.c_str());
      return false;
    }
    const std::string value = argv[i + 1];
    if (auto* s = std::get_if<std::string*>(&flag->into)) {
      **s = value;
      continue;
    }
    // Every numeric flag is a count or a size: at least 1, and an int's range where it goes
    // into one (--repeats 0 printed a time of 1e33 ms; a size past INT_MAX was truncated).
    const bool narrow = std::holds_alternative<int*>(flag->into);
    const std::int64_t max =
        narrow ? std::numeric_limits<int>::max() : std::numeric_limits<std::int64_t>::max();
    const std::optional<std::int64_t> v = whole_integer(value.c_str());
    if (!v || *v < 1 || *v > max) {
      std::fprintf(stderr, "%s: %s expects an integer in [1, %lld], got '%s'\n", program,
                   name.c_str(), static_cast<long long>(max), value.c_str());
      return false;
    }
    if (auto* p = std::get_if<std::int64_t*>(&flag->into)) {
      **p = *v;
    } else {
      *std::get<int*>(flag->into) = static_cast<int>(*v);
    }
  }
  return true;
}

}  // namespace zero::bench
