#pragma once
// UnitExchange: the collectives that move a unit's parameters and gradients between the
// ranks it is sharded over (its group: the data-parallel group, or the expert data-parallel
// group for an expert unit), and the buffers they need.
//
//   gathers     start_gather / finish_gather: all-gather a unit's whole parameters from the
//               ranks' master slices (rounded to the compute type, or read from an offload
//               store, into a pooled scratch); acquire makes a unit (and the units it uses)
//               ready to run; prefetch starts the next units' gathers up to a byte budget
//               (stage 3; under Offload<NVMe> it reads a unit's master slice ahead and starts
//               the unit's gather at a later prefetch); release drops a gathered unit; a unit
//               another unit uses (tied weights, experts) is dropped after its last user's forward
//               at stage 3, unless that user is the model's last unit, whose backward follows at
//               once. Under ZeRO++ hpZ (the unit's secondary_group) a gather over the whole group
//               keeps this rank's share of the result (a secondary shard) and a backward's gather
//               reads those shards inside the secondary group instead, until the step drops
//               them (forget_secondaries). Under ZeRO++ qwZ (quantized_weights) a gather
//               from the master slices moves them packed as block-wise int8, read back into
//               the unit's buffer when it is waited for.
//   reductions  gradient_complete starts a unit's gradient reduction once its backward is done
//               (all-reduce or reduce-scatter of the whole accumulator on the boundary at stages
//               0-1; reduce-scatter of the compute gradient into the fp32 shard every micro-step
//               at stages 2-3), at most max_pending_reductions in flight, each overlapping the
//               next units' backward. An expert unit's averaged gradient is then scaled by
//               its grad_scale (1/ep). Under hybrid sharding (the unit's replicas) a reduced
//               shard is then averaged over the ranks holding the same shard, by an all-reduce
//               started when its reduce-scatter is waited for, with as many in flight. Under
//               ZeRO++ qgZ (quantized_gradients, stages 2-3) the reduce-scatter is an all-to-all
//               of the gradient packed as block-wise int8 (or int4: quantized_gradient_bits), a
//               run for each rank's shard, whose runs for this rank are summed in f32 (their
//               mean) when it is waited for; with hpZ's groups it takes two hops, inside the
//               secondary group and then across them (queued with the replicas' averages), as
//               DeepSpeed's hierarchical qgZ. With ZeRO++'s LoCo (loco) each packing adds the
//               error this rank kept for the same values and keeps the new one
//               (core/error_feedback.hpp): a unit's whole gradient and, under hpZ, its partial
//               sums, each block-wise int8 in the units' memory, zeroed every
//               loco_reset_interval reductions of the unit.
//               Under Offload<CPU> the reduced shard of an offloaded unit (all of them
//               unless offload_ratio keeps the last ones on the device, where they run as
//               without offload: Unit::offloaded) reaches its pinned
//               host shard by a DMA copy on the communication stream (stage 1; at stages 2-3
//               every fold, through a device staging buffer, or once a window from the unit's
//               device accumulator with accumulate_grads_on_device: fold_into_host_shard), and its
//               sum of squares is taken on the way, in the units' memory (shard_sums_of_squares;
//               without offload the engine takes every unit's sum there at the step, so the
//               device is waited for once for all of them).
//
// Every rank calls these in the same order (the engine's static unit order), so the collectives
// match on every rank. A failed collective is a CommError naming the op, the unit and the step.
// A master slice that cannot be read from its swap file (Offload<NVMe>) may fail on one rank
// alone: that rank still starts the gather, with zeros in its slice's place, and keeps the error
// (failed_reads, take_failed_read) for the engine to raise on every rank at its next agreement,
// instead of leaving the others waiting in the gather.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <zero/core/error.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/engine/backend.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/engine/stage_traits.hpp>
#include <zero/engine/unit_storage.hpp>
#include <zero/nn/param.hpp>
#include <zero/profile/step_timers.hpp>

namespace zero::engine {

/// Gathers and gradient reductions of the units of Model (see the file comment).
template <class Model, class Unit, class Store, class Backend, int Stage>
class UnitExchange {
 public:
  using T = typename Unit::compute_type;
  using MasterT = typename Unit::master_type;
  using traits = StageTraits<Stage>;
  template <class E>
  using DeviceBuffer = typename Backend::template DeviceBuffer<E>;
  /// Where a failure happened, for messages (" at step 3 micro-step 1").
  using ContextFn = std::function<std::string()>;

  UnitExchange(Model& model, std::vector<Unit>& units, Store& store, Backend& backend,
               const EngineOptions& options, ContextFn context)
      : model_(model),
        units_(units),
        store_(store),
        backend_(backend),
        options_(options),
        context_(std::move(context)) {}
  UnitExchange(const UnitExchange&) = delete;
  UnitExchange& operator=(const UnitExchange&) = delete;
  /// Orders compute after the DMA copies still in flight, so the staging buffer they read (freed
  /// in the compute stream's order) and the pinned shards they write (freed once compute is done)
  /// outlive them.
  ~UnitExchange() {
    if (!copies_unordered_) return;
    try {
      backend_.compute_waits_for_comm_copies();
    } catch (...) {  // a failed device cannot order anything; nothing is left to protect
    }
  }

  /// Adds the time spent waiting for gathers and reductions to timers (null: untimed).
  void set_timers(profile::StepTimers* timers) { timers_ = timers; }
  /// fn(u) runs before unit u's master is read for a gather and before its gathered parameters
  /// are used: where the engine applies the part of an update it deferred (Offload<CPU>).
  void set_before_gather(std::function<void(int)> fn) { before_gather_ = std::move(fn); }

