#pragma once
// The "pipeline" config section. DeepSpeed's section gives the pipeline-parallel size as
// `stages` ("auto": the program decides); zero adds `virtual_stages`, `schedule` and
// `partition_method` (DeepSpeed's PipelineModule argument, here a config key). DeepSpeed's other
// keys of the section (partition, seed_layers, activation_checkpoint_interval, pipe_partitioned,
// grad_partitioned) are accepted without effect and listed with their reasons in key_table.hpp.
// Megatron's top-level pipeline_model_parallel_size and virtual_pipeline_model_parallel_size are
// accepted too; sizes that disagree are a ConfigError naming both keys.

#include <cstdint>
#include <string>
#include <vector>

#include <parallel/pipeline/partition_method.hpp>
#include <parallel/pipeline/schedule.hpp>
#include <zero/config/json_reader.hpp>
#include <zero/config/key_table.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

namespace detail {
/// fn(), its ConfigError (which names the value) prefixed with the key path where.
template <class Fn>
auto at_key(const std::string& where, Fn&& fn) {
  try {
    return fn();
  } catch (const ConfigError& e) {
    raise<ConfigError>(where, ": ", e.what());
  }
}
}  // namespace detail

/// Pipeline-parallelism settings.
struct PipelineConfig {
  std::int64_t stages = 1;          ///< pipeline-parallel size ("auto": 1, the program decides)
  std::int64_t virtual_stages = 1;  ///< model chunks per stage (the interleaved schedule)
  std::string schedule = "1f1b";    ///< gpipe, 1f1b, interleaved or zb
  std::string partition_method = "parameters";  ///< uniform, parameters or type:<regex>

  /// Reads the section at r (the "pipeline" object); key paths nobody reads are appended to
  /// unknown. The checks across virtual_stages and schedule run in merge_megatron, since
  /// Megatron's top-level virtual size may complete the section.
  static PipelineConfig read(JsonReader r, std::vector<std::string>& unknown) {
    PipelineConfig c;
    c.stages = r.within_int(r.integer_or_auto("stages", 1).value_or(1), "stages");  // "auto": 1
    expect<ConfigError>(c.stages >= 1, r.where("stages"), ": ", c.stages,
                        " must be at least 1 (or \"auto\")");
    c.virtual_stages = r.int32("virtual_stages").value_or(1);
    expect<ConfigError>(c.virtual_stages >= 1, r.where("virtual_stages"), ": ", c.virtual_stages,
                        " must be at least 1 (model chunks per stage)");
    if (const auto schedule = r.string("schedule")) {
      c.schedule = detail::at_key(r.where("schedule"), [&] {
        return std::string(
            parallel::pipeline::name_of(parallel::pipeline::parse_schedule_kind(*schedule)));
      });
    } else if (c.virtual_stages > 1) {
      c.schedule = "interleaved";  // chunks per stage only make sense interleaved
    }
    if (const auto method = r.string("partition_method")) {
      c.partition_method = *method;
      detail::at_key(r.where("partition_method"),
                     [&] { return parallel::pipeline::parse_partition_method(*method); });
    }
    read_inert(r);  // DeepSpeed's keys without effect (key_table.hpp)
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }

  /// Megatron's top-level spellings, pipeline_model_parallel_size and
  /// virtual_pipeline_model_parallel_size, checked against the section (a virtual size above 1
  /// without a schedule means "interleaved"); then the checks across virtual_stages and schedule.
  void merge_megatron(JsonReader& top) {
    const JsonReader section = top.object("pipeline");
    const std::string size_key = "pipeline_model_parallel_size";
    const std::string virtual_key = "virtual_pipeline_model_parallel_size";
    if (const auto size = top.int32(size_key)) {
      expect<ConfigError>(*size >= 1, top.where(size_key), ": ", *size, " must be at least 1");
      const bool given = section.has("stages") && !section.is_auto("stages");
      expect<ConfigError>(!given || stages == *size, top.where(size_key), " = ", *size, " and ",
                          section.where("stages"), " = ", stages, " disagree; give one of them");
      stages = *size;
    }
    const auto virtual_size = top.int32(virtual_key);
    if (virtual_size) {
      expect<ConfigError>(*virtual_size >= 1, top.where(virtual_key), ": ", *virtual_size,
                          " must be at least 1 (model chunks per stage)");
      expect<ConfigError>(!section.has("virtual_stages") || virtual_stages == *virtual_size,
                          top.where(virtual_key), " = ", *virtual_size, " and ",
                          section.where("virtual_stages"), " = ", virtual_stages,
                          " disagree; give one of them");
      virtual_stages = *virtual_size;
      if (*virtual_size > 1 && !section.has("schedule")) schedule = "interleaved";
    }
    // Name the key the chunk count came from.
    const std::string chunks = virtual_size && !section.has("virtual_stages")
                                   ? top.where(virtual_key)
                                   : section.where("virtual_stages");
    expect<ConfigError>(virtual_stages == 1 || schedule == "interleaved", chunks, " = ",
                        virtual_stages, " needs ", section.where("schedule"),
                        " \"interleaved\" (the only schedule that runs several chunks per stage), "
                        "the config has \"",
                        schedule, "\"");
    expect<ConfigError>(schedule != "interleaved" || virtual_stages >= 2, section.where("schedule"),
                        " \"interleaved\" needs ", chunks,
                        " of at least 2 chunks per stage, the config has ", virtual_stages);
    // Chunks of stages there are not: without a pipeline they would be ignored without a word
    // (train_gpt --vpp 2 alone trained with none). "auto" stages are the program's to set.
    const bool stages_auto = section.is_auto("stages");
    expect<ConfigError>(virtual_stages == 1 || stages > 1 || stages_auto, chunks, " = ",
                        virtual_stages, " needs a pipeline of at least 2 stages (",
                        section.where("stages"),
                        " or pipeline_model_parallel_size), the config "
                        "has ",
                        stages);
  }
};

}  // namespace zero::config
