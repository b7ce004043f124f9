#pragma once
// Unit storage: which buffers a unit has under a policy set, what each one is for, how large it
// is and when it exists. unit_buffer_plan() is the one place that says so; the engine's setup
// allocates from it, memory_report() sums the buffers by it, and the memory estimator turns it
// into bytes per rank for any model size. UnitState holds one unit's buffers.
//
//   role           | stage 0       | stage 1         | stage 2         | stage 3
//   master (fp32)  | whole         | shard           | shard           | shard
//   states         | whole         | shard           | shard           | shard
//   grad_shard     | -             | shard           | shard           | shard
//   grad_accum     | whole (b<4)   | whole (b<4)     | shard (CPU, *)  | shard (CPU, *)
//   compute_copy   | -             | shard (CPU,b<4) | shard (CPU,b<4) | shard (CPU,b<4)
//   params         | whole         | whole           | whole           | while used
//   grads          | whole (b=4)   | whole (b=4)     | while used      | while used
//                  | or while used | or while used   |                 |
// b is the compute type's size: with f32 (or f64) compute the whole gradient is itself the
// accumulator and, at stage 0, the whole parameters are the master. (*) Offload<CPU> with
// EngineOptions::accumulate_grads_on_device: the window's reduced shards summed in device memory,
// copied down to the pinned gradient shard once a window. Offloading moves the master
// and states to host memory (CPU) or files (NVMe) and the gradient shard to host memory. Under
// Offload<CPU> (UnitState's HostStates) the master and the gradient shard are the backend's
// pinned host buffers: the host optimizer updates them in place, and the device's kernels write
// the reduced gradient into the shard directly. With a compute type below fp32 the host
// optimizer also writes the updated slice rounded to it (compute_copy, pinned), which a gather
// copies up by DMA: half the bytes of the fp32 master, which a kernel would read over the bus.
// With EngineOptions::offload_ratio below 1 the last units keep their states on the device: they
// have the buffers of the plan without offload (UnitState::states_on_device).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/work.hpp>
#include <zero/core/error.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/engine/partition.hpp>
#include <zero/nn/param.hpp>
#include <zero/policies/offload.hpp>