  /// Binds unit u's parameter views to its current buffers (grads empty while there are none).
  void bind(int u) {
    Unit& s = unit(u);
    if (!s.params) return;
    std::vector<nn::ParamView<T>> views;
    for (int p = 0; p < s.partition->num_params(); ++p) {
      const ParamSlot& slot = s.partition->slot(p);
      const Shape& shape = s.specs[static_cast<std::size_t>(p)].shape;
      nn::ParamView<T> v;
      v.value = s.params->view().slice(slot.offset, slot.numel).reshape(shape);
      if (s.grads) v.grad = s.grads->view().slice(slot.offset, slot.numel).reshape(shape);
      views.push_back(v);
    }
    model_.bind_unit(u, views);
  }

  // ---- gathers -------------------------------------------------------------------------------

  /// Starts the all-gather of unit u's params into its whole buffer (allocated when absent):
  /// for a backward (hpZ) from the secondary shards when the unit has them, else from the
  /// master slices over the unit's group.
  void start_gather(int u, bool backward = false) {
    if (before_gather_) before_gather_(u);
    Unit& s = unit(u);
    if (s.gathering) return;
    const bool fresh = !s.params;
    if (fresh) s.params.emplace(backend_.template make_buffer<T>(s.numel(Extent::whole)));
    const std::span<T> whole(s.params->data(), s.params->size());
    s.gathering_primary = !(backward && s.secondary);
    if (s.gathering_primary && options_.quantized_weights) {
      start_quantized_gather(u);
    } else if (s.gathering_primary) {
      const std::span<const T> source = gather_source(u);
      // The source may have just been rounded from the master on the compute stream.
      backend_.comm_waits_for_compute();
      s.pending_gather = s.group->all_gather_async(source, whole);
    } else {
      // The secondary shard was copied out on the compute stream.
      backend_.comm_waits_for_compute();
      s.pending_gather = s.secondary_group->all_gather_async(
          std::span<const T>(s.secondary->data(), s.secondary->size()), whole);
    }
    s.gathering = true;
    if (fresh) bind(u);
    peak_gathered_elems_ = std::max(peak_gathered_elems_, gathered_elems());
  }
  /// Elements of the units gathered now (whole parameters held, or being gathered).
  std::int64_t gathered_elems() const {
    std::int64_t n = 0;
    for (const Unit& s : units_) {
      if (s.params) n += s.partition->padded_numel();
    }
    return n;
  }
  /// The most elements gathered at once so far (what stage3_max_live_parameters bounds).
  std::int64_t peak_gathered_elems() const { return peak_gathered_elems_; }
  /// Waits for unit u's gather, if one runs, and gives its scratch back to the pool. Under hpZ
  /// a gather from the master slices leaves the unit's secondary shard.
  void finish_gather(int u) {
    Unit& s = unit(u);
    if (!s.gathering) return;
    wait(s.pending_gather,
         s.gathering_primary ? "all-gather" : "all-gather of the secondary shards", u);
    s.gathering = false;
    if (s.gather_scratch.size() > 0) scratch_pool_.push_back(std::move(s.gather_scratch));
    if (s.quantized_whole.size() > 0) finish_quantized_gather(u);
    if (s.gathering_primary && s.secondary_group != nullptr && !s.persistent) keep_secondary(u);
  }
  /// Drops every secondary shard (hpZ): the step changes the master slices they were gathered
  /// from, so the next backward's gathers read only shards its forward's gathers kept.
  void forget_secondaries() {
    for (int u = 0; u < num_units(); ++u) {
      Unit& s = unit(u);
      if (s.gathering && !s.gathering_primary) finish_gather(u);  // it reads the shard
      s.secondary.reset();
    }
  }
  /// Makes unit u and the units it uses ready to run: gathered, and with gradient buffers for
  /// a backward.
  void acquire(int u, bool with_grads) {
    // A reduction of an earlier pass may still read the gradient buffer of u or of a unit it
    // uses (the pass API leaves up to max_pending_reductions in flight): it finishes, and so
    // releases the buffer (at stage 3 perhaps the params too), before the gathers below and
    // before this backward accumulates into a fresh buffer.
    if (with_grads) {
      finish_reductions_of(u);
      for (int used : model_.unit_uses(u)) finish_reductions_of(used);
    }
    auto ready = [&](int v) {
      if (before_gather_) before_gather_(v);
      Unit& s = unit(v);
      if (!s.params) start_gather(v, with_grads);
      finish_gather(v);
      if (with_grads && !s.grads) {
        s.grads.emplace(backend_.template make_buffer<T>(s.numel(Extent::whole)));
        bind(v);
      }
    };
    ready(u);
    for (int used : model_.unit_uses(u)) ready(used);
  }
  /// Stage 3: starts gathers of the units after u in direction dir (+1 forward, -1 backward),
  /// up to the prefetch budget, and only while the gathered units stay within max_live_elems.
  /// Units already gathered ahead (by the previous unit's prefetch) spend the budget too, so the
  /// window ahead holds about prefetch_elems (DeepSpeed's bucket of parameters in flight) rather
  /// than growing by a unit at every unit; persistent units are always there and spend nothing.
  /// When a gather would read its unit's master slice from the store's files (Offload<NVMe>,
  /// nvme_read_ahead), a unit of the window other than the next one has its slice read ahead
  /// instead and its gather waits for a later prefetch, so the read overlaps the compute of the
  /// units before it; the window ends at a unit no read buffer is free for. The answers depend
  /// only on the calls made (NvmeSwapper::read_ahead), so every rank starts the same gathers.
  /// A forward's window that reaches the model's end with budget left, when a backward follows
  /// (backward_follows), goes on reading ahead the slices the backward gathers first.
  void prefetch(int u, int dir, bool backward_follows = false) {
    if constexpr (traits::gathers_before_use) {
      std::int64_t budget = options_.prefetch_elems;
      std::int64_t live = gathered_elems();
      int v = u + dir;
      for (; v >= 0 && v < num_units() && budget > 0; v += dir) {
        const std::int64_t n = unit(v).partition->padded_numel();
        if (unit(v).params) {
          if (!unit(v).persistent) budget -= n;
          continue;
        }
        if (live + n > options_.max_live_elems) break;
        budget -= n;
        if (v != u + dir && reads_master_ahead(v, dir < 0) && !store_.reading_ahead(v)) {
          if (store_.read_ahead(v)) continue;  // gathered by a later prefetch
          break;
        }
        live += n;
        start_gather(v, dir < 0);
      }
      if (dir > 0 && backward_follows && v == num_units()) read_ahead_for_backward(budget);
    } else {
      (void)u;
      (void)dir;
      (void)backward_follows;
    }
  }
  /// Stage 3: drops unit u's gathered params once it has run, unless it stays gathered (used
  /// by a later unit, or persistent). After a forward, also drops the units u uses whose last
  /// user u is (their backward gathers them again), unless u is the model's last unit.
  void release_after_use(int u, bool forward) {
    if constexpr (traits::gathers_before_use) {
      if (!unit(u).pinned && !unit(u).persistent) release_params(u);
      if (!forward || u == num_units() - 1) return;
      for (int used : model_.unit_uses(u)) {
        if (last_user(used) == u && !unit(used).persistent && !unit(used).grads) {
          release_params(used);
        }
      }
    } else {
      (void)u;
      (void)forward;
    }
  }
  /// Drops unit u's gathered params.
  void release_params(int u) {
    finish_gather(u);
    unit(u).params.reset();
  }
  /// Drops unit u's gathered params and gradient (once the reductions reading it are done).
  void release(int u) {
    finish_reductions_of(u);
    release_params(u);
    unit(u).grads.reset();
  }
  /// Waits for unit u's reductions in flight (and the older ones before them, in order).
  void finish_reductions_of(int u) {
    const auto of_u = [u](const Pending& p) { return p.unit == u; };
    while (std::any_of(pending_.begin(), pending_.end(), of_u)) finish_oldest();
    while (std::any_of(replicating_.begin(), replicating_.end(), of_u)) finish_replicated();
  }
  /// After an update: units kept gathered gather the new params (the gathers run while later
  /// work proceeds); a stale gathered copy of another unit (evaluate left it) is dropped. Only
  /// the units `updated(u)` names, where the update left the others for later (Offload<CPU>'s
  /// offloaded units delayed or deferred, beside those kept on the device).
  template <class Updated>
  void regather_after_update(Updated&& updated) {
    if constexpr (traits::regathers_after_update) {
      forget_secondaries();
      for (int u = 0; u < num_units(); ++u) {
        if (!updated(u)) continue;
        Unit& s = unit(u);
        if (s.persistent) {
          start_gather(u);
        } else if (s.params) {
          release(u);
        }
      }
    } else {
      (void)updated;
    }
  }
  /// The same for every unit.
  void regather_after_update() {
    regather_after_update([](int) { return true; });
  }

