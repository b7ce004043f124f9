#pragma once
// Run-time settings of an Engine and the micro-batch it consumes. EngineOptions::with_config
// takes the DeepSpeed keys that are numbers rather than policies (accumulation, clipping, the
// fp16 loss-scale block, stage-3 prefetch, persistence and live bound); the structural keys (stage,
// precision, offload) are checked against the engine's policies by the engine itself.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <optim/loss_scaler.hpp>
#include <zero/config/config.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/inputs.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/offload/fault_injector.hpp>

namespace zero::engine {

/// What the engine does when a micro-step's loss, or the step's gradient norm, is Inf or NaN.
enum class NonFinitePolicy : unsigned char {
  skip,   ///< skip the optimizer step on every rank and count it (DeepSpeed's fp16 behaviour)
  raise,  ///< throw NonFiniteError on every rank
};

/// A loss or gradient norm was Inf/NaN and the policy is NonFinitePolicy::raise.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

/// Run-time settings of an Engine.
struct EngineOptions {
  /// Per-name initialisation seed, and the seed of the dropout masks (nn::StepContext::seed).
  std::uint64_t seed = 1234;
  int gradient_accumulation_steps = 1;                ///< micro-steps per optimizer step
  std::int64_t shard_alignment = 16;                  ///< elements; keeps shards vector-aligned
  std::size_t activation_bytes = 256 << 20;           ///< arena for saved activations
  double gradient_clipping = 0.0;                     ///< max global L2 norm; 0 turns clipping off
  NonFinitePolicy nonfinite = NonFinitePolicy::skip;  ///< Inf/NaN loss or gradient norm
  optim::LossScalerConfig loss_scaler;                ///< fp16 only (Precision<f16>)
  /// Stage 3: elements of upcoming units gathered ahead of use (DeepSpeed's
  /// stage3_prefetch_bucket_size); 0 gathers each unit only when it runs.
  std::int64_t prefetch_elems = 50'000'000;
  /// Stage 3: units of at most this many elements stay gathered for the whole run (DeepSpeed's
  /// stage3_param_persistence_threshold, applied per unit rather than per parameter).
  std::int64_t persistence_threshold = 100'000;
  /// Stage 3 under Offload<NVMe>: the prefetch reads the master slices of the units in its window
  /// ahead (each into a swap buffer of its own, up to buffer_count - 1 at once; past a training
  /// forward's last unit, those the backward gathers first) and starts a unit's gather at the
  /// next prefetch, so the read overlaps the compute of the units before it; the step's pass
  /// leaves the first units' slices in its buffers for the next forward. false reads each slice
  /// when its gather starts.
  bool nvme_read_ahead = true;
  /// Stage 3: prefetching stops before the gathered units would hold more than this many
  /// elements (DeepSpeed's stage3_max_live_parameters); the unit about to run is always gathered.
  std::int64_t max_live_elems = 1'000'000'000;
  /// Gradient reductions in flight during backward (each holds one unit-sized buffer).
  int max_pending_reductions = 2;
  /// Hybrid sharding (DeepSpeed's MiCS, FSDP's HYBRID_SHARD; zero_optimization.mics_shard_size):
  /// stages 1-3 shard each unit over groups of this many consecutive data-parallel ranks (the
  /// expert data-parallel ones for an expert unit) instead of all of them; the ranks at the same
  /// place of every group hold the same shards, and average each reduced gradient shard over
  /// themselves after its reduce-scatter in the group. Gathers stay inside a group. 0 (the
  /// default) shards over the whole group; otherwise it must divide it.
  int shard_size = 0;
  /// ZeRO++'s hierarchical partitioning (hpZ; zero_optimization.zero_hpz_partition_size), stage
  /// 3: each forward gathers a unit over the whole group as before and keeps this rank's share
  /// of it among groups of hpz_size consecutive ranks (a secondary shard in the compute type,
  /// 1/hpz_size of the unit, until the step); the backward gathers the unit from those secondary
  /// shards inside the group (one node's ranks), so only the forward's gather crosses nodes.
  /// Gradients and the optimizer stay sharded over the whole group. 0 or 1 (the default): off;
  /// otherwise it must divide each group, and it does not combine with shard_size.
  int hpz_size = 0;
  /// ZeRO++'s quantized weights (qwZ; zero_optimization.zero_quantized_weights), stage 3: a
  /// gather from the master slices moves each rank's slice as block-wise int8 (a code a value
  /// and an fp32 scale per 256 values, core/int8_blocks.hpp) and the units compute on the
  /// values the codes stand for: half bf16's bytes on the wire (a quarter of f32's, an eighth of
  /// f64's), at a relative error of at most 1/254 of each block's largest magnitude in the weights
  /// the forward and backward see (the master and the optimizer stay exact). false (the default):
  /// gathers move the compute type.
  bool quantized_weights = false;
  /// ZeRO++'s quantized gradients (qgZ; zero_optimization.zero_quantized_gradients), stages 2-3:
  /// each unit's gradient reduce-scatter becomes an all-to-all of the compute gradient packed as
  /// block-wise int8 (core/int8_blocks.hpp), a run for each rank's shard, and each rank averages
  /// the runs it receives in f32 into its shard: half bf16's bytes on the wire (a quarter of
  /// f32's). Each rank's contribution carries a rounding error of up to 1/254 of its block's
  /// largest magnitude; the fp32 accumulation over micro-steps, the norm, clipping and the
  /// optimizer are unchanged. Under hpZ it takes two hops (inside each secondary group, then
  /// across them), as DeepSpeed's does with int4; else one over the unit's group. false (the
  /// default): reduce-scatter in the compute type.
  bool quantized_gradients = false;
  /// The bits of qgZ's codes (zero's own zero_optimization.zero_quantized_gradient_bits): 8 (the
  /// default) or 4, DeepSpeed's width (core/int4_blocks.hpp: two codes a byte, a block's scale
  /// its largest magnitude / 7): half int8's bytes on the wire, at up to 1/14 of each block's
  /// largest magnitude in each rank's contribution instead of 1/254.
  int quantized_gradient_bits = 8;
  /// ZeRO++'s LoCo (zero_optimization.zeropp_loco_param), with qgZ: error feedback for the
  /// quantized gradients. Each rank keeps what its packing of a unit's gradient lost (and, under
  /// hpZ, what its packing of the partial sums lost) and adds it to the next gradient it packs
  /// for the same values (core/error_feedback.hpp), so the rounding errors cancel over the steps
  /// instead of adding up; most useful at 4 bits. The errors are kept block-wise int8 in the
  /// units' memory (about a byte per parameter of each unit's whole gradient: MemoryReport's
  /// kept_error_bytes), are not saved in checkpoints (a resumed run starts from none, as after
  /// a reset) and are zeroed every loco_reset_interval reductions of a unit. false (the
  /// default): no feedback.
  bool loco = false;
  /// LoCo's err_beta, in [0, 1): how much of the old error the kept one carries on (the rest is
  /// the newest packing's loss).
  float loco_err_beta = 0.8f;
  /// LoCo's reset_T: a unit's kept errors are zeroed after this many of its reductions (one a
  /// micro-step at stages 2-3), at least 1.
  std::int64_t loco_reset_interval = 1024;
  /// Offload<CPU>: step() leaves each unit's host update to the next forward, which applies it
  /// just before the unit's gather, so the host updates one unit while the device computes the
  /// units before it. The values are those of updating every unit in step(); whatever reads the
  /// state (a backward, step, checkpoints, gather_unit_values, synchronize, optimizer(u))
  /// applies what is left first. false (the default) updates every unit in step(): on an H200
  /// (GPT-2 124M, bf16, stage 2, one rank over CudaLocalComm) the deferred step took 76.8 ms
  /// and the step updating in step() 67.2 (docs/cuda.md, gpu_step): the forward's host time
  /// (50.5 ms) was the updates' plus the device's forward, not their overlap (why is not yet
  /// established).
  bool overlap_offload_update = false;
  /// Offload<CPU> at stages 1-2, or 3 below fp32: ZeRO-Offload's one-step delayed parameter
  /// update (DPU). step() starts the host update on a thread of its own and returns; the next
  /// accumulation window runs on the device with the parameters one update behind while the host
  /// updates, and the step after waits for it, gathers its result and starts its own. The
  /// gradient of step t is applied to the parameters of step t (P_t+1 = update(P_t, grad(P_t-1))),
  /// one step of staleness, as in the paper. The window's gradients go to a second pinned
  /// gradient shard per unit while the update reads the first, and below fp32 the update writes
  /// a second compute copy (host memory: one fp32 shard and one copy more). Whatever reads the
  /// state (checkpoints, weights, gather_unit_values, synchronize, optimizer(u)) waits for the
  /// update in flight and sees it applied; forward and evaluate see the parameters one update
  /// behind until the next step publishes it, so reading the state does not change the run. A
  /// ConfigError elsewhere (no Offload<CPU>, stage 3 in f32, whose gathers read the master the
  /// update writes, or together with overlap_offload_update). With offload_ratio below 1 the
  /// units kept on the device are not delayed: they update in step().
  bool delayed_param_update = false;
  /// Offload<CPU> at stages 2-3: each unit sums its reduced gradient shards of an accumulation
  /// window in an fp32 shard buffer in device memory (4 psi / N bytes more there) and copies the
  /// sum down to its pinned host shard once, at the window's last micro-step. false (the
  /// default, as DeepSpeed) folds every micro-step's shard into the pinned shard: the shard is
  /// copied up, added to and copied down again, so with several micro-batches a step each moves
  /// the whole model's fp32 gradients across the bus twice, the copy up on the compute stream
  /// (GPT-2 124M on an H200, 4 micro-batches: the backward 93 ms against 46 without offload,
  /// docs/cuda.md). The values are the same bit for bit. A ConfigError elsewhere (stage 1 sums
  /// its whole gradient on the device already).
  bool accumulate_grads_on_device = false;
  /// Offload<CPU>: the fraction of the sharded states offloaded to the host (DeepSpeed's
  /// zero_optimization.offload_optimizer.ratio, ZeRO-Offload++ "Twin-Flow"), in (0, 1]. Below 1
  /// the last units, from the last one back while they hold at most 1 - ratio of a rank's
  /// sharded elements (units_kept_on_device), keep their master slice, optimizer states and
  /// gradient shard in device memory and are updated there, on the backend's fused executor, as
  /// without offload, while the host updates the others; the values are those of the run without
  /// offload, bit for bit. The host's update, the floor of the offloaded step at one micro-batch
  /// a step, shrinks with the ratio, for (1 - ratio) of the states' memory on the device. With
  /// delayed_param_update or overlap_offload_update only the offloaded units' update is delayed
  /// or deferred; the kept units update in step(), on time (with the delay, the forward reads the
  /// kept units one update ahead of the offloaded ones). At stages 1-3 (DeepSpeed: stage 3); a
  /// ConfigError elsewhere (no Offload<CPU>, or LAMB).
  double offload_ratio = 1.0;
  /// With delayed_param_update: the first steps update in step(), without delay (the paper's
  /// warm-up, while the gradients change fastest); the delay starts with step number this + 1.
  std::int64_t delayed_update_after = 0;
  /// Offload<NVMe>, tests only: fails chosen requests of the swapper's file I/O.
  std::shared_ptr<offload::FaultInjector> nvme_faults;

