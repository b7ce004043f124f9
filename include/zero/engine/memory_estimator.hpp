#pragma once
// Model-state memory per rank, from zero's own layout (what Engine::memory_report() measures),
// for a parameter count, the largest unit and a world of gpus_per_node x nodes ranks; beside it
// DeepSpeed's estimate_zero2/zero3 formulas, for comparison. Activations, communication
// buffers and the allocator are not model states and are not counted (as in DeepSpeed's).
//
// Per rank, with psi parameters, N ranks, L the largest unit, b bytes per compute element
// (4 for f32, 2 for bf16/f16), K optimizer-state bytes per parameter (8 for Adam):
//   sharded = (4 master + K states + 4 fp32 gradient shard) psi / N   (16 psi / N with Adam)
//   (an f64 reference model: 8 + K + 8, its master and gradient shard in f64; see
//   MemoryEstimateInput::master)
//   stage 0: every rank holds (8 + K) psi (f32: params = master; bf16: + b psi compute copy)
//   stage 1: sharded + whole params b psi + whole fp32 gradient accumulators 4 psi
//   stage 2: sharded + whole params b psi
//   stage 3: sharded, + gathered units while they run (params and grads: 2 b L per live unit),
//            + the whole parameters of persistent units (small ones, kept gathered: b each)
//   No low-precision copy of the owned slice is kept: a gather rounds the master slice into a
//   unit-sized scratch, so bf16 stage 3 holds the paper's 16 psi / N at rest (DeepSpeed: 18).
//   ZeRO++ hpZ (stage 3, hpz_size h): + the secondary shards each forward's gather leaves for
//            the backward's, b (psi - persistent) / h while a step runs (working memory)
//   ZeRO++ LoCo (qgZ's error feedback): + the kept errors, block-wise int8 (~psi bytes at rest,
//            and psi / h more under hpZ's two hops)
//   These are not written out here: the estimate walks unit_buffer_plan (unit_storage.hpp),
//   the same list of buffers the engine allocates and memory_report() sums.
//   Optimizer offload moves the sharded part to host memory (CPU) or, except the fp32 gradient
//   shard, to files (NVMe). Offload to the CPU below fp32 adds the slice's compute-type copy
//   there (b psi / N: the host optimizer writes it, a gather copies it up by DMA), so the host
//   holds 18 psi / N with Adam in bf16, as DeepSpeed's figure (24 psi / N when the update is
//   delayed a step: a second fp32 gradient shard and a second bf16 copy); with offload_ratio r
//   below 1 (Twin-Flow) the units kept on the device hold their share of the sharded buffers
//   there as without offload (kept_shard_params, about (1 - r) of them). Parameter offload has
//   nothing further to move (the master slice is the only copy of a rank's parameters in device
//   memory at rest); it is accepted for DeepSpeed parity.

#include <algorithm>
#include <cstdint>

#include <zero/config/config.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/unit_storage.hpp>
#include <zero/policies/offload.hpp>

namespace zero::engine {

/// What the estimate depends on.
struct MemoryEstimateInput {
  std::int64_t params = 0;               ///< psi: parameters of the model
  std::int64_t largest_unit_params = 0;  ///< L: parameters of the largest unit (layer)
  int gpus_per_node = 1;
  int nodes = 1;
  int stage = 3;
  DType precision = DType::bf16;  ///< compute type: f32, bf16 or f16 (f64: reference models)
  /// Master type: f32, or f64 (a reference model's master is its f64 compute type; its master
  /// slice and gradient shard are 8 bytes a parameter, its optimizer states still fp32).
  DType master = DType::f32;
  int optimizer_state_bytes = 8;  ///< per parameter: Adam 8, SGD with momentum 4, SGD 0
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_param = OffloadDevice::none;  ///< stage 3 only
  int live_units = 1;  ///< stage 3: units gathered at once (1 + prefetched)
  /// Stages 2-3: whole-unit gradients a reduce-scatter still holds while the next unit's backward
  /// runs (EngineOptions::max_pending_reductions; 0 leaves them out, as the paper's figures do).
  int pending_reductions = 0;
  /// Stage 3: parameters of the units kept gathered for the whole run (a unit of at most
  /// EngineOptions::persistence_threshold elements, DeepSpeed's
  /// stage3_param_persistence_threshold applied per unit): their whole parameters stay in device
  /// memory at rest, b bytes each. 0: none.
  std::int64_t persistent_params = 0;
  /// Offload<CPU> with EngineOptions::delayed_param_update: one more fp32 gradient shard in host
  /// memory (4 psi / N) and, below fp32, one more compute copy (b psi / N).
  bool delayed_update = false;
  /// Offload<CPU> at stages 2-3 with EngineOptions::accumulate_grads_on_device: an fp32 gradient
  /// shard in device memory (4 psi / N).
  bool device_grad_accumulator = false;
  /// A rank's share of the sharded buffers in parameters, where units are sharded over groups
  /// of different sizes (expert units over the expert data-parallel group, smaller than the
  /// world): the sum over units of a unit's parameters over its group's size. 0: params / world.
  double shard_params = 0;
  /// Offload<CPU> with EngineOptions::offload_ratio below 1: the part of shard_params whose
  /// units keep their sharded buffers on the device, as without offload (units_kept_on_device).
  double kept_shard_params = 0;
  /// Stage 3 under ZeRO++ hpZ (EngineOptions::hpz_size): a rank's secondary shards in
  /// parameters, held from a unit's forward to the step (the units that are not persistent,
  /// each over its secondary group's size: (params - persistent) / hpz_size). 0: none.
  double secondary_params = 0;
  /// ZeRO++ LoCo (EngineOptions::loco): the bytes of a rank's kept errors, in the compute
  /// device's memory from each unit's first reduction on (about a byte per parameter of each
  /// unit's whole gradient, block-wise int8, and its partial sums' under hpZ). 0: none.
  double kept_error_bytes = 0;