  // ---- reductions ----------------------------------------------------------------------------

  /// Unit u's backward is done, so its compute gradient is final for this micro-step: fold it
  /// into the fp32 accumulator and start its reduction where the stage asks for one.
  void gradient_complete(int u, bool boundary) {
    Unit& s = unit(u);
    Pending p;
    p.unit = u;
    if constexpr (!traits::shards_grads) {
      if constexpr (!Unit::compute_is_master) {  // fold into the fp32 accumulator
        backend_.accumulate(span(s.grad_accumulator), std::span<const T>(span(*s.grads)), 1.0,
                            next_fold(s));
        s.grads.reset();
        bind(u);
      }
      if (!boundary) return;
      // The reduction below writes the whole grad_shard (stage 1).
      s.window_folded = true;
      // Offload<CPU>: the collective writes device memory; finish_oldest folds it into the
      // pinned host shard. The buffer is made (and zeroed on the compute stream) before the
      // comm stream's wait, which orders the collective after the zeroing as after the fold.
      if (s.offloaded()) {
        p.shard_scratch = backend_.template make_buffer<MasterT>(s.grad_shard.size());
      }
      backend_.comm_waits_for_compute();
      const std::span<MasterT> acc = s.whole_accumulator();
      if constexpr (traits::all_reduces_grads) {
        p.work =
            s.group->all_reduce_async(std::span<const MasterT>(acc), acc, parallel::ReduceOp::avg);
      } else if (s.offloaded()) {
        p.work = s.group->reduce_scatter_async(std::span<const MasterT>(acc), span(p.shard_scratch),
                                               parallel::ReduceOp::avg);
      } else {
        p.work = s.group->reduce_scatter_async(std::span<const MasterT>(acc), span(s.grad_shard),
                                               parallel::ReduceOp::avg);
      }
    } else {
      p.boundary = boundary;
      p.scratch = take_scratch(s.grad_shard.size());  // a new one is zeroed on compute: first
      if (options_.quantized_gradients) {
        start_quantized_reduction(u, p);
      } else {
        backend_.comm_waits_for_compute();
        p.work = s.group->reduce_scatter_async(std::span<const T>(span(*s.grads)), span(p.scratch),
                                               parallel::ReduceOp::avg);
      }
    }
    pending_.push_back(std::move(p));
    while (static_cast<int>(pending_.size()) > options_.max_pending_reductions) finish_oldest();
  }
  /// Waits for every reduction in flight; the compute issued next (and the host, once it waits
  /// for compute) sees every gradient shard they wrote, the pinned shards' DMA copies included.
  void drain_reductions() {
    while (!pending_.empty()) finish_oldest();
    while (!replicating_.empty()) finish_replicated();
    order_copies_before_compute();
  }
  /// Waits for every collective in flight.
  void synchronize() {
    drain_reductions();
    for (int u = 0; u < num_units(); ++u) finish_gather(u);
  }
  /// Adds the pooled and in-flight scratch buffers to r.
  void report(MemoryReport& r) const {
    for (const auto& k : kept_errors_) {
      r.kept_error_bytes += k.packing.values.bytes() + k.hop.values.bytes();
    }
    for (const auto& b : scratch_pool_) r.scratch_bytes += b.bytes();
    for (const auto& b : packed_pool_) r.scratch_bytes += b.bytes();
    for (const auto& p : pending_) {
      r.scratch_bytes += p.scratch.bytes() + p.packed_send.bytes() + p.packed_recv.bytes();
    }
    for (const auto& p : replicating_) {
      r.scratch_bytes += p.scratch.bytes() + p.packed_send.bytes() + p.packed_recv.bytes();
    }
    r.scratch_bytes += fold_staging_.bytes();
    r.scratch_bytes += shard_sums_.bytes();
  }
  /// Unit u's sum of squares of v, a gradient (part) in the units' memory, into the unit's slot
  /// there on the compute stream, without a host wait. Offload<CPU> takes it as a shard goes down
  /// to pinned memory; the engine takes every other unit's at the step.
  void take_shard_sum(int u, std::span<const MasterT> v) {
    if (shard_sums_.size() == 0) {
      shard_sums_ = backend_.template make_buffer<double>(units_.size());
      shard_sum_taken_.assign(units_.size(), 0);
    }
    const auto slot = static_cast<std::size_t>(u);
    backend_.sum_of_squares_into(std::span<double>(shard_sums_.data() + slot, 1), v);
    shard_sum_taken_[slot] = 1;
  }
  /// The sums take_shard_sum took this window, read back in one copy (after the compute issued
  /// so far); nullopt for a unit without one (Offload<CPU>: its shard is summed where it lives).
  /// Call after drain_reductions().
  std::vector<std::optional<double>> shard_sums_of_squares() {
    std::vector<std::optional<double>> sums(units_.size());
    if (std::find(shard_sum_taken_.begin(), shard_sum_taken_.end(), 1) == shard_sum_taken_.end()) {
      return sums;
    }
    std::vector<double> host(shard_sums_.size());
    backend_.copy_to_host(std::span<double>(host), std::span<const double>(span(shard_sums_)));
    for (std::size_t u = 0; u < sums.size(); ++u) {
      if (shard_sum_taken_[u] != 0) sums[u] = host[u];
    }
    return sums;
  }
  /// LoCo's kept errors for unit u at rest, in bytes (what report() counts once u reduced): its
  /// whole gradient's runs and, under hpZ's two hops, its partial sums', block-wise int8.
  std::size_t kept_error_bytes(int u) const {
    if (!options_.loco) return 0;
    const bool hop = units_[static_cast<std::size_t>(u)].across_secondary != nullptr;
    return kept_bytes(u, false) + (hop ? kept_bytes(u, true) : 0);
  }
  /// Forgets LoCo's kept errors: each is zeroed before its next packing, as at a reset, and
  /// keeps its memory. The engine calls it where the errors no longer stand for what the next
  /// packings lost: a checkpoint was loaded (they are not saved), a step was skipped (its
  /// gradients, whose packings' losses they carry, were dropped) or the fp16 loss scale changed
  /// (they are in the old scale's units).
  void forget_kept_errors() {
    for (KeptError& errors : kept_errors_) {
      for (auto* k : {&errors.packing, &errors.hop}) k->packings = options_.loco_reset_interval;
    }
  }
  /// A new accumulation window: no unit has a shard sum yet.
  void forget_shard_sums() { std::fill(shard_sum_taken_.begin(), shard_sum_taken_.end(), 0); }