namespace zero::engine {

/// ZeRO++ LoCo's kept errors of one packing, in bytes: `runs` runs of a shard of `shard_numel`
/// elements, block-wise int8 (UnitExchange keeps one for a unit's gradient, runs = its group's
/// size, and under hpZ's two hops one for its partial sums, runs = the ranks across the secondary
/// groups; the memory estimate counts the same).
inline std::int64_t loco_kept_error_bytes(std::int64_t shard_numel, std::int64_t runs) {
  return runs * quant::int8_packed_bytes(shard_numel);
}

/// What a buffer of a unit is for.
enum class BufferRole : unsigned char {
  master,            ///< fp32 (f64) master values this rank updates: the source of truth
  optimizer_states,  ///< the optimizer's states of those values (the optimizer owns them)
  grad_shard,        ///< fp32 gradient of this rank's slice, reduced over the ranks
  grad_accumulator,  ///< whole fp32 gradient summed over micro-steps (bf16/f16, stages 0-1),
                     ///< or the shard's (Offload<CPU> at stages 2-3, accumulate_grads_on_device)
  compute_copy,      ///< Offload<CPU>, b < 4: the master slice rounded, in host memory
  delayed_grad,      ///< Offload<CPU> delaying its update: the gradient shard the update reads
  delayed_copy,      ///< ... below fp32: the compute copy the update writes while the last goes up
  params,            ///< the whole unit's parameters in the compute type
  grads,             ///< the whole unit's gradient in the compute type
};
/// How much of the unit a buffer covers.
enum class Extent : unsigned char {
  whole,  ///< the padded unit
  shard,  ///< this rank's slice of it
};
/// When a buffer exists.
enum class Lifetime : unsigned char {
  at_rest,     ///< from construction on, between steps too
  while_used,  ///< only while the unit computes (gathered parameters, the backward's gradient)
};
/// Which memory a buffer lives in.
enum class Placement : unsigned char {
  compute,  ///< the compute device's memory
  host,     ///< host memory beside a device (offloaded)
  files,    ///< swap files (offloaded to NVMe)
};

/// One buffer of a unit.
struct BufferPlan {
  BufferRole role = BufferRole::master;
  Extent extent = Extent::whole;
  Lifetime lifetime = Lifetime::at_rest;
  Placement placement = Placement::compute;
  std::size_t element_bytes = 0;  ///< 0 for optimizer_states (the optimizer's K bytes/element)
  bool holds_master = false;      ///< params only: this buffer is also the master (no copy)
};

/// What decides a unit's buffers.
struct StorageKey {
  int stage = 0;
  std::size_t compute_bytes = 4;  ///< size of the compute element type
  std::size_t master_bytes = 4;   ///< size of the master element type (4, or 8 for f64 models)
  bool compute_is_master = true;  ///< the compute type is the master type (f32 or f64)
  OffloadDevice offload = OffloadDevice::none;
  /// Offload<CPU> with EngineOptions::delayed_param_update: a second gradient shard in host
  /// memory, which the update in flight reads while the next window writes the first, and below
  /// fp32 a second compute copy, which it writes while the last update's goes up to the device.
  bool delayed_update = false;
  /// Offload<CPU> at stages 2-3 with EngineOptions::accumulate_grads_on_device: an fp32 shard in
  /// device memory sums the window's reduced gradient shards (grad_accumulator, shard extent).
  bool device_grad_accumulator = false;
};

/// The buffers of a unit under key, in the order above.
inline std::vector<BufferPlan> unit_buffer_plan(const StorageKey& k) {
  const Extent states_extent = k.stage == 0 ? Extent::whole : Extent::shard;
  const Placement states_at = k.offload == OffloadDevice::nvme  ? Placement::files
                              : k.offload == OffloadDevice::cpu ? Placement::host
                                                                : Placement::compute;
  const bool params_hold_master = k.stage == 0 && k.compute_is_master;
  const bool whole_grads_accumulate = k.stage <= 1 && k.compute_is_master;
  std::vector<BufferPlan> plan;
  if (!params_hold_master) {
    plan.push_back(
        {BufferRole::master, states_extent, Lifetime::at_rest, states_at, k.master_bytes});
  }
  plan.push_back({BufferRole::optimizer_states, states_extent, Lifetime::at_rest, states_at, 0});
  if (k.stage >= 1) {
    plan.push_back({BufferRole::grad_shard, Extent::shard, Lifetime::at_rest,
                    k.offload == OffloadDevice::none ? Placement::compute : Placement::host,
                    k.master_bytes});
  }
  if (k.stage <= 1 && !k.compute_is_master) {
    plan.push_back({BufferRole::grad_accumulator, Extent::whole, Lifetime::at_rest,
                    Placement::compute, k.master_bytes});
  } else if (k.stage >= 2 && k.offload == OffloadDevice::cpu && k.device_grad_accumulator) {
    plan.push_back({BufferRole::grad_accumulator, Extent::shard, Lifetime::at_rest,
                    Placement::compute, k.master_bytes});
  }
  if (k.offload == OffloadDevice::cpu && !k.compute_is_master) {
    plan.push_back({BufferRole::compute_copy, Extent::shard, Lifetime::at_rest, Placement::host,
                    k.compute_bytes});
  }
  if (k.offload == OffloadDevice::cpu && k.stage >= 1 && k.delayed_update) {
    plan.push_back({BufferRole::delayed_grad, Extent::shard, Lifetime::at_rest, Placement::host,
                    k.master_bytes});
    if (!k.compute_is_master) {
      plan.push_back({BufferRole::delayed_copy, Extent::shard, Lifetime::at_rest, Placement::host,
                      k.compute_bytes});
    }
  }
  plan.push_back({BufferRole::params, Extent::whole,
                  k.stage <= 2 ? Lifetime::at_rest : Lifetime::while_used, Placement::compute,
                  k.compute_bytes, params_hold_master});
  plan.push_back({BufferRole::grads, Extent::whole,
                  whole_grads_accumulate ? Lifetime::at_rest : Lifetime::while_used,
                  Placement::compute, k.compute_bytes});
  return plan;
}

/// Offload<CPU>'s offload_ratio (DeepSpeed's offload_optimizer.ratio, ZeRO-Offload++
/// Twin-Flow): which units keep their states on the device. shard_elems[u] is unit u's share of
/// a rank's sharded states; the last units are kept, from the last one back, while the kept
/// elements stay within (1 - ratio) of the total, so at least `ratio` of the states is offloaded
/// (ratio 1 keeps none). The same on every rank of a group: the units' shards are equal there.
inline std::vector<bool> units_kept_on_device(std::span<const std::int64_t> shard_elems,
                                              double ratio) {
  std::vector<bool> kept(shard_elems.size(), false);
  double total = 0;
  for (std::int64_t e : shard_elems) total += static_cast<double>(e);
  const double budget = (1.0 - ratio) * total;
  double held = 0;
  for (std::size_t u = shard_elems.size(); u-- > 0;) {
    held += static_cast<double>(shard_elems[u]);
    if (held > budget) break;
    kept[u] = true;
  }
  return kept;
}

/// Adds bytes of a buffer of role to the report's category for it.
inline void add_bytes(MemoryReport& r, BufferRole role, std::size_t bytes) {
  switch (role) {
    case BufferRole::master:
    case BufferRole::compute_copy:
    case BufferRole::delayed_copy:
      r.master_bytes += bytes;
      break;
    case BufferRole::optimizer_states:
      r.optimizer_bytes += bytes;
      break;
    case BufferRole::grad_shard:
    case BufferRole::grad_accumulator:
    case BufferRole::delayed_grad:
      r.grad_accumulator_bytes += bytes;
      break;
    case BufferRole::params:
      r.whole_param_bytes += bytes;
      break;
    case BufferRole::grads:
      r.whole_grad_bytes += bytes;
      break;
  }
}

/// Under Offload<CPU>, a buffer of a unit's offloadable state: the backend's pinned host memory,
/// or, for a unit whose states stay on the device (EngineOptions::offload_ratio below 1), the
/// compute device's. It is one or the other, as its plan placed it, and reads as a buffer.
template <class Backend, class E>
class PlacedStateBuffer {
 public:
  using Pinned = typename Backend::template PinnedBuffer<E>;
  using Device = typename Backend::template DeviceBuffer<E>;

