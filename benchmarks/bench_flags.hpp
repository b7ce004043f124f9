#pragma once
// Command-line flags of the benchmark programs: each takes "--name value" pairs, each flag bound
// to a variable; an unknown flag or a value that is not a number is an error naming it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <variant>

namespace zero::bench {

/// One flag and the variable its value goes into.
struct Flag {
  const char* name;  ///< "--layers"
  std::variant<std::int64_t*, int*, std::string*> into;
};

/// Reads "--name value" pairs of argv into flags; on an unknown flag or a bad number prints
/// "<program>: ..." and returns false.
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
    char* end = nullptr;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (end == value.c_str() || *end != '\0') {
      std::fprintf(stderr, "%s: %s expects an integer, got '%s'\n", program, name.c_str(),
                   value.c_str());
      return false;
    }
    if (auto* p = std::get_if<std::int64_t*>(&flag->into)) {
      **p = v;
    } else {
      *std::get<int*>(flag->into) = static_cast<int>(v);
    }
  }
  return true;
}

}  // namespace zero::bench