  // ---- master slices that could not be read ---------------------------------------------------

  /// A gather that went on with zeros for this rank's master slice, its read having failed.
  struct FailedRead {
    int unit = 0;
    std::exception_ptr error;  ///< the read's IoError (NvmeIoError)
    std::string what;
  };
  /// Gathers since the last take_failed_read that went on without this rank's slice.
  std::int64_t failed_reads() const { return failed_reads_; }
  /// The first of those (empty when none), forgetting them all.
  std::optional<FailedRead> take_failed_read() {
    failed_reads_ = 0;
    return std::exchange(failed_read_, std::nullopt);
  }
  /// Records that unit u's gather went on without this rank's slice, inside the catch of the
  /// read's error (what).
  void keep_failed_read(int u, const char* what) {
    if (failed_reads_++ > 0) return;  // the first one says why
    FailedRead f;
    f.unit = u;
    f.error = std::current_exception();
    f.what = what;
    failed_read_ = std::move(f);
  }

 private:
  struct Pending {
    int unit = 0;
    DeviceBuffer<T> scratch;                 // stages 2-3: receives the reduced shard
    DeviceBuffer<MasterT> shard_scratch;     // stage 1 under Offload<CPU>: the same, in fp32
    bool boundary = false;                   // stages 2-3: the unit's last fold of the window
    DeviceBuffer<std::uint8_t> packed_send;  // qgZ: this rank's gradient packed, a run a rank
    DeviceBuffer<std::uint8_t> packed_recv;  // qgZ: every rank's run for this rank's shard
    parallel::Work work;                     // declared after the buffers it writes
  };

  template <class B>
  static auto span(B& b) {
    return std::span<typename std::remove_reference_t<decltype(*b.data())>>(b.data(), b.size());
  }
  Unit& unit(int u) { return units_[static_cast<std::size_t>(u)]; }
  int num_units() const { return static_cast<int>(units_.size()); }
  // How the next fold into s's fp32 accumulator treats it: the window's first starts it.
  static Fold next_fold(Unit& s) {
    return std::exchange(s.window_folded, true) ? Fold::add : Fold::start;
  }
  // The last unit (in forward order) that uses unit v; -1 when none does.
  int last_user(int v) {
    if (last_user_.empty()) {
      last_user_.assign(units_.size(), -1);
      for (int u = 0; u < num_units(); ++u) {
        for (int used : model_.unit_uses(u)) last_user_[static_cast<std::size_t>(used)] = u;
      }
    }
    return last_user_[static_cast<std::size_t>(v)];
  }