  PlacedStateBuffer() = default;
  /// A buffer in pinned host memory.
  static PlacedStateBuffer pinned(Pinned b) {
    PlacedStateBuffer out;
    out.pinned_ = std::move(b);
    return out;
  }
  /// A buffer in the compute device's memory.
  static PlacedStateBuffer device(Device b) {
    PlacedStateBuffer out;
    out.device_ = std::move(b);
    return out;
  }

  E* data() { return pinned_.empty() ? device_.data() : pinned_.data(); }
  const E* data() const { return pinned_.empty() ? device_.data() : pinned_.data(); }
  std::size_t size() const { return pinned_.empty() ? device_.size() : pinned_.size(); }
  std::size_t bytes() const { return pinned_.bytes() + device_.bytes(); }
  bool empty() const { return pinned_.empty() && device_.empty(); }
  /// Bytes in pinned host memory (0 for a buffer on the device).
  std::size_t host_bytes() const { return pinned_.bytes(); }

 private:
  Pinned pinned_;
  Device device_;
};

/// One unit's buffers, in compute type T and master type MasterT, allocated by Backend. Which
/// of them exist follows unit_buffer_plan; with HostStates (Offload<CPU>) the master and the
/// gradient shard are in the backend's pinned host memory, unless the unit keeps its states on
/// the device (states_on_device: the plan without offload); with DeviceStates (a device backend
/// that runs the optimizer) the optimizer's states are the unit's device buffers too, as they
/// are for a unit that keeps its states on the device.
template <class T, class MasterT, class Backend, bool HostStates = false, bool DeviceStates = false>
struct UnitState {
  template <class E>
  using DeviceBuffer = typename Backend::template DeviceBuffer<E>;
  /// The buffers of the offloadable state: pinned host memory under Offload<CPU> (or the
  /// device's, for a unit that keeps its states there).
  template <class E>
  using StateBuffer =
      std::conditional_t<HostStates, PlacedStateBuffer<Backend, E>, DeviceBuffer<E>>;
  using compute_type = T;
  using master_type = MasterT;
  /// The compute type is the master type (f32, or f64 reference models).
  static constexpr bool compute_is_master = std::is_same_v<T, MasterT>;
  /// The engine offloads states to host memory (Offload<CPU>); whether this unit's are there
  /// says offloaded().
  static constexpr bool host_states = HostStates;
  /// Offload<CPU> with EngineOptions::offload_ratio below 1 (ZeRO-Offload++ Twin-Flow): this
  /// unit's master slice, optimizer states and gradient shard stay in the compute device's memory
  /// and its update runs there, as without offload. Set before the buffers are allocated.
  bool states_on_device = false;
  /// The master slice and gradient shard are in pinned host memory, updated by the host.
  bool offloaded() const { return HostStates && !states_on_device; }