  /// These options with the numeric DeepSpeed keys of config applied; data_parallel_size
  /// resolves the batch-size rule into gradient_accumulation_steps.
  EngineOptions with_config(const Config& config, int data_parallel_size) const {
    // An "auto" left in place would read as absent: clipping off, the schedule's defaults, one
    // micro-step per step, where the run meant its own values.
    if (!config.auto_keys.empty()) {
      std::string keys;
      for (const auto& k : config.auto_keys) keys += (keys.empty() ? "" : ", ") + k;
      raise<ConfigError>("config: \"auto\" is not filled in for ", keys,
                         "; call config::fill_auto with the run's values before building an "
                         "Engine, or give numbers");
    }
    EngineOptions o = *this;
    if (config.train_batch_size || config.train_micro_batch_size_per_gpu) {
      o.gradient_accumulation_steps =
          static_cast<int>(config.resolve_batch(data_parallel_size).accumulation);
    } else if (config.gradient_accumulation_steps) {
      o.gradient_accumulation_steps = static_cast<int>(*config.gradient_accumulation_steps);
    }
    o.gradient_clipping = config.gradient_clipping.value_or(0.0);
    const Fp16Config& f = config.fp16;
    o.loss_scaler.loss_scale = f.loss_scale;
    o.loss_scaler.initial_scale_power = f.initial_scale_power;
    o.loss_scaler.loss_scale_window = f.loss_scale_window;
    o.loss_scaler.hysteresis = f.hysteresis;
    o.loss_scaler.consecutive_hysteresis = f.consecutive_hysteresis;
    o.loss_scaler.min_loss_scale = f.min_loss_scale;
    const auto& z = config.zero_optimization;
    if (z.stage3_prefetch_bucket_size) o.prefetch_elems = *z.stage3_prefetch_bucket_size;
    if (z.stage3_param_persistence_threshold) {
      o.persistence_threshold = *z.stage3_param_persistence_threshold;
    }
    o.max_live_elems = z.stage3_max_live_parameters;
    // Stage 0 shards nothing: the key has no effect there (the key table says so).
    if (z.mics_shard_size > 0 && z.stage >= 1) o.shard_size = static_cast<int>(z.mics_shard_size);
    // Only stage 3 gathers per pass: elsewhere the key has no effect (the key table says so).
    // Only Offload<CPU> keeps part of its states on the device (the key table says so); the
    // default, 1, asks for nothing.
    if (z.offload_optimizer.device == OffloadDevice::cpu && z.offload_optimizer.ratio != 1.0) {
      o.offload_ratio = z.offload_optimizer.ratio;
    }
    if (z.zero_hpz_partition_size > 1 && z.stage == 3) {
      o.hpz_size = static_cast<int>(z.zero_hpz_partition_size);
    }
    if (z.zero_quantized_weights && z.stage == 3) o.quantized_weights = true;
    // ZeRO++ is stage 3's, as in DeepSpeed: below it the key has no effect (the option also
    // applies at stage 2, set directly).
    if (z.zero_quantized_gradients && z.stage == 3) o.quantized_gradients = true;
    if (z.zero_quantized_gradient_bits) {
      o.quantized_gradient_bits = static_cast<int>(*z.zero_quantized_gradient_bits);
    }
    // LoCo feeds qgZ's packings back: without them the key has no effect (the key table says so).
    if (z.zeropp_loco_param && o.quantized_gradients) {
      o.loco = true;
      o.loco_err_beta = static_cast<float>(z.zeropp_loco_param->err_beta);
      o.loco_reset_interval = z.zeropp_loco_param->reset_T;
    }
    if (!config.nonfinite_policy.empty()) {
      expect<ConfigError>(config.nonfinite_policy == "skip" || config.nonfinite_policy == "raise",
                          "nonfinite_policy: '", config.nonfinite_policy,
                          "' is not one of skip, raise");
      o.nonfinite =
          config.nonfinite_policy == "raise" ? NonFinitePolicy::raise : NonFinitePolicy::skip;
    }
    return o;
  }
};

/// One rank's micro-batch: tokens and targets [batch, seq_len] (targets may be null when only
/// logits are wanted), and named tensors of any element type for models that read features,
/// labels or masks (tokens may then be null and seq_len 1).
struct MicroBatch {
  const std::int32_t* tokens = nullptr;   ///< [batch, seq_len] token ids, or null
  const std::int32_t* targets = nullptr;  ///< [batch, seq_len] next-token labels, or null
  std::int64_t batch = 0;                 ///< rows of this micro-batch
  std::int64_t seq_len = 0;               ///< positions per row (1 for non-sequence data)
  nn::Inputs inputs = {};                 ///< named inputs (views kept alive by the caller)
  /// The global row, within the step's global batch, of this micro-batch's row 0 (the loaders'
  /// Batch::first_row), or -1 when not given. Given, dropout masks follow the rows and the
  /// optimizer step (nn::StepContext::dropout_first), so a run with dropout equals one process
  /// on the whole global batch at any world size and accumulation; not given, they follow each
  /// micro-step's local rows.
  std::int64_t first_row = -1;