  // qwZ: packs unit u's slice (gather_source's values) as int8 codes and scales on the compute
  // stream and all-gathers the packed slices over its group.
  void start_quantized_gather(int u) {
    Unit& s = unit(u);
    const auto packed = static_cast<std::size_t>(
        quant::int8_packed_bytes(static_cast<std::int64_t>(s.numel(Extent::shard))));
    s.quantized_slice = take_from(packed_pool_, packed);
    s.quantized_whole = take_from(packed_pool_, packed * static_cast<std::size_t>(s.group->size()));
    backend_.quantize_int8(span(s.quantized_slice), gather_source(u));
    backend_.comm_waits_for_compute();
    s.pending_gather = s.group->all_gather_async(
        std::span<const std::uint8_t>(span(s.quantized_slice)), span(s.quantized_whole));
  }
  // qwZ, once unit u's gather is done: every rank's packed slice read back into its place of the
  // unit's whole buffer (one call over the runs), on the compute stream; the packed buffers go back
  // to their pool (the next packing, on the compute stream too, comes after this reading).
  void finish_quantized_gather(int u) {
    Unit& s = unit(u);
    backend_.dequantize_int8(std::span<T>(s.params->data(), s.params->size()),
                             std::span<const std::uint8_t>(span(s.quantized_whole)),
                             s.group->size());
    packed_pool_.push_back(std::move(s.quantized_slice));
    packed_pool_.push_back(std::move(s.quantized_whole));
  }

  // qgZ's packing at options_.quantized_gradient_bits (8: core/int8_blocks.hpp, 4:
  // int4_blocks.hpp): a packed run's bytes, the packing in runs and the sum of runs.
  std::int64_t gradient_packed_bytes(std::int64_t n) const {
    return options_.quantized_gradient_bits == 4 ? quant::int4_packed_bytes(n)
                                                 : quant::int8_packed_bytes(n);
  }
  void quantize_gradient(std::span<std::uint8_t> out, std::span<const T> in, std::int64_t runs,
                         std::int64_t columns = 1, DeviceBuffer<std::uint8_t>* kept = nullptr) {
    if (kept != nullptr) {
      backend_.quantize_with_feedback(out, in, span(*kept),
                                      quant::ErrorFeedback::with_beta(options_.loco_err_beta),
                                      options_.quantized_gradient_bits, runs, columns);
    } else if (options_.quantized_gradient_bits == 4) {
      backend_.quantize_int4(out, in, runs, columns);
    } else {
      backend_.quantize_int8(out, in, runs, columns);
    }
  }
  void sum_gradient(std::span<T> out, std::span<const std::uint8_t> in, float factor,
                    std::int64_t outputs = 1) {
    if (options_.quantized_gradient_bits == 4) {
      backend_.sum_int4(out, in, factor, outputs);
    } else {
      backend_.sum_int8(out, in, factor, outputs);
    }
  }

  // LoCo: the bytes of unit u's kept error for its gradient's packing (hop: the second hop's),
  // int8 runs of its shard's size, one a rank of the group that packing goes over.
  std::size_t kept_bytes(int u, bool hop) const {
    const Unit& s = units_[static_cast<std::size_t>(u)];
    const int runs = hop ? s.across_secondary->size() : s.group->size();
    return static_cast<std::size_t>(
        loco_kept_error_bytes(static_cast<std::int64_t>(s.numel(Extent::shard)), runs));
  }
  // LoCo: the error kept for unit u's next packing (hop: its second hop's, else its gradient's),
  // made zeroed for its first packing and zeroed again after loco_reset_interval packings; null
  // without LoCo.
  DeviceBuffer<std::uint8_t>* kept_error(int u, bool hop) {
    if (!options_.loco) return nullptr;
    if (kept_errors_.empty()) kept_errors_.resize(units_.size());
    KeptError& errors = kept_errors_[static_cast<std::size_t>(u)];
    auto& k = hop ? errors.hop : errors.packing;
    if (k.values.size() == 0) {
      k.values = backend_.template make_buffer<std::uint8_t>(kept_bytes(u, hop));
      k.packings = 0;
    } else if (k.packings == options_.loco_reset_interval) {
      backend_.clear(span(k.values));
      k.packings = 0;
    }
    ++k.packings;
    return &k.values;
  }

