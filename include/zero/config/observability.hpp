#pragma once
// The DeepSpeed config sections that switch on zero's observability (zero::profile):
// "flops_profiler" (DeepSpeed's profiling/config.py) and "comms_logger" (comm/config.py), with
// DeepSpeed's keys and defaults. wall_clock_breakdown and steps_per_print are top-level keys.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <parallel/comm/comm_op.hpp>
#include <zero/config/json_reader.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

/// "flops_profiler": print a per-unit FLOPs / latency report once, at profile_step.
struct FlopsProfilerConfig {
  bool enabled = false;
  /// DeepSpeed's global_steps at the profiled step: the optimizer steps finished before it, so
  /// the default 1 profiles the second step (the first runs the warm-up) and 0 the first.
  std::int64_t profile_step = 1;
  std::int64_t module_depth = -1;  ///< deepest level of the aggregated table (-1: all)
  std::int64_t top_modules = 1;    ///< modules listed per depth in the aggregated table
  bool detailed = true;            ///< also print the per-unit tree
  std::string output_file;         ///< empty: standard output

  /// Reads the section at r; key paths nobody reads are appended to unknown.
  static FlopsProfilerConfig read(JsonReader r, std::vector<std::string>& unknown) {
    FlopsProfilerConfig c;
    c.enabled = r.boolean("enabled").value_or(c.enabled);
    c.profile_step = r.integer("profile_step").value_or(c.profile_step);
    c.module_depth = r.integer("module_depth").value_or(c.module_depth);
    c.top_modules = r.integer("top_modules").value_or(c.top_modules);
    c.detailed = r.boolean("detailed").value_or(c.detailed);
    const nlohmann::json file = r.raw("output_file");  // DeepSpeed's default is null
    expect<ConfigError>(file.is_null() || file.is_string(), r.where("output_file"),
                        ": expected a file name or null, got ", file.dump());
    if (file.is_string()) c.output_file = file.get<std::string>();
    expect<ConfigError>(c.profile_step >= 0, r.where("profile_step"), ": ", c.profile_step,
                        " must be >= 0 (the optimizer steps finished before the profiled one)");
    expect<ConfigError>(c.module_depth >= -1, r.where("module_depth"), ": ", c.module_depth,
                        " must be -1 (every depth) or >= 0");
    expect<ConfigError>(c.top_modules >= 1, r.where("top_modules"), ": ", c.top_modules,
                        " must be >= 1");
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }

  /// Whether optimizer step `step` (1-based, as the engine counts) is the one profiled.
  bool profiles(std::int64_t step) const { return enabled && step == profile_step + 1; }
};

/// "comms_logger": record every collective and print DeepSpeed's log_summary table.
struct CommsLoggerConfig {
  bool enabled = false;
  bool verbose = false;  ///< also print one line per op as it completes
  bool prof_all = true;  ///< record every op; false: only those in prof_ops
  bool debug = false;    ///< accepted for DeepSpeed parity (verbose lines always name the group)
  std::vector<std::string> prof_ops;  ///< op names ("all_reduce", ...) recorded when !prof_all

  /// Reads the section at r; key paths nobody reads are appended to unknown.
  static CommsLoggerConfig read(JsonReader r, std::vector<std::string>& unknown) {
    CommsLoggerConfig c;
    c.enabled = r.boolean("enabled").value_or(c.enabled);
    c.verbose = r.boolean("verbose").value_or(c.verbose);
    c.prof_all = r.boolean("prof_all").value_or(c.prof_all);
    c.debug = r.boolean("debug").value_or(c.debug);
    const nlohmann::json ops = r.raw("prof_ops");
    if (!ops.is_null()) {
      expect<ConfigError>(ops.is_array(), r.where("prof_ops"), ": expected a list of op names");
      for (const auto& op : ops) {
        expect<ConfigError>(op.is_string(), r.where("prof_ops"), ": expected op names, got ",
                            op.dump());
        c.prof_ops.push_back(op_name(r, op.get<std::string>()));
      }
    }
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }

 private:
  // zero's name of the op a prof_ops entry names: one of parallel::CommOp's names, or the
  // torch.distributed name DeepSpeed logs the same collective under; ConfigError listing the
  // names otherwise (it was a CommError when the logger was made, naming no key).
  static std::string op_name(const JsonReader& r, const std::string& name) {
    static constexpr std::pair<std::string_view, std::string_view> torch_names[] = {
        {"all_gather_into_tensor", "all_gather"},
        {"reduce_scatter_tensor", "reduce_scatter"},
        {"all_to_all_single", "all_to_all"}};
    for (const auto& [torch, ours] : torch_names) {
      if (name == torch) return std::string(ours);
    }
    std::string names;
    for (int i = 0; i < parallel::comm_op_count; ++i) {
      const std::string_view op = parallel::name_of(static_cast<parallel::CommOp>(i));
      if (name == op) return name;
      names += (i ? ", " : "") + std::string(op);
    }
    for (const auto& [torch, ours] : torch_names) names += ", " + std::string(torch);
    raise<ConfigError>(r.where("prof_ops"), ": '", name, "' is not one of ", names);
  }
};

}  // namespace zero::config