  std::vector<nn::ParamSpec> specs;
  std::optional<UnitPartition> partition;
  StateBuffer<MasterT> master;  ///< empty when params holds it or it is in files
  std::optional<std::span<MasterT>> swapped_in_master;  ///< Offload<NVMe>: while in a buffer
  StateBuffer<MasterT> grad_shard;                      ///< stages 1-3
  /// EngineOptions::delayed_param_update: the last window's gradient shard, which the update in
  /// flight reads while the next window's reductions write grad_shard (swapped at each step).
  StateBuffer<MasterT> delayed_grad;
  StateBuffer<T> compute_copy;  ///< Offload<CPU> below fp32: the slice rounded (see the plan)
  /// delayed_param_update below fp32: the rounded copy a delayed update writes while the gathers
  /// copy compute_copy up; swapped with compute_copy at the step after it.
  StateBuffer<T> delayed_copy;
  /// compute_copy holds the master's values as of the last update the gathers may see (while a
  /// delayed update runs, the values before it); false after initialisation and after the master
  /// was replaced (a checkpoint or weights loaded).
  bool compute_copy_current = false;
  /// The optimizer's state buffers (exp_avg, ...) under DeviceStates; else the optimizer's own.
  std::vector<DeviceBuffer<float>> optimizer_states;
  /// Stages 0-1 with a compute type below fp32: the whole gradient; Offload<CPU> at stages 2-3
  /// with accumulate_grads_on_device: the window's sum of the reduced shards.
  DeviceBuffer<MasterT> grad_accumulator;
  DeviceBuffer<T> gather_scratch;                ///< the slice rounded (or read) for an all-gather
  std::optional<DeviceBuffer<T>> params, grads;  ///< whole unit in the compute type
  /// ZeRO++ hpZ: this rank's share of the whole parameters among its secondary group, kept by
  /// the forward's gather for the backward's (see secondary_group); empty otherwise.
  std::optional<DeviceBuffer<T>> secondary;
  /// ZeRO++ qwZ, while a gather from the master slices runs: this rank's slice packed as int8
  /// (core/int8_blocks.hpp) and every rank's packed slices, which finish_gather reads back.
  DeviceBuffer<std::uint8_t> quantized_slice, quantized_whole;
  parallel::Work pending_gather;  ///< declared after the buffers it writes
  bool gathering = false;
  bool gathering_primary = false;  ///< the gather in flight reads the master slices (not hpZ's)
  /// The fp32 accumulators (grad_accumulator, grad_shard) hold this accumulation window's
  /// gradient: the window's first fold started them (Fold::start), so a step need not clear them.
  /// Until then they hold the last window's values.
  bool window_folded = false;
  bool params_hold_master = false;  ///< stage 0 in f32/f64: params is the master
  bool pinned = false;      ///< used by another unit: gathered from its forward to its backward
  bool persistent = false;  ///< kept gathered for the whole run (stages 0-2; small at stage 3)
  bool replica = false;     ///< a copy of a unit another pipeline stage owns (tied weights)
  /// The group the unit is sharded over and its gradient averaged in (EngineGroups::shard_group:
  /// the data-parallel group, or the expert data-parallel group for an expert unit).
  parallel::AnyComm* group = nullptr;
  /// Hybrid sharding: the ranks holding the same shard of the unit, which average its reduced
  /// gradient shard (EngineGroups::replica_group); null without it.
  parallel::AnyComm* replicas = nullptr;
  /// ZeRO++ hpZ (stage 3, units that are not persistent): the ranks of the unit's group (one
  /// node's) that a backward gathers it from, out of their secondary shards
  /// (EngineGroups::secondary_group); null without it.
  parallel::AnyComm* secondary_group = nullptr;
  /// hpZ under qgZ: the ranks at this rank's place of every secondary group, over which the
  /// quantized gradient exchange takes its second hop (EngineGroups::across_secondary_group);
  /// null without it.
  parallel::AnyComm* across_secondary = nullptr;
  /// What the gradient averaged over `group` (and `replicas`) is multiplied by: |group| / |dp|
  /// (1/ep for an expert unit, else 1).
  double grad_scale = 1.0;

