#pragma once
// Engine<Model, Comm, ZeroStage<S>>: data-parallel training of any nn::Model with ZeRO stage
// 0-3 over any communicator, on the host, in the model's element type (f64 for reference tests,
// f32). Storage follows the design: one flat, padded buffer per unit; rank r owns slice r; the
// master shard is the source of truth and is initialised shard by shard (no rank holds a whole
// model at stage 3).
//
//   stage 0: every rank keeps whole params, grads and optimizer input; grads all-reduced (avg)
//            at the accumulation boundary; every rank updates the whole unit.
//   stage 1: whole params and grads; at the boundary grads are reduce-scattered, each rank
//            updates its shard and the params are all-gathered.
//   stage 2: whole params; each unit's grad is reduce-scattered into a shard accumulator right
//            after its backward (every micro-step) and the whole grad is released.
//   stage 3: a unit's params are all-gathered before its forward and again before its backward
//            and released after; units another unit uses (the tied embedding) stay gathered for
//            the step; grads are reduce-scattered per unit as at stage 2.
//
// This first version issues blocking collectives (no overlap yet) and takes the update as a
// callback over (unit, master shard, gradient shard), so any optimizer (or an f64 reference SGD)
// plugs in. Gradients are averaged over ranks and micro-steps, so with equal token counts per
// micro-batch the result equals one process training on the global batch.

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include <parallel/comm/reduce_op.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/engine/partition.hpp>
#include <zero/nn/model.hpp>
#include <zero/policies/zero_stage.hpp>

namespace zero::engine {

/// Run-time settings of an Engine.
struct EngineOptions {
  std::uint64_t seed = 1234;                 ///< per-name initialisation seed
  int gradient_accumulation_steps = 1;       ///< micro-steps per optimizer step
  std::int64_t shard_alignment = 16;         ///< elements; keeps shards vector-aligned
  std::size_t activation_bytes = 256 << 20;  ///< arena for saved activations
};

/// One rank's micro-batch: tokens and targets [batch, seq_len].
struct MicroBatch {
  const std::int32_t* tokens = nullptr;
  const std::int32_t* targets = nullptr;
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
};

template <nn::Model M, class Comm, class Stage>
class Engine {
 public:
  using T = typename M::value_type;
  static constexpr int stage = Stage::stage;
  /// Updates a master shard from its (averaged) gradient shard: (unit, param, grad).
  using UpdateFn = std::function<void(int, std::span<T>, std::span<const T>)>;

  /// Partitions model over comm and initialises this rank's master shards.
  Engine(M& model, Comm& comm, UpdateFn update, EngineOptions options = {})
      : model_(model),
        comm_(comm),
        update_(std::move(update)),
        options_(options),
        arena_(options.activation_bytes, "engine activations") {
    expect<ConfigError>(options_.gradient_accumulation_steps > 0,
                        "Engine: gradient_accumulation_steps ",
                        options_.gradient_accumulation_steps, " must be positive");
    const int units = model_.num_units();
    units_.resize(static_cast<std::size_t>(units));
    for (int u = 0; u < units; ++u) {
      Unit& s = unit(u);
      s.specs = model_.unit_params(u);
      s.partition.emplace(s.specs, comm_.size(), options_.shard_alignment);
      const auto shard = static_cast<std::size_t>(s.partition->shard_numel());
      s.master = Buffer<T>(shard);
      s.grad_shard = Buffer<T>(shard);
      initialise_shard(s.specs, *s.partition, comm_.rank(), s.master.view(), options_.seed);
      for (int used : model_.unit_uses(u)) unit(used).pinned = true;
    }
    if constexpr (stage < 3) {
      for (int u = 0; u < units; ++u) gather(u);  // whole params live for the run
    }
    if constexpr (stage == 0) {
      for (Unit& s : units_) {  // DDP keeps only whole buffers once they are assembled
        s.master = Buffer<T>();
        s.grad_shard = Buffer<T>();
      }
    }
  }