  // qgZ: packs unit u's compute gradient as block-wise int8 (or int4) on the compute stream, a run
  // for each rank's shard (the parts a reduce-scatter would send it), and exchanges the runs by an
  // all-to-all into p's packed_recv. In one hop (over the unit's group) rank r then holds every
  // rank's run for its shard r. Under hpZ (the unit's across_secondary group) the first hop is
  // inside the secondary group of H ranks: rank h of it receives, from each, the runs of the G
  // shards at place h of every secondary group (the runs packed column by column), to be summed
  // and sent across (start_second_hop). The packed buffers come from qwZ's pool.
  void start_quantized_reduction(int u, Pending& p) {
    Unit& s = unit(u);
    const int ranks = s.group->size();
    const auto packed = static_cast<std::size_t>(
        gradient_packed_bytes(static_cast<std::int64_t>(s.grad_shard.size())));
    p.packed_send = take_from(packed_pool_, packed * static_cast<std::size_t>(ranks));
    p.packed_recv = take_from(packed_pool_, packed * static_cast<std::size_t>(ranks));
    parallel::AnyComm& first = s.across_secondary != nullptr ? *s.secondary_group : *s.group;
    quantize_gradient(span(p.packed_send), std::span<const T>(span(*s.grads)), ranks,
                      s.across_secondary != nullptr ? first.size() : 1, kept_error(u, false));
    backend_.comm_waits_for_compute();
    p.work = first.all_to_all_async(std::span<const std::uint8_t>(span(p.packed_send)),
                                    span(p.packed_recv));
  }
  // qgZ under hpZ, once the first hop is done: the G shards' sums over the secondary group (their
  // mean, in f32, rounded once to the compute type) are packed again, a run for each, and
  // all-to-all'd across the secondary groups, so rank g*H + h receives every group's run for its
  // own shard (finish_quantized_reduction sums them). Only these bytes, 1/H of one hop's, cross
  // between the groups (nodes).
  void start_second_hop(Pending& p) {
    Unit& s = unit(p.unit);
    const int across = s.across_secondary->size();
    const std::size_t n = s.grad_shard.size();
    DeviceBuffer<T> partial = take_scratch(n * static_cast<std::size_t>(across));
    sum_gradient(span(partial), std::span<const std::uint8_t>(span(p.packed_recv)),
                 1.0f / static_cast<float>(s.secondary_group->size()), across);
    const auto packed =
        static_cast<std::size_t>(gradient_packed_bytes(static_cast<std::int64_t>(n)) * across);
    packed_pool_.push_back(std::move(p.packed_send));
    packed_pool_.push_back(std::move(p.packed_recv));
    p.packed_send = take_from(packed_pool_, packed);
    p.packed_recv = take_from(packed_pool_, packed);
    quantize_gradient(span(p.packed_send), std::span<const T>(span(partial)), across, 1,
                      kept_error(p.unit, true));
    scratch_pool_.push_back(std::move(partial));  // the next user comes after, on compute
    backend_.comm_waits_for_compute();
    p.work = s.across_secondary->all_to_all_async(
        std::span<const std::uint8_t>(span(p.packed_send)), span(p.packed_recv));
  }
  // qgZ, once p's last all-to-all (over `over`) is done: the mean of every run it received for
  // this rank's shard into p's scratch (f32 sums, rounded once), on the compute stream, where the
  // plain reduce-scatter would have left the averaged shard; the packed buffers go back to their
  // pool.
  void finish_quantized_reduction(Pending& p, const parallel::AnyComm& over) {
    sum_gradient(span(p.scratch), std::span<const std::uint8_t>(span(p.packed_recv)),
                 1.0f / static_cast<float>(over.size()));
    packed_pool_.push_back(std::move(p.packed_send));
    packed_pool_.push_back(std::move(p.packed_recv));
  }

  // hpZ: keeps this rank's share of unit u's whole parameters, just gathered from the master
  // slices, among its secondary group: the part that group's all-gather puts at this rank's place
  // (a copy on the compute stream, which the next gather's communication waits for).
  void keep_secondary(int u) {
    Unit& s = unit(u);
    const std::size_t n =
        s.numel(Extent::whole) / static_cast<std::size_t>(s.secondary_group->size());
    if (!s.secondary) s.secondary.emplace(backend_.template make_buffer<T>(n));
    const std::size_t at = n * static_cast<std::size_t>(s.secondary_group->rank());
    backend_.copy_async(std::span<T>(s.secondary->data(), n),
                        std::span<const T>(s.params->data() + at, n));
  }

  // The end of a forward's window: reads ahead, within budget and the free read buffers, the
  // master slices the backward gathers first, in its order (last unit first). Those are the
  // units the forward gives back: not persistent, not pinned (a pinned unit stays gathered for
  // a later user, or its users' backward gathers it), and not gathered from secondary shards
  // (hpZ). A read held for the forward's own gather of a unit counts; the next prefetch, after
  // that gather took it, reads the unit again for the backward.
  void read_ahead_for_backward(std::int64_t budget) {
    for (int w = num_units() - 1; w >= 0 && budget > 0; --w) {
      const Unit& s = unit(w);
      if (s.persistent || s.pinned || s.secondary_group != nullptr) continue;
      if (!reads_master_ahead(w, /*backward=*/true)) return;
      budget -= s.partition->padded_numel();
      if (!store_.reading_ahead(w) && !store_.read_ahead(w)) return;
    }
  }
  // True when unit v's gather (a backward's when backward) would read v's master slice from a
  // store that can read it ahead (Offload<NVMe>), and reading ahead is on.
  bool reads_master_ahead(int v, bool backward) {
    if constexpr (Store::in_memory || Unit::host_states) {
      (void)v;
      (void)backward;
      return false;
    } else {
      return options_.nvme_read_ahead && store_.read_ahead_capacity() > 0 &&
             !(backward && unit(v).secondary);
    }
  }