  /// Elements of a buffer of extent e.
  std::size_t numel(Extent e) const {
    return static_cast<std::size_t>(e == Extent::whole ? partition->padded_numel()
                                                       : partition->shard_numel());
  }
  /// Allocates the buffer b describes from backend (at-rest buffers, at setup).
  void allocate(const BufferPlan& b, Backend& backend) {
    const std::size_t n = numel(b.extent);
    switch (b.role) {
      case BufferRole::master:
        master = make_state_buffer<MasterT>(b, n, backend);
        break;
      case BufferRole::optimizer_states:
        break;  // the optimizer's, moved here by adopt_optimizer_states under DeviceStates
      case BufferRole::grad_shard:
        grad_shard = make_state_buffer<MasterT>(b, n, backend);
        break;
      case BufferRole::compute_copy:
        compute_copy = make_state_buffer<T>(b, n, backend);
        break;
      case BufferRole::delayed_grad:
        delayed_grad = make_state_buffer<MasterT>(b, n, backend);
        break;
      case BufferRole::delayed_copy:
        delayed_copy = make_state_buffer<T>(b, n, backend);
        break;
      case BufferRole::grad_accumulator:
        grad_accumulator = backend.template make_buffer<MasterT>(n);
        break;
      case BufferRole::params:
        params.emplace(backend.template make_buffer<T>(n));
        params_hold_master = b.holds_master;
        break;
      case BufferRole::grads:
        grads.emplace(backend.template make_buffer<T>(n));
        break;
    }
  }
  /// The master slice while it is in memory (its own buffer, params at stage 0 in f32/f64, or
  /// the swap buffer it was brought into); empty when it is only in a file.
  std::span<MasterT> resident_master() {
    if (swapped_in_master) return *swapped_in_master;
    if (params_hold_master) {
      if constexpr (std::is_same_v<T, MasterT>) return {params->data(), params->size()};
    }
    return {master.data(), master.size()};
  }
  /// The whole gradient summed over micro-steps (stages 0-1): the compute gradient itself when
  /// it is in the master type, else the fp32 accumulator.
  std::span<MasterT> whole_accumulator() {
    if constexpr (compute_is_master) {
      if (grad_accumulator.empty()) return {grads->data(), grads->size()};
    }
    return {grad_accumulator.data(), grad_accumulator.size()};
  }
  /// Fills the master slices this rank holds from (seed, name, index): its shard, or every
  /// shard when whole (stage 0), so the union over ranks equals a single-process initialisation.
  /// Each shard is computed in host memory and copied in by the backend (the master may be device
  /// memory).
  void initialise_master(bool whole, int rank, std::uint64_t seed, Backend& backend) {
    const UnitPartition& p = *partition;
    const std::span<MasterT> m = resident_master();
    const auto n = static_cast<std::size_t>(p.shard_numel());
    std::vector<MasterT> staged(n);
    for (int r = 0; r < p.world_size(); ++r) {
      if (!whole && r != rank) continue;
      const auto begin = static_cast<std::size_t>(whole ? p.shard_begin(r) : 0);
      initialise_shard(specs, p, r, Tensor<MasterT>(staged.data(), Shape{p.shard_numel()}), seed);
      backend.copy_from_host(m.subspan(begin, n), std::span<const MasterT>(staged));
    }
  }
  /// DeviceStates: moves opt's state buffers (with their initial values) into buffers of the
  /// backend's memory, which the optimizer is then bound to: its passes run on the backend's
  /// executor, where the master slice is.
  template <class Optimizer>
  void adopt_optimizer_states(Optimizer& opt, Backend& backend) {
    expect<Error>(DeviceStates || states_on_device,
                  "UnitState: an offloaded unit's optimizer states stay the optimizer's own");
    std::vector<std::span<float>> bound;
    for (const auto& name : opt.state_names()) {
      const std::span<float> initial = opt.state(name);
      optimizer_states.push_back(backend.template make_buffer<float>(initial.size()));
      DeviceBuffer<float>& b = optimizer_states.back();
      backend.copy_from_host(std::span<float>(b.data(), b.size()), std::span<const float>(initial));
      bound.emplace_back(b.data(), b.size());
    }
    opt.release_state_storage();
    opt.bind_state(std::span<const std::span<float>>(bound));
  }
  /// A master, gradient-shard or compute-copy buffer of n elements: pinned host memory where
  /// the plan places it in host memory (Offload<CPU>), else the compute device's (Offload<NVMe>
  /// runs on the host, where that is host memory too).
  template <class E>
  StateBuffer<E> make_state_buffer(const BufferPlan& b, std::size_t n, Backend& backend) const {
    expect<Error>(offloaded() == (HostStates && b.placement == Placement::host),
                  "UnitState: under Offload<CPU> the plan must place the master, the gradient "
                  "shard and the compute copy of an offloaded unit in host memory, and of a unit "
                  "kept on the device in the device's");
    if constexpr (HostStates) {
      if (b.placement == Placement::host) {
        return StateBuffer<E>::pinned(backend.template make_pinned_buffer<E>(n));
      }
      return StateBuffer<E>::device(backend.template make_buffer<E>(n));
    } else {
      return backend.template make_buffer<E>(n);
    }
  }
  /// Adds this unit's buffers to r by role (optimizer states only where the unit holds them).
  void report(MemoryReport& r) const {
    if constexpr (HostStates) {
      r.host_bytes += master.host_bytes() + grad_shard.host_bytes() + delayed_grad.host_bytes() +
                      compute_copy.host_bytes() + delayed_copy.host_bytes();
    }
    add_bytes(r, params_hold_master ? BufferRole::master : BufferRole::params,
              params ? params->bytes() : 0);
    add_bytes(r, BufferRole::master, master.bytes());
    add_bytes(r, BufferRole::grad_shard, grad_shard.bytes());
    add_bytes(r, BufferRole::delayed_grad, delayed_grad.bytes());
    add_bytes(r, BufferRole::compute_copy, compute_copy.bytes());
    add_bytes(r, BufferRole::delayed_copy, delayed_copy.bytes());
    add_bytes(r, BufferRole::grad_accumulator, grad_accumulator.bytes());
    add_bytes(r, BufferRole::grads, grads ? grads->bytes() : 0);
    r.secondary_param_bytes += secondary ? secondary->bytes() : 0;
    for (const auto& b : optimizer_states) add_bytes(r, BufferRole::optimizer_states, b.bytes());
    r.scratch_bytes += gather_scratch.bytes() + quantized_slice.bytes() + quantized_whole.bytes();
  }
};

}  // namespace zero::engine
