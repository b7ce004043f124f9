#pragma once
// The "zero_optimization" section of a DeepSpeed config: stage, buckets, stage-3 prefetch and
// persistence, and the offload sub-sections. Sizes are in elements, as DeepSpeed's are.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <zero/config/json_reader.hpp>
#include <zero/config/key_table.hpp>
#include <zero/policies/offload.hpp>

namespace zero::config {

// Where offloaded state lives: zero::OffloadDevice (zero/policies/offload.hpp), the same words
// as the Offload<None|CPU|NVMe> policy tags.
using zero::name_of;
using zero::OffloadDevice;

/// "offload_optimizer" or "offload_param".
struct OffloadConfig {
  OffloadDevice device = OffloadDevice::none;
  std::string nvme_path;                   ///< required for nvme
  std::int64_t buffer_count = 4;           ///< DeepSpeed: 4 (optimizer), 5 (param)
  std::int64_t buffer_size = 100'000'000;  ///< param offload buffer, elements
  std::int64_t max_in_cpu = 1'000'000'000;
  bool pin_memory = false;
  bool pipeline_read = false, pipeline_write = false;
  double ratio = 1.0;

  /// Reads the section at r (DeepSpeed's buffer_count default is default_buffers); key paths
  /// nobody reads are appended to unknown (config/key_table.hpp says which keys take effect).
  static OffloadConfig read(JsonReader r, std::int64_t default_buffers,
                            std::vector<std::string>& unknown) {
    OffloadConfig c;
    c.buffer_count = default_buffers;
    if (auto d = r.string("device")) {
      if (*d == "none")
        c.device = OffloadDevice::none;
      else if (*d == "cpu")
        c.device = OffloadDevice::cpu;
      else if (*d == "nvme")
        c.device = OffloadDevice::nvme;
      else
        raise<ConfigError>(r.where("device"), ": '", *d,
                           "' is not an offload device; expected none, cpu or nvme");
    }
    c.nvme_path = r.string("nvme_path").value_or("");
    c.buffer_count = r.integer("buffer_count").value_or(c.buffer_count);
    c.buffer_size = r.integer("buffer_size").value_or(c.buffer_size);
    c.max_in_cpu = r.integer("max_in_cpu").value_or(c.max_in_cpu);
    c.pin_memory = r.boolean("pin_memory").value_or(false);
    c.pipeline_read = r.boolean("pipeline_read").value_or(false);
    c.pipeline_write = r.boolean("pipeline_write").value_or(false);
    c.ratio = r.number("ratio").value_or(1.0);
    expect<ConfigError>(c.device != OffloadDevice::nvme || !c.nvme_path.empty(),
                        r.where("nvme_path"), ": required when device is nvme");
    expect<ConfigError>(c.buffer_count > 0, r.where("buffer_count"), ": ", c.buffer_count,
                        " must be positive");
    expect<ConfigError>(c.ratio > 0 && c.ratio <= 1, r.where("ratio"), ": ", c.ratio,
                        " must be in (0, 1]");
    expect<ConfigError>(c.buffer_size > 0, r.where("buffer_size"), ": ", c.buffer_size,
                        " must be positive (elements)");
    expect<ConfigError>(c.max_in_cpu >= 0, r.where("max_in_cpu"), ": ", c.max_in_cpu,
                        " must be >= 0 (elements)");
    read_inert(r);
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }
};

/// "zeropp_loco_param": ZeRO++'s LoCo error feedback for qgZ (EngineOptions::loco), with
/// DeepSpeed's values when a key is absent.
struct LocoConfig {
  double err_beta = 0.8;        ///< the share of the old error kept, in [0, 1)
  std::int64_t reset_T = 1024;  ///< reductions of a unit between resets of its errors, >= 1
};

/// The ZeRO section. Empty optionals are "auto": the engine fills them from the model.
struct ZeroOptimizationConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  bool overlap_comm = false;
  bool allgather_partitions = true;
  std::optional<std::int64_t> reduce_bucket_size = 500'000'000;
  std::int64_t allgather_bucket_size = 500'000'000;
  std::int64_t sub_group_size = 1'000'000'000;
  bool sub_group_size_given = false;  ///< set explicitly (NVMe offload picks its own otherwise)
  std::optional<std::int64_t> stage3_prefetch_bucket_size = 50'000'000;
  std::optional<std::int64_t> stage3_param_persistence_threshold = 100'000;
  std::int64_t stage3_max_live_parameters = 1'000'000'000;
  std::int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  /// MiCS's shard group size (hybrid sharding: EngineOptions::shard_size); -1 shards over the
  /// whole data-parallel group.
  std::int64_t mics_shard_size = -1;
  /// ZeRO++'s hierarchical partitioning (hpZ: EngineOptions::hpz_size): the ranks of the
  /// secondary partition stage 3's backward gathers each unit from; 1 gathers over the whole
  /// data-parallel group.
  std::int64_t zero_hpz_partition_size = 1;
  /// ZeRO++'s quantized weights (qwZ: EngineOptions::quantized_weights): stage 3 gathers
  /// parameters as block-wise int8.
  bool zero_quantized_weights = false;
  /// ZeRO++'s quantized gradients (qgZ: EngineOptions::quantized_gradients): stage 3 reduces
  /// gradients by an all-to-all of block-wise int8 or int4.
  bool zero_quantized_gradients = false;
  /// zero's own: the bits of qgZ's codes (EngineOptions::quantized_gradient_bits), 8 or 4
  /// (DeepSpeed's width); absent: the engine's own (8).
  std::optional<std::int64_t> zero_quantized_gradient_bits;
  /// ZeRO++'s LoCo (EngineOptions::loco); absent or null: off.
  std::optional<LocoConfig> zeropp_loco_param;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
};

}  // namespace zero::config