  // The buffer the all-gather of unit u reads: the master slice itself when it is resident in
  // the compute type in the compute device's memory, else a pooled scratch that lives until the
  // gather finished, filled by the store (rounded from the slice, or read from its file) or,
  // under Offload<CPU>, copied up by DMA from pinned host memory (the fp32 slice, or its compute
  // copy below fp32). No low-precision copy is kept in the device's memory between gathers, so
  // stage 3 holds 16 psi / N there at rest whatever the precision.
  std::span<const T> gather_source(int u) {
    Unit& s = unit(u);
    if (s.offloaded()) {
      s.gather_scratch = take_scratch(s.numel(Extent::shard));
      const std::span<T> out = span(s.gather_scratch);
      backend_.copy_async(out, host_compute_values(s));
      return out;
    }
    // In the compute device's memory (a unit Offload<CPU> keeps there too), or in files.
    if constexpr (Unit::compute_is_master && Store::in_memory) {
      const std::span<MasterT> m = s.resident_master();
      return std::span<const T>(m.data(), m.size());
    } else {
      s.gather_scratch = take_scratch(s.numel(Extent::shard));
      const std::span<T> out = span(s.gather_scratch);
      // The gather waits for the read (from its read ahead, when one is held).
      const auto timed = timed_phase(profile::Phase::gather_wait);
      try {
        store_.read_master_into(u, out, backend_);
      } catch (const IoError& e) {
        backend_.clear(out);  // the gather goes on: see the file comment
        keep_failed_read(u, e.what());
      }
      return out;
    }
  }
  // Offload<CPU>: unit s's master slice in the compute type, in pinned host memory: the slice
  // itself in f32, else its compute copy, rounded here on the host when no update wrote it since
  // the slice was set (initialisation, a load), after the device's earlier copies of it.
  std::span<const T> host_compute_values(Unit& s) {
    if constexpr (Unit::compute_is_master) {
      const std::span<MasterT> m = s.resident_master();
      return std::span<const T>(m.data(), m.size());
    } else {
      const std::span<T> copy = span(s.compute_copy);
      if (!s.compute_copy_current) {
        backend_.host_waits_for_compute();
        HostBackend::convert_into(copy, std::span<const MasterT>(s.resident_master()));
        s.compute_copy_current = true;
      }
      return copy;
    }
  }
  // Waits for the oldest reduction in flight and completes it, or, under hybrid sharding, starts
  // the average of its reduced shard over the unit's replicas (in place, on the communication
  // stream after the reduce-scatter) and queues that, up to max_pending_reductions in flight.
  // Every rank starts those in its order of reductions, so they match on every replica group.
  void finish_oldest() {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    const bool quantized = p.packed_recv.size() > 0;
    wait(p.work,
         quantized                   ? "all-to-all of the quantized gradients"
         : traits::all_reduces_grads ? "all-reduce"
                                     : "reduce-scatter",
         p.unit);
    if constexpr (traits::shards_grads) release_reduced_gradient(p.unit);
    if (quantized && unit(p.unit).across_secondary != nullptr) {
      // qgZ's second hop, queued with the replicas' averages (hpZ excludes hybrid sharding).
      start_second_hop(p);
      queue_second_stage(std::move(p));
      return;
    }
    if (quantized) finish_quantized_reduction(p, *unit(p.unit).group);
    if (parallel::AnyComm* replicas = unit(p.unit).replicas) {
      if constexpr (traits::shards_grads) {
        const std::span<T> reduced = span(p.scratch);
        // qgZ's mean was written on the compute stream.
        if (quantized) backend_.comm_waits_for_compute();
        p.work = replicas->all_reduce_async(std::span<const T>(reduced), reduced,
                                            parallel::ReduceOp::avg);
      } else {
        const std::span<MasterT> reduced =
            unit(p.unit).offloaded() ? span(p.shard_scratch) : span(unit(p.unit).grad_shard);
        p.work = replicas->all_reduce_async(std::span<const MasterT>(reduced), reduced,
                                            parallel::ReduceOp::avg);
      }
      queue_second_stage(std::move(p));
      return;
    }
    complete(std::move(p));
  }
  // Queues p's second collective (an average over replicas, or qgZ's second hop), waiting for the
  // oldest ones beyond max_pending_reductions.
  void queue_second_stage(Pending p) {
    replicating_.push_back(std::move(p));
    while (static_cast<int>(replicating_.size()) > options_.max_pending_reductions) {
      finish_replicated();
    }
  }
  // Stages 2-3: unit u's whole gradient is reduce-scattered, so it is released (at stage 3 with
  // its parameters, once its last user is done) before any average over replicas, which holds
  // only the shard: as many whole gradients stay in flight as without hybrid sharding.
  void release_reduced_gradient(int u) {
    Unit& s = unit(u);
    s.grads.reset();
    if constexpr (traits::gathers_before_use) {
      if (s.pinned && !s.persistent) s.params.reset();  // its last user is done
    }
    if (s.params) bind(u);
  }
  // Waits for the oldest second-stage collective (an average over replicas, or qgZ's second hop,
  // whose runs it then sums) and completes its reduction.
  void finish_replicated() {
    Pending p = std::move(replicating_.front());
    replicating_.pop_front();
    const bool quantized = p.packed_recv.size() > 0;
    wait(p.work,
         quantized ? "all-to-all of the quantized gradients across the secondary groups"
                   : "all-reduce over the replicas",
         p.unit);
    if (quantized) finish_quantized_reduction(p, *unit(p.unit).across_secondary);
    complete(std::move(p));
  }
  // A reduction whose collectives are done: its shard is scaled and folded where it belongs.
  void complete(Pending p) {
    Unit& s = unit(p.unit);
    // An expert unit's gradient, averaged over expert_dp, is divided by the whole dp (grad_scale
    // 1/ep), in the fp32 (f64) accumulator's type.
    if constexpr (!traits::shards_grads) {
      if (s.offloaded() && !traits::all_reduces_grads) {
        // The reduced shard, scaled and summed in the units' memory, goes down to the pinned
        // host shard by DMA; its scratch is freed once compute has waited for the copy.
        const std::span<MasterT> reduced = span(p.shard_scratch);
        if (s.grad_scale != 1.0) backend_.scale(reduced, s.grad_scale);
        take_shard_sum(p.unit, reduced);
        backend_.comm_waits_for_compute();
        backend_.comm_copy_async(span(s.grad_shard), std::span<const MasterT>(reduced));
        copies_unordered_ = true;
        copied_out_.push_back(std::move(p.shard_scratch));
      } else if (s.grad_scale != 1.0) {
        backend_.scale(traits::all_reduces_grads ? s.whole_accumulator() : span(s.grad_shard),
                       s.grad_scale);
      }
    }
    if constexpr (traits::shards_grads) {
      const std::span<const T> reduced(span(p.scratch));
      const Fold fold = next_fold(s);
      if (s.offloaded()) {
        fold_into_host_shard(p.unit, reduced, fold, p.boundary);
      } else {
        backend_.accumulate(span(s.grad_shard), reduced, s.grad_scale, fold);
      }
      scratch_pool_.push_back(std::move(p.scratch));
    }
  }
  // Makes compute issued next wait for the DMA copies issued so far, and frees the scratch they
  // read.
  void order_copies_before_compute() {
    if (!copies_unordered_) return;
    backend_.compute_waits_for_comm_copies();
    copies_unordered_ = false;
    copied_out_.clear();
  }
  // Offload<CPU> at stages 2-3, a fold of unit u's reduced shard: the fold (the same kernel)
  // writes a staging buffer in the units' memory, and a DMA copy on the communication stream
  // moves it down into the pinned shard, so the compute stream neither writes over the bus nor
  // waits for it. A later micro-step's fold (Fold::add) first copies the pinned shard up into
  // the staging buffer by DMA (as DeepSpeed does); every fold takes the shard's sum of squares
  // there, so the window's last one is the norm's. One staging buffer, sized to the largest
  // shard, serves every unit: each fold into it follows a wait() (compute ordered after the DMA
  // copies so far: the last copy out of it, and the last copy into this pinned shard);
  // drain_reductions orders the last copies before what reads the shards. With
  // accumulate_grads_on_device the unit's own fp32 shard in device memory (grad_accumulator)
  // takes every fold of the window and goes down once, at its last (last: the window's last
  // micro-step), with its sum: the same values, without the bus twice a micro-step.
  void fold_into_host_shard(int u, std::span<const T> reduced, Fold fold, bool last) {
    Unit& s = unit(u);
    if (s.grad_accumulator.size() != 0) {
      const std::span<MasterT> acc = span(s.grad_accumulator);
      backend_.accumulate(acc, reduced, s.grad_scale, fold);
      if (!last) return;
      take_shard_sum(u, acc);
      backend_.comm_waits_for_compute();
      backend_.comm_copy_async(span(s.grad_shard), std::span<const MasterT>(acc));
      copies_unordered_ = true;
      return;
    }
    if (fold_staging_.size() == 0) {
      std::size_t largest = 0;
      for (const Unit& v : units_) {
        if (v.offloaded()) largest = std::max(largest, v.grad_shard.size());
      }
      fold_staging_ = backend_.template make_buffer<MasterT>(largest);
    }
    const std::span<MasterT> staged(fold_staging_.data(), s.grad_shard.size());
    if (fold == Fold::add) {
      backend_.copy_async(staged, std::span<const MasterT>(span(s.grad_shard)));
    }
    backend_.accumulate(staged, reduced, s.grad_scale, fold);
    take_shard_sum(u, staged);
    backend_.comm_waits_for_compute();
    backend_.comm_copy_async(span(s.grad_shard), std::span<const MasterT>(staged));
    copies_unordered_ = true;
  }
  DeviceBuffer<T> take_scratch(std::size_t n) { return take_from(scratch_pool_, n); }
  // A buffer of n elements from pool (one given back after its last use, in the compute
  // stream's order), else a new one.
  template <class E>
  DeviceBuffer<E> take_from(std::vector<DeviceBuffer<E>>& pool, std::size_t n) {
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (it->size() == n) {
        DeviceBuffer<E> b = std::move(*it);
        pool.erase(it);
        return b;
      }
    }
    return backend_.template make_buffer<E>(n);
  }
  // Times what runs until the scope ends as phase p (nothing without timers).
  profile::StepTimers::Scope timed_phase(profile::Phase p) {
    return timers_ != nullptr ? timers_->phase(p) : profile::StepTimers::Scope(nullptr);
  }
  // Waits for work, adding the op, the unit and the step to a communication failure.
  void wait(parallel::Work& work, const char* op, int u) {
    const bool gather = std::string_view(op).starts_with("all-gather");
    const auto timed =
        timed_phase(gather ? profile::Phase::gather_wait : profile::Phase::reduction_wait);
    try {
      work.wait();
      // What the collective wrote is read next by the units or the optimizer on the compute
      // stream, and it is on the device now: a device communicator's Work completes once the
      // op's data is there (NcclComm's event recorded after it, CudaLocalComm's streams waited
      // for). So compute does not wait for the comm stream, which holds the collectives issued
      // since (the next units' reductions, the gathers prefetched ahead): they keep overlapping
      // the backward and forward. Only the DMA copies, which no Work tracks, are ordered here:
      // the next fold may write the staging buffer the last one read, and their scratch is
      // freed (order_copies_before_compute).
      order_copies_before_compute();
    } catch (const CommError& e) {
      const auto& specs = unit(u).specs;
      raise<CommError>("Engine rank ", unit(u).group->rank(), ": ", op, " of unit ", u,
                       specs.empty() ? std::string() : " (" + specs.front().name + ")", context_(),
                       " failed: ", e.what());
    }
  }