  /// Forward through every unit; returns this rank's mean loss of the micro-batch.
  T forward(const MicroBatch& batch) { return run_forward(batch, true); }
  /// Forward without dropout and without a backward to follow (evaluation, generation: with
  /// null targets only the logits are computed, readable from the model until the next forward).
  T evaluate(const MicroBatch& batch) { return run_forward(batch, false); }

  /// Backward through every unit; at stages 2 and 3 each unit's gradient is reduce-scattered as
  /// soon as every user of the unit has accumulated into it.
  void backward() {
    for (int u = model_.num_units() - 1; u >= 0; --u) {
      if constexpr (stage == 3) acquire(u);
      model_.backward_unit(u, ctx_);
      // A used unit (the tied embedding) is reduced at its own backward, which runs after
      // every user's backward in the reverse order.
      if constexpr (stage >= 2) reduce_unit_gradient(u);
      if constexpr (stage == 3) release_after_use(u);
    }
    if (++micro_step_ == options_.gradient_accumulation_steps) boundary_pending_ = true;
  }

  /// At the accumulation boundary: reduce (stages 0, 1), update, re-gather (stages 0-2).
  /// Returns false (and does nothing) between boundaries.
  bool step() {
    if (!boundary_pending_) return false;
    const auto world = static_cast<std::size_t>(comm_.size());
    for (int u = 0; u < model_.num_units(); ++u) {
      Unit& s = unit(u);
      const auto shard = static_cast<std::size_t>(s.partition->shard_numel());
      if constexpr (stage == 0) {
        comm_.all_reduce(s.grads->data_span(), parallel::ReduceOp::avg);
        update_(u, s.values->data_span(), s.grads->data_span());  // whole unit, every rank
        zero_fill(s.grads->data_span());
        continue;
      } else if constexpr (stage == 1) {
        comm_.reduce_scatter(std::span<const T>(s.grads->data_span()), s.grad_shard.view().span(),
                             parallel::ReduceOp::avg);
        zero_fill(s.grads->data_span());
      }
      update_(u, s.master.view().span(), s.grad_shard.view().span());
      zero_fill(s.grad_shard.view().span());
      if constexpr (stage < 3) {
        comm_.all_gather(std::span<const T>(s.master.view().span()),
                         s.values->data_span().first(shard * world));
      }
    }
    micro_step_ = 0;
    boundary_pending_ = false;
    ++steps_;
    return true;
  }

  /// The whole flat parameters of unit u (gathered from every rank's shard; a collective).
  std::vector<T> gather_unit_values(int u) {
    Unit& s = unit(u);
    if constexpr (stage == 0) {
      return std::vector<T>(s.values->view().begin(),
                            s.values->view().begin() + s.partition->numel());
    }
    std::vector<T> whole(static_cast<std::size_t>(s.partition->padded_numel()));
    comm_.all_gather(std::span<const T>(s.master.view().span()), std::span<T>(whole));
    whole.resize(static_cast<std::size_t>(s.partition->numel()));
    return whole;
  }

  /// Bytes of model state held by this rank right now, by category.
  struct MemoryReport {
    std::size_t master_bytes = 0, grad_shard_bytes = 0, whole_param_bytes = 0, whole_grad_bytes = 0;
    std::size_t total() const {
      return master_bytes + grad_shard_bytes + whole_param_bytes + whole_grad_bytes;
    }
  };
  MemoryReport memory_report() const {
    MemoryReport r;
    for (const Unit& s : units_) {
      r.master_bytes += s.master.bytes();
      r.grad_shard_bytes += s.grad_shard.bytes();
      if (s.values) r.whole_param_bytes += s.values->bytes();
      if (s.grads) r.whole_grad_bytes += s.grads->bytes();
    }
    return r;
  }
  std::int64_t steps() const { return steps_; }
  const UnitPartition& partition(int u) const { return *unit_ref(u).partition; }