  /// Ranks in the world.
  int world() const { return gpus_per_node * nodes; }

  /// Counts one unit: `padded` elements (its flat buffer as its UnitPartition pads it) sharded
  /// over a group of `group` ranks. At stage 3 (set `stage` first) a persistent unit keeps its
  /// whole parameters, and under hpZ one that is not leaves secondary shards over its
  /// `secondary` ranks (0: no secondary group). kept: Offload<CPU> keeps its states on the
  /// device (offload_ratio).
  void add_unit(std::int64_t padded, int group, bool persistent, int secondary = 0,
                bool kept = false) {
    params += padded;
    largest_unit_params = std::max(largest_unit_params, padded);
    shard_params += static_cast<double>(padded) / static_cast<double>(group);
    if (kept) kept_shard_params += static_cast<double>(padded) / static_cast<double>(group);
    if (stage == 3 && persistent) persistent_params += padded;
    if (stage == 3 && !persistent && secondary > 0) {
      secondary_params += static_cast<double>(padded) / static_cast<double>(secondary);
    }
  }
};

/// Bytes per rank by where they live.
struct MemoryEstimate {
  double device_at_rest = 0;  ///< on the compute device between steps
  double device_working = 0;  ///< + unit buffers while a step runs (gathered units, grads)
  double host = 0;            ///< offloaded to host memory
  double nvme = 0;            ///< offloaded to files
  /// Device peak: at rest plus the working buffers.
  double device_peak() const { return device_at_rest + device_working; }
};

/// Stage 3's units gathered at once (MemoryEstimateInput::live_units) under the engine's
/// prefetch settings: the unit running plus those prefetch gathers while its budget of
/// prefetch_elems is left (up to that budget plus one unit), at most max_live_elems / largest
/// and at most units.
inline int stage3_live_units(std::int64_t largest, std::int64_t units, std::int64_t prefetch_elems,
                             std::int64_t max_live_elems) {
  if (largest <= 0) return 1;
  const std::int64_t prefetched = prefetch_elems > 0 ? prefetch_elems / largest + 1 : 0;
  const std::int64_t live_cap = std::max<std::int64_t>(1, max_live_elems / largest);
  return static_cast<int>(std::max<std::int64_t>(1, std::min({units, 1 + prefetched, live_cap})));
}

/// Optimizer-state bytes per parameter of an optimizer given by its config section (type and
/// parameters): Adam, AdamW and LAMB keep two fp32 states, SGD one with momentum and none
/// without, RMSprop its square average plus a gradient average when centered and a momentum
/// buffer with momentum, the others (Lion, Adagrad) one.
inline int optimizer_state_bytes(const NamedParams& optimizer) {
  const std::string& t = optimizer.type;
  if (t.empty()) return 0;
  if (t == "Adam" || t == "AdamW" || t == "LAMB") return 8;
  if (t == "SGD") return optimizer.get("momentum", 0.0) != 0.0 ? 4 : 0;
  if (t == "RMSprop") {
    return 4 + (optimizer.get("centered", 0.0) != 0.0 ? 4 : 0) +
           (optimizer.get("momentum", 0.0) != 0.0 ? 4 : 0);
  }
  return 4;
}

/// zero's model-state memory per rank (see the formulas at the top).
inline MemoryEstimate estimate_model_states(const MemoryEstimateInput& in) {
  expect<ConfigError>(
      in.params > 0 && in.largest_unit_params > 0 && in.largest_unit_params <= in.params,
      "estimate_model_states: need 0 < largest unit <= params");
  expect<ConfigError>(in.gpus_per_node > 0 && in.nodes > 0, "estimate_model_states: need a world");
  expect<ConfigError>(in.stage >= 0 && in.stage <= 3, "estimate_model_states: stage ", in.stage,
                      " is not 0-3");
  expect<ConfigError>(in.offload_param == OffloadDevice::none || in.stage == 3,
                      "estimate_model_states: parameter offload needs stage 3");
  expect<ConfigError>(in.offload_optimizer == OffloadDevice::none || in.stage >= 1,
                      "estimate_model_states: optimizer offload needs stage 1 or higher");
  expect<ConfigError>(in.persistent_params >= 0 && in.persistent_params <= in.params,
                      "estimate_model_states: need 0 <= persistent parameters <= params");
  expect<ConfigError>(in.master == DType::f32 || in.master == DType::f64,
                      "estimate_model_states: the master type is ", name_of(in.master),
                      "; it is f32 or f64");
  const double psi = static_cast<double>(in.params),
               L = static_cast<double>(in.largest_unit_params);
  const double n = in.world();
  const double shard = in.shard_params > 0 ? in.shard_params : psi / n;
  // Offload<CPU>'s units kept on the device hold their sharded buffers as without offload.
  const double kept = in.offload_optimizer == OffloadDevice::cpu ? in.kept_shard_params : 0.0;
  expect<ConfigError>(kept >= 0 && kept <= shard,
                      "estimate_model_states: need 0 <= kept shard parameters <= shard");
  StorageKey key;
  key.stage = in.stage;
  key.compute_bytes = size_of(in.precision);
  key.master_bytes = size_of(in.master);
  key.compute_is_master = in.precision == in.master;
  // Parameter offload alone moves the master slice (a rank's only parameter copy at rest) as
  // optimizer offload would.
  key.offload =
      in.offload_optimizer != OffloadDevice::none ? in.offload_optimizer : in.offload_param;
  key.delayed_update = in.delayed_update;
  key.device_grad_accumulator = in.device_grad_accumulator;
  const double live = in.stage == 3 ? std::max(1, in.live_units) : 1;
  const auto bytes_per_elem = [&](const BufferPlan& b) {
    return b.role == BufferRole::optimizer_states ? in.optimizer_state_bytes
                                                  : static_cast<double>(b.element_bytes);
  };
  MemoryEstimate e;
  if (kept > 0) {
    // The kept units' sharded buffers (at rest) are those of the plan without offload; their
    // whole-unit buffers are every unit's, counted with the plan below.
    StorageKey on_device = key;
    on_device.offload = OffloadDevice::none;
    on_device.delayed_update = false;
    on_device.device_grad_accumulator = false;
    for (const BufferPlan& b : unit_buffer_plan(on_device)) {
      if (b.lifetime != Lifetime::at_rest || b.extent != Extent::shard) continue;
      e.device_at_rest += bytes_per_elem(b) * kept;
    }
  }
  for (const BufferPlan& b : unit_buffer_plan(key)) {
    if (b.lifetime == Lifetime::while_used) {  // whole units, only while they run
      // Stages 2-3 reduce-scatter each unit's gradient (stages 0-1 the accumulator at rest).
      const double held =
          b.role == BufferRole::grads && in.stage >= 2 ? std::max(0, in.pending_reductions) : 0;
      e.device_working += bytes_per_elem(b) * L * (live + held);
      continue;
    }
    const double bytes = bytes_per_elem(b) * (b.extent == Extent::whole ? psi : shard - kept);
    switch (b.placement) {
      case Placement::compute:
        e.device_at_rest += bytes;
        break;
      case Placement::host:
        e.host += bytes;
        break;
      case Placement::files:
        e.nvme += bytes;
        break;
    }
  }
  // Stage 3's persistent units keep their whole parameters gathered between steps; under hpZ
  // the others' secondary shards live from their forward to the step.
  if (in.stage == 3) {
    e.device_at_rest +=
        static_cast<double>(size_of(in.precision)) * static_cast<double>(in.persistent_params);
    e.device_working += static_cast<double>(size_of(in.precision)) * in.secondary_params;
  }
  e.device_at_rest += in.kept_error_bytes;
  return e;
}

/// DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (per GPU; host per node), for
/// comparison; stages 2 and 3 only, as DeepSpeed provides.
inline MemoryEstimate deepspeed_estimate(const MemoryEstimateInput& in) {
  const double psi = static_cast<double>(in.params),
               L = static_cast<double>(in.largest_unit_params);
  const double n = in.world(), g = in.gpus_per_node, nodes = in.nodes;
  MemoryEstimate e;
  if (in.stage == 2) {
    if (in.offload_optimizer == OffloadDevice::none) {
      e.device_at_rest = 2 * psi + 18 * psi / n;
      e.host = 4 * psi * g * 1.5;
    } else {
      e.device_at_rest = 2 * psi;
      e.host = psi * std::max(4 * n, 16.0) * 1.5;
    }
  } else if (in.stage == 3) {
    e.device_working = 4 * L;
    if (in.offload_optimizer == OffloadDevice::none) {
      e.device_at_rest = 18 * psi / n;
      e.host = 4 * L * g * 1.5;  // with zero.Init: each process loads one layer at a time
    } else if (in.offload_param == OffloadDevice::none) {
      e.device_at_rest = 2 * psi / n;
      e.host = 16 * psi / nodes * 1.5;
    } else {
      e.host = 18 * psi / nodes * 1.5;
    }
  }
  return e;
}

}  // namespace zero::engine
