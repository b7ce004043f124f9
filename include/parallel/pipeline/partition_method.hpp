#pragma once
// A stage partitioning method by name, as DeepSpeed's PipelineModule spells it: "uniform",
// "parameters", or "type:<regex>" (a case-insensitive regular expression over the units' type
// names). Parsed in one place for the partitioner (partition.hpp) and the config's
// pipeline.partition_method, so both accept and refuse the same names.

#include <regex>
#include <string>
#include <string_view>

#include <zero/core/error.hpp>

namespace zero::parallel::pipeline {

/// A parsed partition method.
struct PartitionMethod {
  enum class Kind : unsigned char { uniform, parameters, type };
  Kind kind = Kind::parameters;
  std::string pattern;  ///< the regex of type:<regex>
  std::regex regex;     ///< pattern, compiled case-insensitively
};

/// Parses method; ConfigError naming it when it is none of the three forms or its regex does not
/// compile.
inline PartitionMethod parse_partition_method(std::string_view method) {
  PartitionMethod m;
  if (method == "uniform") {
    m.kind = PartitionMethod::Kind::uniform;
    return m;
  }
  if (method == "parameters") return m;
  expect<ConfigError>(method.starts_with("type:") && method.size() > 5, "'", std::string(method),
                      "' is not a partition method; expected uniform, parameters or type:<regex> "
                      "with a non-empty regex");
  m.kind = PartitionMethod::Kind::type;
  m.pattern = std::string(method.substr(5));
  try {
    m.regex = std::regex(m.pattern, std::regex::icase);
  } catch (const std::regex_error& e) {
    raise<ConfigError>("'", std::string(method), "': the regex after type: is invalid (", e.what(),
                       ")");
  }
  return m;
}

}  // namespace zero::parallel::pipeline