  /// A micro-batch of rows samples (of seq_len positions each, for sequence layers such as
  /// attention) that carries only named inputs; first_row as the member's.
  static MicroBatch of(nn::Inputs inputs, std::int64_t rows, std::int64_t seq_len = 1,
                       std::int64_t first_row = -1) {
    MicroBatch b;
    b.batch = rows;
    b.seq_len = seq_len;
    b.inputs = std::move(inputs);
    b.first_row = first_row;
    return b;
  }
  /// A fresh context for a micro-step on this batch: its data, arena (reset), whether it
  /// trains, the step that selects dropout masks, and the kernels its layers run (null: the
  /// host's). On a device's kernels the tokens and targets are copied into the arena (device
  /// memory), below everything the units take; named inputs stay where the caller put them.
  template <class T>
  nn::StepContext<T> context(BumpArena& arena, bool training, std::uint64_t step,
                             nn::Kernels<T>* kernels = nullptr) const {
    arena.reset();
    nn::StepContext<T> ctx;
    ctx.arena = &arena;
    ctx.kernels = kernels;
    ctx.tokens = tokens;
    ctx.targets = targets;
    if (kernels != nullptr && kernels->device() != arena.device()) {
      raise<Error>("MicroBatch::context: the arena '", arena.name(), "' is ",
                   name_of(arena.device()), " memory and the kernels run on the ",
                   name_of(kernels->device()), " device");
    }
    if (kernels != nullptr && kernels->device() != DeviceKind::host) {
      ctx.tokens = to_device(arena, *kernels, tokens);
      ctx.targets = to_device(arena, *kernels, targets);
    }
    ctx.batch = batch;
    ctx.seq_len = seq_len;
    ctx.inputs = inputs;
    ctx.training = training;
    ctx.step = step;
    ctx.first_row = first_row;
    return ctx;
  }

 private:
  // A copy of batch * seq_len ids in the arena, on the kernels' device (null for none).
  template <class T>
  const std::int32_t* to_device(BumpArena& arena, nn::Kernels<T>& kernels,
                                const std::int32_t* ids) const {
    if (ids == nullptr) return nullptr;
    const Tensor<std::int32_t> copy = arena.template allocate<std::int32_t>({batch * seq_len});
    kernels.copy_from_host(copy.data(), ids, static_cast<std::size_t>(copy.bytes()));
    return copy.data();
  }
};

}  // namespace zero::engine