 private:
  // A whole (padded) unit buffer whose views the model is bound to.
  struct Whole {
    Buffer<T> buffer;
    explicit Whole(std::size_t n) : buffer(n) {}
    std::span<T> data_span() { return buffer.view().span(); }
    Tensor<T> view() { return buffer.view(); }
    std::size_t bytes() const { return buffer.bytes(); }
  };
  struct Unit {
    std::vector<nn::ParamSpec> specs;
    std::optional<UnitPartition> partition;
    Buffer<T> master, grad_shard;        // this rank's shard (stage 0: unused)
    std::optional<Whole> values, grads;  // whole unit while gathered
    bool pinned = false;                 // used by another unit: gathered for the whole step
  };

  T run_forward(const MicroBatch& batch, bool training) {
    arena_.reset();
    ctx_ = {};
    ctx_.arena = &arena_;
    ctx_.tokens = batch.tokens;
    ctx_.targets = batch.targets;
    ctx_.batch = batch.batch;
    ctx_.seq_len = batch.seq_len;
    ctx_.training = training;
    ctx_.loss_scale = T(1) / static_cast<T>(options_.gradient_accumulation_steps);
    for (int u = 0; u < model_.num_units(); ++u) {
      if constexpr (stage == 3) acquire(u);
      model_.forward_unit(u, ctx_);
      if constexpr (stage == 3) release_after_use(u);
    }
    return ctx_.loss;
  }

  Unit& unit(int u) { return units_[static_cast<std::size_t>(u)]; }
  const Unit& unit_ref(int u) const { return units_[static_cast<std::size_t>(u)]; }
  static void zero_fill(std::span<T> s) {
    for (T& v : s) v = T(0);
  }

  // Materialises unit u's whole params (all-gather of the shards) and gradient buffer, and binds
  // the model to them.
  void gather(int u) {
    Unit& s = unit(u);
    const auto padded = static_cast<std::size_t>(s.partition->padded_numel());
    s.values.emplace(padded);
    s.grads.emplace(padded);
    comm_.all_gather(std::span<const T>(s.master.view().span()), s.values->data_span());
    std::vector<nn::ParamView<T>> views;
    for (int p = 0; p < s.partition->num_params(); ++p) {
      const ParamSlot& slot = s.partition->slot(p);
      const Shape& shape = s.specs[static_cast<std::size_t>(p)].shape;
      views.push_back({s.values->view().slice(slot.offset, slot.numel).reshape(shape),
                       s.grads->view().slice(slot.offset, slot.numel).reshape(shape)});
    }
    model_.bind_unit(u, views);
  }
  // Stage 3: gathers u and the units it uses unless they are already gathered.
  void acquire(int u) {
    if (!unit(u).values) gather(u);
    for (int used : model_.unit_uses(u)) {
      if (!unit(used).values) gather(used);
    }
  }
  // Stage 3: frees u's whole buffers unless another unit still needs them this step.
  void release_after_use(int u) {
    Unit& s = unit(u);
    if (s.pinned) return;
    s.values.reset();
    s.grads.reset();
  }
  // Stages 2-3: reduce-scatter u's whole gradient into the shard accumulator and clear it.
  void reduce_unit_gradient(int u) {
    Unit& s = unit(u);
    const auto shard = static_cast<std::size_t>(s.partition->shard_numel());
    if (reduce_scratch_.size() < shard) reduce_scratch_ = Buffer<T>(shard);  // grows once
    const std::span<T> reduced = reduce_scratch_.view().span().first(shard);
    comm_.reduce_scatter(std::span<const T>(s.grads->data_span()), reduced,
                         parallel::ReduceOp::avg);
    T* acc = s.grad_shard.data();
    for (std::size_t i = 0; i < shard; ++i) acc[i] += reduced[i];
    zero_fill(s.grads->data_span());
    if constexpr (stage == 3) {
      if (s.pinned) {  // its last user is done: release it now
        s.values.reset();
        s.grads.reset();
      }
    }
  }

  M& model_;
  Comm& comm_;
  UpdateFn update_;
  EngineOptions options_;
  Arena<Host> arena_;
  std::vector<Unit> units_;
  Buffer<T> reduce_scratch_;  // receives each unit's reduce-scatter before accumulation
  nn::StepContext<T> ctx_;
  int micro_step_ = 0;
  bool boundary_pending_ = false;
  std::int64_t steps_ = 0;
};

}  // namespace zero::engine
