#pragma once
// The one table of every DeepSpeed (and zero) config key that zero knows: whether zero applies
// it, or accepts it without effect, and why. The parser checks that every key it reads is listed
// here, the start-up notices ("accepted but has no effect in zero: <key> (<why>)") are computed
// from it, unknown keys get their nearest listed key as a suggestion, and a test walks every row
// (tests/config), so no key can be parsed and then silently ignored.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/config/json_reader.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

/// What zero does with a key.
enum class KeyEffect : unsigned char {
  applied,    ///< read and acted on (possibly only in some configurations: see inert_when)
  no_effect,  ///< accepted so DeepSpeed configs load, but zero does nothing with it
};

/// The value at a dotted key path of a JSON object, or null when absent.
inline const nlohmann::json* json_at(const nlohmann::json& root, std::string_view path) {
  const nlohmann::json* node = &root;
  while (!path.empty()) {
    const std::size_t dot = path.find('.');
    const std::string key(path.substr(0, dot));
    if (!node->is_object() || !node->contains(key)) return nullptr;
    node = &node->at(key);
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return node;
}

namespace keys {
// Facts about the raw config the conditions below read (absent/"auto"/bad values fall back).
inline int stage(const nlohmann::json& root) {
  // A whole float (3.0) is the stage it names, as JsonReader::integer reads it.
  const auto* v = json_at(root, "zero_optimization.stage");
  if (v == nullptr || !v->is_number()) return 0;
  const double d = v->get<double>();
  return d >= 0 && d <= 3 && std::floor(d) == d ? static_cast<int>(d) : 0;
}
inline bool is_true(const nlohmann::json& root, std::string_view path) {
  const auto* v = json_at(root, path);
  return v != nullptr && v->is_boolean() && v->get<bool>();
}
inline std::string text(const nlohmann::json& root, std::string_view path) {
  const auto* v = json_at(root, path);
  return v != nullptr && v->is_string() ? v->get<std::string>() : std::string();
}
inline bool nvme(const nlohmann::json& root) {
  return text(root, "zero_optimization.offload_optimizer.device") == "nvme" ||
         text(root, "zero_optimization.offload_param.device") == "nvme";
}
inline bool fp16(const nlohmann::json& root) {
  return is_true(root, "fp16.enabled");
}

// Conditions of keys that zero applies only in some configurations: each returns why the key
// has no effect in this one, or nullptr when it does take effect.
inline const char* unless_stage3(const nlohmann::json& root) {
  return stage(root) == 3 ? nullptr : "only stage 3 gathers parameters; this config has stage < 3";
}
inline const char* unless_nvme(const nlohmann::json& root) {
  return nvme(root) ? nullptr : "only NVMe offload reads it; this config offloads nothing to nvme";
}
// offload_param's swap buffers: one swapper holds both sections' states, and with
// offload_optimizer on nvme too it takes that section's buffer_count and pin_memory.
inline const char* unless_param_swapper(const nlohmann::json& root) {
  if (!nvme(root)) return unless_nvme(root);
  return text(root, "zero_optimization.offload_optimizer.device") == "nvme"
             ? "offload_optimizer is on nvme too: one swapper holds both, with "
               "offload_optimizer's buffer_count and pin_memory"
             : nullptr;
}
inline const char* unless_cpu_offload(const nlohmann::json& root) {
  return text(root, "zero_optimization.offload_optimizer.device") == "cpu"
             ? nullptr
             : "only Offload<CPU> keeps part of its states on the device; offload_optimizer is "
               "not on cpu";
}
inline const char* unless_quantized_gradients(const nlohmann::json& root) {
  if (const char* why = unless_stage3(root)) return why;
  return is_true(root, "zero_optimization.zero_quantized_gradients")
             ? nullptr
             : "only qgZ packs gradients; zero_optimization.zero_quantized_gradients is not true";
}
inline const char* unless_sharding(const nlohmann::json& root) {
  return stage(root) >= 1 ? nullptr : "stage 0 shards nothing; this config has stage 0";
}
inline const char* unless_fp16(const nlohmann::json& root) {
  return fp16(root) ? nullptr : "only an fp16 engine scales the loss; fp16.enabled is not true";
}
inline const char* unless_overlapping(const nlohmann::json& root) {
  const auto* v = json_at(root, "zero_optimization.overlap_comm");
  return v != nullptr && v->is_boolean() && !v->get<bool>()
             ? "zero always overlaps each unit's gradient reduction with the next units' "
               "backward (at most 2 in flight)"
             : nullptr;
}
inline const char* unless_comm_type_matches(const nlohmann::json& root) {
  // What the engine reduces in: the fp32 accumulator at stages 0-1, the compute gradient at
  // stages 2-3 (reduce-scattered every micro-step).
  const std::string want = lowercase(text(root, "communication_data_type"));
  const std::string compute = is_true(root, "bf16.enabled")       ? "bf16"
                              : is_true(root, "bfloat16.enabled") ? "bf16"
                              : fp16(root)                        ? "fp16"
                                                                  : "fp32";
  const std::string reduces = stage(root) <= 1 ? "fp32" : compute;
  if (want.empty() || want == reduces) return nullptr;
  return stage(root) <= 1 ? "at stages 0-1 zero reduces the fp32 gradient accumulator"
                          : "at stages 2-3 zero reduces gradients in the compute precision";
}
}  // namespace keys

/// One known key: its dotted path (a whole section when the section is listed alone), what zero
/// does with it, why, a valid non-default example value (JSON text, for the walking test), the
/// DeepSpeed default (JSON text; a key set to it asks for nothing, so it gets no notice) and,
/// for applied keys, when it has no effect after all.
struct KeyInfo {
  std::string_view path;
  KeyEffect effect;
  std::string_view why;
  std::string_view sample;
  std::string_view default_value = {};
  const char* (*inert_when)(const nlohmann::json& root) = nullptr;
};

/// Every key zero knows (see the file comment). Sections listed alone are accepted whole.
inline std::span<const KeyInfo> known_keys() {
  using enum KeyEffect;
  static constexpr KeyInfo table[] = {
      // ---- batch, clipping, printing
      {"train_batch_size", applied, "global batch: sets the accumulation window", "16"},
      {"train_micro_batch_size_per_gpu", applied, "rows per rank per micro-step", "4"},
      {"gradient_accumulation_steps", applied, "micro-steps per optimizer step", "2"},
      {"gradient_clipping", applied, "max global L2 norm of the gradient", "1.0"},
      {"prescale_gradients", no_effect,
       "zero averages inside the reduction (ReduceOp::avg), so there is no separate division to "
       "move",
       "true", "false"},
      {"gradient_predivide_factor", no_effect,
       "zero averages inside the reduction (ReduceOp::avg), so there is no separate division to "
       "split",
       "2.0", "1.0"},
      {"steps_per_print", applied,
       "the program's print interval (train_gpt prints every N steps; the engine prints nothing)",
       "100"},
      {"wall_clock_breakdown", applied,
       "the engine times forward, backward, the gather and reduction waits and the step "
       "(zero::profile); the program prints them every steps_per_print",
       "true", "false"},
      {"memory_breakdown", applied,
       "model states by kind, activation peak, swap bytes and RSS beside the estimator "
       "(zero::profile)",
       "true", "false"},
      {"dump_state", no_effect, "zero does not print its state", "true", "false"},
      {"zero_allow_untested_optimizer", no_effect,
       "every optimizer zero accepts is tested with every stage", "true", "false"},
      {"zero_force_ds_cpu_optimizer", no_effect,
       "zero's optimizers are always its own fused host kernels", "false", "true"},
      {"communication_data_type",
       applied,
       "names the type gradients are reduced in; it must be the one zero reduces in",
       "\"fp32\"",
       {},
       keys::unless_comm_type_matches},
      {"comm_timeout_s", applied,
       "zero's own: deadline of every collective wait (CommOptions::timeout_s of the engine's "
       "communicator)",
       "60"},
      {"nonfinite_policy", applied, "zero's own: skip or raise on an Inf/NaN loss or gradient",
       "\"raise\""},
      // ---- precision
      {"fp16.enabled", applied, "the engine computes in fp16 (zero::dispatch picks it)", "true"},
      {"fp16.loss_scale", applied, "static loss scale (0 = dynamic)", "128", "0",
       keys::unless_fp16},
      {"fp16.initial_scale_power", applied, "dynamic scale starts at 2^power", "12", "16",
       keys::unless_fp16},
      {"fp16.loss_scale_window", applied, "steps without overflow before the scale grows", "500",
       "1000", keys::unless_fp16},
      {"fp16.hysteresis", applied, "overflows tolerated before the scale shrinks", "3", "2",
       keys::unless_fp16},
      {"fp16.consecutive_hysteresis", applied, "refill hysteresis on good steps", "true", "false",
       keys::unless_fp16},
      {"fp16.min_loss_scale", applied, "lower bound of the dynamic scale", "2", "1",
       keys::unless_fp16},
      {"fp16.auto_cast", no_effect, "zero's models compute wholly in the engine's precision",
       "true", "false"},
      {"fp16.fp16_master_weights_and_grads", no_effect,
       "zero always keeps an fp32 master and fp32 gradient accumulators", "true", "false"},
      {"bf16.enabled", applied, "the engine computes in bf16 (zero::dispatch picks it)", "true"},
      {"bf16.immediate_grad_update", no_effect,
       "gradients accumulate in fp32 and the update runs at the step boundary", "true", "false"},
      {"bfloat16.enabled", applied, "DeepSpeed's older spelling of bf16.enabled", "true"},
      {"bfloat16.immediate_grad_update", no_effect,
       "gradients accumulate in fp32 and the update runs at the step boundary", "true", "false"},
      {"data_types", no_effect, "gradients always accumulate in fp32 (the master type)",
       "{\"grad_accum_dtype\": \"bf16\"}"},
      // ---- optimizer and schedule
      {"optimizer.type", applied, "the per-shard optimizer", "\"AdamW\""},
      {"optimizer.params", applied, "its hyper-parameters (unknown ones are errors)",
       "{\"lr\": 0.01}"},
      {"scheduler.type", applied, "the learning-rate schedule", "\"WarmupLR\""},
      {"scheduler.params", applied, "its parameters (unknown ones are errors)",
       "{\"warmup_num_steps\": 10}"},
      // ---- sections zero accepts whole without acting on them
      {"activation_checkpointing", no_effect,
       "the model decides checkpointing (nn::GPT checkpoints its blocks; "
       "Sequential::set_checkpoint)",
       "{\"partition_activations\": true}"},
      // ---- observability (config/observability.hpp, zero::profile)
      {"flops_profiler.enabled", applied, "print the FLOPs profile once at profile_step", "true",
       "false"},
      {"flops_profiler.profile_step", applied,
       "the optimizer steps finished before the profiled one (DeepSpeed's global_steps)", "3", "1"},
      {"flops_profiler.module_depth", applied, "deepest level of the aggregated table", "1", "-1"},
      {"flops_profiler.top_modules", applied, "modules listed per depth", "3", "1"},
      {"flops_profiler.detailed", applied, "also print the per-unit tree", "false", "true"},
      {"flops_profiler.output_file", applied, "write the profile to this file", "\"profile.txt\""},
      {"comms_logger.enabled", applied, "print the communication summary", "true", "false"},
      {"comms_logger.verbose", applied, "one line per op as it completes", "true", "false"},
      {"comms_logger.prof_all", applied, "record every op (false: only prof_ops)", "false", "true"},
      {"comms_logger.prof_ops", applied, "the ops recorded when prof_all is false",
       "[\"all_reduce\"]"},
      {"comms_logger.debug", no_effect, "verbose lines always name the group", "true", "false"},
      {"checkpoint", no_effect,
       "zero's checkpoints are always atomic, tagged and loadable at any world size",
       "{\"tag_validation\": \"Fail\"}"},
      {"tensorboard", no_effect, "the program writes metrics (train_gpt --metrics)",
       "{\"enabled\": true}"},
      {"wandb", no_effect, "the program writes metrics (train_gpt --metrics)",
       "{\"enabled\": true}"},
      {"csv_monitor", no_effect, "the program writes metrics (train_gpt --metrics)",
       "{\"enabled\": true}"},
      // ---- tensor parallelism (config/tensor_parallel.hpp)
      {"tensor_parallel.autotp_size", applied,
       "ranks each layer is split over (the program builds its grid from it: train_gpt)", "2"},
      {"tensor_parallel.tp_size", applied,
       "zero's and DeepSpeed inference's spelling of autotp_size", "2"},
      {"tensor_parallel.sequence_parallel", applied,
       "Megatron sequence parallelism (needs a tensor-parallel size above 1)", "true"},
      {"tensor_model_parallel_size", applied, "Megatron's spelling of the tensor-parallel size",
       "2"},
      // ---- mixture of experts (config/moe.hpp) and Ulysses sequence parallelism
      {"moe.num_experts", applied,
       "experts per MoE layer (the program builds its model: train_gpt)", "4"},
      {"moe.ep_size", applied, "expert-parallel ranks the experts split over", "2"},
      {"moe.k", applied, "experts per token (1 Switch, 2 GShard)", "2"},
      {"moe.capacity_factor", applied, "slots per expert relative to an even split", "1.25"},
      {"moe.min_capacity", applied, "fewest slots per expert", "8"},
      {"moe.drop_tokens", applied, "drop choices past an expert's capacity", "false"},
      {"moe.use_rts", applied,
       "random token selection: an expert over capacity keeps random tokens (top-1)", "true"},
      {"moe.eval_capacity_factor", applied, "capacity_factor outside training", "2.0"},
      {"moe.noisy_gate_policy", applied,
       "noise on the router: Jitter (its input) or RSample (Gumbel on top-1's logits)",
       "\"Jitter\""},
      {"moe.top2_2nd_expert_sampling", applied,
       "top-2's second choice sampled by Gumbel noise on the logits", "true"},
      {"moe.aux_loss_coef", applied, "load-balancing loss weight", "0.02"},
      {"moe.z_loss_coef", applied, "router z-loss weight", "0.001"},
      {"moe.expert_interval", applied, "every k-th block is an MoE block", "1"},
      {"moe.expert_tensor_parallel_size", applied,
       "1: whole experts over the tensor-parallel ranks; unset or tp: each expert split over tp",
       "1"},
      {"sequence_parallel_size", applied,
       "DeepSpeed-Ulysses sequence-parallel ranks (the program builds its grid from it)", "2"},
      // ---- NVMe I/O
      {"aio.block_size", applied, "bytes per swap request", "524288", "1048576", keys::unless_nvme},
      {"aio.queue_depth", applied, "swap requests in flight", "16", "8", keys::unless_nvme},
      {"aio.intra_op_parallelism", applied, "threads of the pread/pwrite fallback", "2", "1",
       keys::unless_nvme},
      {"aio.thread_count", applied, "older spelling of aio.intra_op_parallelism", "2", "1",
       keys::unless_nvme},
      {"aio.single_submit", applied, "submit swap requests one at a time", "true", "false",
       keys::unless_nvme},
      {"aio.overlap_events", applied, "refill the queue as requests finish", "false", "true",
       keys::unless_nvme},
      {"aio.use_gds", applied, "must be false: GPUDirect Storage is not supported", "false"},
      // ---- zero_optimization
      {"zero_optimization.stage", applied, "the ZeRO stage (zero::dispatch picks the engine)", "1"},
      {"zero_optimization.contiguous_gradients", no_effect,
       "each unit's gradient is always one contiguous buffer", "false", "true"},
      {"zero_optimization.reduce_scatter", no_effect,
       "stages 1-3 always reduce-scatter, stage 0 always all-reduces", "false", "true"},
      {"zero_optimization.overlap_comm",
       applied,
       "zero always overlaps reductions with the backward; false cannot turn that off",
       "true",
       {},
       keys::unless_overlapping},
      {"zero_optimization.allgather_partitions", no_effect,
       "zero always all-gathers the updated shards", "false", "true"},
      {"zero_optimization.reduce_bucket_size", no_effect,
       "each unit's gradient is reduced as one collective (the unit is the bucket)", "200000000",
       "500000000"},
      {"zero_optimization.allgather_bucket_size", no_effect,
       "each unit is gathered as one collective (the unit is the bucket)", "200000000",
       "500000000"},
      {"zero_optimization.use_multi_rank_bucket_allreduce", no_effect,
       "zero does not bucket gradients across units", "false", "true"},
      {"zero_optimization.load_from_fp32_weights", no_effect,
       "zero's checkpoints hold only the fp32 master, and it is what loads", "false", "true"},
      {"zero_optimization.round_robin_gradients", no_effect,
       "zero does not copy gradients to a CPU optimizer", "true", "false"},
      {"zero_optimization.ignore_unused_parameters", no_effect,
       "an unused parameter gets a zero gradient, never an error", "false", "true"},
      {"zero_optimization.memory_efficient_linear", no_effect,
       "zero's linear layers already save only their input", "false", "true"},
      {"zero_optimization.elastic_checkpoint", no_effect,
       "checkpoints load at any world size anyway", "true", "false"},
      {"zero_optimization.sub_group_size", no_effect,
       "NVMe offload swaps one sub-group per unit and does not split units: smaller units make "
       "smaller swap buffers",
       "100000000", "1000000000"},
      {"zero_optimization.stage3_prefetch_bucket_size", applied, "elements gathered ahead of use",
       "1000000", "50000000", keys::unless_stage3},
      {"zero_optimization.stage3_param_persistence_threshold", applied,
       "units up to this many elements stay gathered", "1000", "100000", keys::unless_stage3},
      {"zero_optimization.stage3_max_live_parameters", applied,
       "prefetching stops before the gathered elements exceed it", "1000000", "1000000000",
       keys::unless_stage3},
      {"zero_optimization.stage3_max_reuse_distance", no_effect,
       "a unit is released after use unless it is persistent or used by a later unit", "1000000",
       "1000000000"},
      {"zero_optimization.stage3_gather_16bit_weights_on_model_save", no_effect,
       "checkpoints hold the fp32 master; export 16-bit weights with save_gpt2_weights or "
       "zero_to_safetensors",
       "true", "false"},
      {"zero_optimization.stage3_gather_fp16_weights_on_model_save", no_effect,
       "older spelling of stage3_gather_16bit_weights_on_model_save", "true", "false"},
      {"zero_optimization.cpu_offload", applied, "deprecated spelling of offload_optimizer cpu",
       "true"},
      {"zero_optimization.cpu_offload_param", applied, "deprecated spelling of offload_param cpu",
       "true"},
      {"zero_optimization.cpu_offload_use_pin_memory", no_effect,
       "deprecated; DeepSpeed ignores it too: pin_memory in offload_optimizer or offload_param",
       "true"},
      {"zero_optimization.offload_optimizer.device", applied,
       "where the master and optimizer states live", "\"nvme\""},
      {"zero_optimization.offload_optimizer.nvme_path",
       applied,
       "directory of the swap files",
       "\"/tmp\"",
       {},
       keys::unless_nvme},
      {"zero_optimization.offload_optimizer.buffer_count", applied, "swap buffers", "2", "4",
       keys::unless_nvme},
      {"zero_optimization.offload_optimizer.pin_memory", applied, "mlock the swap buffers", "true",
       "false", keys::unless_nvme},
      {"zero_optimization.offload_optimizer.pipeline_read", no_effect,
       "the swapper schedules its own reads (buffer_count buffers in flight)", "true", "false"},
      {"zero_optimization.offload_optimizer.pipeline_write", no_effect,
       "the swapper schedules its own writes (buffer_count buffers in flight)", "true", "false"},
      {"zero_optimization.offload_optimizer.fast_init", no_effect,
       "initialisation is always sharded", "true", "false"},
      {"zero_optimization.offload_optimizer.ratio", applied,
       "Twin-Flow: the fraction of the states offloaded; the last units keep theirs on the device",
       "0.5", "1.0", keys::unless_cpu_offload},
      {"zero_optimization.offload_optimizer.buffer_size", no_effect,
       "a key of offload_param; swap buffers are sized from sub_group_size", "1000000",
       "100000000"},
      {"zero_optimization.offload_optimizer.max_in_cpu", no_effect,
       "a key of offload_param; the master lives in the swap files", "1000000", "1000000000"},
      {"zero_optimization.offload_param.device", applied,
       "stage 3: parameter shards go where the master goes", "\"nvme\""},
      {"zero_optimization.offload_param.nvme_path",
       applied,
       "directory of the swap files (offload_optimizer's must be the same when both are nvme)",
       "\"/tmp\"",
       {},
       keys::unless_nvme},
      {"zero_optimization.offload_param.buffer_count", applied,
       "swap buffers (offload_optimizer's when it is on nvme too)", "2", "5",
       keys::unless_param_swapper},
      {"zero_optimization.offload_param.pin_memory", applied,
       "mlock the swap buffers (offload_optimizer's when it is on nvme too)", "true", "false",
       keys::unless_param_swapper},
      {"zero_optimization.offload_param.buffer_size", no_effect,
       "swap buffers are sized from sub_group_size", "1000000", "100000000"},
      {"zero_optimization.offload_param.max_in_cpu", no_effect,
       "parameter shards live in the same swap files as the master", "1000000", "1000000000"},
      {"zero_optimization.offload_param.pipeline_read", no_effect,
       "the swapper schedules its own reads (buffer_count buffers in flight)", "true", "false"},
      {"zero_optimization.offload_param.pipeline_write", no_effect,
       "the swapper schedules its own writes (buffer_count buffers in flight)", "true", "false"},
      {"zero_optimization.offload_param.fast_init", no_effect, "initialisation is always sharded",
       "true", "false"},
      {"zero_optimization.offload_param.ratio", no_effect,
       "zero offloads all of the parameter shards or none", "0.5", "1.0"},
      // ---- documented DeepSpeed features zero does not have
      {"zero_optimization.stage3_model_persistence_threshold", no_effect,
       "persistence is decided per unit by stage3_param_persistence_threshold alone", "1000000"},
      {"zero_optimization.stage3_module_granularity_threshold", no_effect,
       "the model's units are the gather granularity", "100", "0"},
      {"zero_optimization.stage3_use_all_reduce_for_fetch_params", no_effect,
       "units are always gathered with all-gather", "true", "false"},
      {"zero_optimization.override_module_apply", no_effect, "zero has no module hooks", "false",
       "true"},
      {"zero_optimization.pipeline_loading_checkpoint", no_effect,
       "every rank reads only its own shard files", "true", "false"},
      {"zero_optimization.log_trace_cache_warnings", no_effect,
       "zero's unit order is static: there is no trace to cache", "true", "false"},
      {"zero_optimization.zero_hpz_partition_size", applied,
       "ZeRO++ hierarchical partitioning: ranks of the secondary partition stage 3's backward "
       "gathers each unit from",
       "8", "1", keys::unless_stage3},
      {"zero_optimization.zero_quantized_weights", applied,
       "ZeRO++ quantized weights: stage 3 gathers parameters as block-wise int8", "true", "false",
       keys::unless_stage3},
      {"zero_optimization.zero_quantized_nontrainable_weights", no_effect,
       "ZeRO++ quantized non-trainable weights are not implemented: every unit parameter trains",
       "true", "false"},
      {"zero_optimization.zero_quantized_gradients", applied,
       "ZeRO++ quantized gradients: stage 3 reduces gradients by an all-to-all of block-wise int8 "
       "(or int4: zero_quantized_gradient_bits)",
       "true", "false", keys::unless_stage3},
      {"zero_optimization.zero_quantized_gradient_bits", applied,
       "zero's own: the bits of qgZ's codes, 8 or 4 (the width DeepSpeed's qgZ sends)", "4", "8",
       keys::unless_quantized_gradients},
      {"zero_optimization.zeropp_loco_param.err_beta", applied,
       "ZeRO++ LoCo: error feedback for qgZ's packings, the share of the old error kept", "0.5",
       "0.8", keys::unless_quantized_gradients},
      {"zero_optimization.zeropp_loco_param.reset_T", applied,
       "ZeRO++ LoCo: a unit's reductions between resets of its kept errors", "64", "1024",
       keys::unless_quantized_gradients},
      {"zero_optimization.mics_shard_size", applied,
       "hybrid sharding: ranks each unit is sharded over, replicated across the rest of the "
       "data-parallel group",
       "8", "-1", keys::unless_sharding},
      {"zero_optimization.mics_hierarchical_params_gather", no_effect,
       "a unit is gathered inside its shard group, one all-gather per unit", "true", "false"},
      // ---- pipeline parallelism (config/pipeline.hpp); after the ZeRO rows so that a tie in
      // nearest_key ("stage") still suggests zero_optimization.stage
      {"pipeline.stages", applied,
       "pipeline-parallel size: stages the layers are split into (\"auto\": the program "
       "decides)",
       "\"auto\""},
      {"pipeline.virtual_stages", applied,
       "model chunks per stage (the interleaved schedule; above 1 it implies it)", "2"},
      {"pipeline.schedule", applied,
       "the pipeline schedule: gpipe, 1f1b, interleaved or zb (zb-h1)", "\"gpipe\""},
      {"pipeline.partition_method", applied,
       "how the units are split into stages: uniform, parameters or type:<regex>", "\"uniform\""},
      {"pipeline.partition", no_effect,
       "DeepSpeed's partition is not read; zero splits stages by pipeline.partition_method",
       "\"uniform\"", "\"best\""},
      {"pipeline.seed_layers", no_effect,
       "zero initialises every parameter from (seed, name, index), so the layout never changes "
       "the values",
       "true", "false"},
      {"pipeline.activation_checkpoint_interval", no_effect,
       "the model decides checkpointing (nn::GPT checkpoints its blocks; "
       "Sequential::set_checkpoint); the executor keeps each pass's activations until its "
       "backward and recomputes a stage's forward only for a model that cannot park",
       "1"},
      {"pipeline.pipe_partitioned", no_effect,
       "activations cross stages whole on each tensor-parallel rank", "false", "true"},
      {"pipeline.grad_partitioned", no_effect,
       "gradients cross stages whole on each tensor-parallel rank", "false", "true"},
      {"pipeline_model_parallel_size", applied, "Megatron's spelling of pipeline.stages", "1"},
      {"virtual_pipeline_model_parallel_size", applied,
       "Megatron's spelling of pipeline.virtual_stages (above 1 without a schedule: interleaved)",
       "2"},
  };
  return table;
}

/// The row of path (an exact key, or the section that holds it), or null.
inline const KeyInfo* find_key(std::string_view path) {
  for (const KeyInfo& k : known_keys()) {
    if (k.path == path) return &k;
  }
  for (const KeyInfo& k : known_keys()) {  // a key inside a section listed whole
    if (path.size() > k.path.size() && path.starts_with(k.path) && path[k.path.size()] == '.')
      return &k;
  }
  return nullptr;
}

/// Reads the keys of r's object that the table lists without effect and that no field has read
/// already, so they are not reported unknown; a value of another kind than the table's sample
/// (a string where a boolean belongs) is a ConfigError naming the key.
inline void read_inert(JsonReader& r) {
  const std::string prefix = r.path().empty() ? "" : r.path() + ".";
  for (const KeyInfo& k : known_keys()) {
    if (k.effect != KeyEffect::no_effect || !k.path.starts_with(prefix)) continue;
    const std::string name(k.path.substr(prefix.size()));
    if (name.find('.') != std::string::npos || r.was_read(name) || !r.has(name)) continue;
    const nlohmann::json value = r.raw(name);
    if (r.is_auto(name)) continue;  // the parser decides whether "auto" may stand here
    const nlohmann::json sample = nlohmann::json::parse(k.sample);
    const bool same_kind =
        (sample.is_boolean() && value.is_boolean()) || (sample.is_number() && value.is_number()) ||
        (sample.is_string() && value.is_string()) || (sample.is_object() && value.is_object());
    expect<ConfigError>(same_kind, r.where(name), ": expected ",
                        sample.is_boolean()  ? "true or false"
                        : sample.is_number() ? "a number"
                        : sample.is_string() ? "a string"
                                             : "an object",
                        ", got ", value.dump());
  }
}

/// Levenshtein distance of a and b.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

/// The known key nearest to an unknown key path, or "" when none is close: the last names are
/// compared (so a key written in the wrong section finds its place), a key in the same section
/// wins a tie, and a suggestion needs at most a third of the name changed.
inline std::string nearest_key(std::string_view path) {
  const auto split = [](std::string_view p) {
    const std::size_t dot = p.rfind('.');
    return dot == std::string_view::npos
               ? std::pair<std::string_view, std::string_view>{"", p}
               : std::pair<std::string_view, std::string_view>{p.substr(0, dot), p.substr(dot + 1)};
  };
  const auto [parent, name] = split(path);
  std::string best;
  std::size_t best_score = std::string::npos;
  const auto consider = [&](std::string_view candidate) {
    const auto [kparent, kname] = split(candidate);
    const std::size_t d = edit_distance(name, kname);
    if (d > std::max<std::size_t>(1, name.size() / 3)) return;
    const std::size_t score = 2 * d + (kparent == parent ? 0 : 1);
    if (score < best_score) {
      best_score = score;
      best = std::string(candidate);
    }
  };
  // Every known key, and every section above one (a misspelled zero_optimization is a section).
  for (const KeyInfo& k : known_keys()) {
    for (std::size_t dot = k.path.find('.'); dot != std::string_view::npos;
         dot = k.path.find('.', dot + 1)) {
      consider(k.path.substr(0, dot));
    }
    consider(k.path);
  }
  return best;
}

/// "accepted but has no effect in zero: <key> (<why>)" for every key of root that is present
/// and has no effect in this configuration (a key set to DeepSpeed's default asks for nothing
/// zero does not do, so it is not listed).
inline std::vector<std::string> no_effect_notices(const nlohmann::json& root) {
  std::vector<std::string> out;
  for (const KeyInfo& k : known_keys()) {
    const nlohmann::json* v = json_at(root, k.path);
    if (v == nullptr) continue;
    if (!k.default_value.empty() && *v == nlohmann::json::parse(k.default_value)) continue;
    const char* why = nullptr;
    if (k.effect == KeyEffect::no_effect) {
      why = "";
    } else if (k.inert_when != nullptr) {
      why = k.inert_when(root);
    }
    if (why != nullptr) {
      const std::string reason = *why == '\0' ? std::string(k.why) : std::string(why);
      out.push_back("accepted but has no effect in zero: " + std::string(k.path) + " (" + reason +
                    ")");
    }
  }
  return out;
}

}  // namespace zero::config