  Model& model_;
  std::vector<Unit>& units_;
  Store& store_;
  Backend& backend_;
  const EngineOptions& options_;
  ContextFn context_;
  profile::StepTimers* timers_ = nullptr;
  std::function<void(int)> before_gather_;
  std::vector<DeviceBuffer<T>> scratch_pool_;
  std::vector<DeviceBuffer<std::uint8_t>> packed_pool_;  // qwZ's and qgZ's packed runs, for reuse
  DeviceBuffer<MasterT> fold_staging_;  // fold_into_host_shard's; empty until first used
  DeviceBuffer<double> shard_sums_;     // take_shard_sum's slots, one a unit; empty until used
  std::vector<char> shard_sum_taken_;   // which slots hold this window's sum
  bool copies_unordered_ = false;       // a DMA copy was issued after compute last waited for comm
  std::vector<DeviceBuffer<MasterT>> copied_out_;  // stage 1: scratch a DMA copy may still read
  std::deque<Pending> pending_;      // after the pool: its work may still write into its scratch
  std::deque<Pending> replicating_;  // shards being averaged over replicas, or qgZ's second hops
  std::int64_t peak_gathered_elems_ = 0;
  std::vector<int> last_user_;  // last_user(v), filled on first use
  struct KeptError {            // LoCo's, a unit's (kept_error)
    struct Kept {
      DeviceBuffer<std::uint8_t> values;  // block-wise int8, the runs in source order
      std::int64_t packings = 0;  // since it was made or last zeroed (the reset interval: due)
    };
    Kept packing;  // its whole gradient's
    Kept hop;      // hpZ's second hop: its partial sums'
  };
  std::vector<KeptError> kept_errors_;     // by unit; empty without LoCo
  std::optional<FailedRead> failed_read_;  // the first since take_failed_read
  std::int64_t failed_reads_ = 0;
};

}  // namespace zero::engine
