#pragma once
// The "tensor_parallel" config section. DeepSpeed's training-time AutoTP spells the size
// `autotp_size`; `tp_size` (DeepSpeed inference, and zero's own) is read too, and Megatron's
// `tensor_model_parallel_size` is accepted at the top level. `sequence_parallel` turns on
// Megatron's sequence parallelism (the residual stream, LayerNorms and dropouts on 1/tp of the
// tokens). Sizes that disagree are a ConfigError naming both keys.

#include <cstdint>
#include <string>
#include <vector>

#include <zero/config/json_reader.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

/// Tensor and sequence parallelism settings.
struct TensorParallelConfig {
  std::int64_t tp_size = 1;        ///< ranks each layer is split over
  bool sequence_parallel = false;  ///< Megatron sequence parallelism (needs tp_size > 1)

  /// Reads the section at r (the "tensor_parallel" object); key paths nobody reads are appended
  /// to unknown.
  static TensorParallelConfig read(JsonReader r, std::vector<std::string>& unknown) {
    TensorParallelConfig c;
    const auto autotp = r.int32("autotp_size");
    const auto tp = r.int32("tp_size");
    expect<ConfigError>(!autotp || !tp || *autotp == *tp, r.where("autotp_size"), " = ",
                        autotp.value_or(0), " and ", r.where("tp_size"), " = ", tp.value_or(0),
                        " disagree; give one of them");
    c.tp_size = autotp ? *autotp : tp.value_or(1);
    expect<ConfigError>(c.tp_size >= 1, r.where(autotp ? "autotp_size" : "tp_size"), ": ",
                        c.tp_size, " must be at least 1");
    c.sequence_parallel = r.boolean("sequence_parallel").value_or(false);
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }
  /// The Megatron top-level spelling, tensor_model_parallel_size, checked against the section.
  void merge_megatron(JsonReader& top) {
    const auto megatron = top.int32("tensor_model_parallel_size");
    if (!megatron) return;
    expect<ConfigError>(*megatron >= 1, top.where("tensor_model_parallel_size"), ": ", *megatron,
                        " must be at least 1");
    // The section's size when it gives one, 1 included (as the pipeline's merge does).
    const JsonReader section = top.object("tensor_parallel");
    const auto gives = [&](const char* key) { return section.has(key) && !section.is_auto(key); };
    const bool given = gives("autotp_size") || gives("tp_size");
    expect<ConfigError>(!given || tp_size == *megatron, top.where("tensor_model_parallel_size"),
                        " = ", *megatron, " disagrees with tensor_parallel's size ", tp_size);
    tp_size = *megatron;
  }
};

}  // namespace zero::config
