#pragma once
// Engine<Model, Policies...>: data-parallel training of any nn::Model with ZeRO stage 0-3 over
// any communicator (type-erased to AnyComm, so one instantiation per policy set), on the host.
// Storage follows the design: one flat, padded buffer per unit; rank r owns slice r; the master
// slice (fp32, or f64 for reference models) is the source of truth and is initialised slice by
// slice, so at stage 3 no rank ever holds a whole model.
//
//   stage 0: every rank keeps the whole master and optimizer states; at the accumulation
//            boundary each unit's gradient is all-reduced (avg) as soon as its backward is done.
//   stage 1: whole params and gradient accumulators; at the boundary each unit's gradient is
//            reduce-scattered after its backward, each rank updates its slice, and the params are
//            all-gathered during the update of the next units.
//   stage 2: whole params; every micro-step each unit's gradient is reduce-scattered into an fp32
//            shard accumulator right after its backward and the whole gradient is released.
//   stage 3: a unit's params are all-gathered before its forward and again before its backward
//            (the next units prefetched up to a byte budget, small units kept for the run),
//            released after use; gradients as at stage 2. A unit another unit uses (the tied
//            embedding) stays gathered from its forward to its own backward.
//
// Communication is async: a unit's reduction runs while the next unit's backward computes, and
// gathers run while earlier units compute; every rank issues the same collectives in the same
// order because units run in a static order. Gradients are averaged over ranks and micro-steps,
// so with equal token counts per micro-batch the result equals one process on the global batch.
//
// Precision<bf16|f16>: units compute on bf16/f16 copies; gradients are accumulated in fp32 (the
// shard accumulators at stages 2-3, whole fp32 accumulators at stages 0-1); the update writes
// the new low-precision copy in the same fused pass. fp16 scales the loss (DeepSpeed's dynamic
// scaler); an Inf/NaN anywhere is seen by every rank through the global-norm all-reduce, so
// every rank skips the same steps. Clipping uses that same global norm.

#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <optim/any_optimizer.hpp>
#include <optim/grad_norm.hpp>
#include <optim/loss_scaler.hpp>
#include <optim/lr_schedule.hpp>
#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <zero/config/config.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/engine/engine_checkpoint.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/engine_policies.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/engine/partition.hpp>
#include <zero/nn/model.hpp>
#include <zero/offload/nvme_swapper.hpp>

namespace zero::engine {

template <nn::Model M, class... Policies>
class Engine {
 public:
  using policies = EnginePolicies<M, Policies...>;
  using T = typename M::value_type;                   ///< compute element type
  using MasterT = typename policies::master_type;     ///< master / accumulator element type
  static constexpr int stage = policies::stage;
  static constexpr bool same_type = std::is_same_v<T, MasterT>;
  static constexpr bool loss_scaling = std::is_same_v<T, f16>;
  static constexpr bool offload_nvme = std::is_same_v<typename policies::offload, NVMe>;
  /// Updates a master slice from its gradient (already averaged, unscaled and clipped):
  /// (unit, master, grad). Stage 0 passes the whole padded unit, stages 1-3 this rank's shard.
  using UpdateFn = std::function<void(int, std::span<MasterT>, std::span<const MasterT>)>;

  /// An engine whose update is a callback (any optimizer, or an f64 reference SGD).
  template <parallel::Communicator C>
  Engine(M& model, C& comm, UpdateFn update, EngineOptions options = {})
      : model_(model), comm_(comm), options_(options), update_(std::move(update)),
        arena_(options.activation_bytes, "engine activations") {
    static_assert(!offload_nvme,
                  "zero::Engine: Offload<NVMe> swaps the states of an optimizer built from the "
                  "config; construct the engine from a Config");
    setup();
  }

  /// An engine configured from a DeepSpeed JSON config: accumulation, clipping, fp16 scaler,
  /// stage-3 buckets, the optimizer and the LR scheduler. The config's stage, precision and
  /// offload must agree with the policies (ConfigError otherwise).
  template <parallel::Communicator C>
  Engine(M& model, C& comm, const Config& config, EngineOptions options = {})
      : model_(model), comm_(comm), options_(options.with_config(config, comm.size())),
        arena_(options.activation_bytes, "engine activations") {
    static_assert(!policies::reference_model,
                  "zero::Engine: an optimizer from the config updates fp32 masters; an f64 "
                  "reference model takes an UpdateFn");
    check_policies_against(config);
    expect<ConfigError>(config.optimizer.has_value(),
                        "optimizer: required to build an Engine from a config");
    optimizer_spec_ = *config.optimizer;
    if constexpr (offload_nvme) {  // offload_optimizer's settings, or offload_param's alone
      const bool optimizer_section =
          config.zero_optimization.offload_optimizer.device == config::OffloadDevice::nvme;
      nvme_config_.emplace(offload::NvmeConfig::from_config(
          config, optimizer_section ? offload::OffloadTarget::optimizer
                                    : offload::OffloadTarget::param));
    }
    setup();
    const double lr = optimizer_spec_.get("lr", optimizers_.empty() ? 1e-3 : optimizers_[0].lr());
    if (config.scheduler) {
      nlohmann::json block = {{"type", config.scheduler->type}, {"params", nlohmann::json::object()}};
      for (const auto& [k, v] : config.scheduler->params) {
        block["params"][k] = v.size() == 1 ? nlohmann::json(v[0]) : nlohmann::json(v);
      }
      scheduler_.emplace(optim::LrScheduler::from_json(block, lr));
    }
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Forward through every unit; returns this rank's mean loss of the micro-batch (unscaled).
  T forward(const MicroBatch& batch) {
    expect_intact("forward");
    const T loss = run_forward(batch, true);
    if (!std::isfinite(convert<double>(loss))) ++nonfinite_in_window_;
    return loss;
  }
  /// Forward without dropout and without a backward to follow (evaluation, generation: with
  /// null targets only the logits are computed, readable from the model until the next forward).
  T evaluate(const MicroBatch& batch) {
    expect<Error>(!forward_done_,
                  "Engine::evaluate: a training forward is waiting for its backward; evaluating "
                  "now would overwrite what that backward needs");
    expect_intact("evaluate");
    const T loss = run_forward(batch, false);
    if constexpr (stage == 3) {
      for (int u = 0; u < units(); ++u) {
        if (!unit(u).persistent) release(u);
      }
    }
    return loss;
  }

  /// Backward through every unit. A unit's gradient is complete once its own backward ran (its
  /// users run before it in reverse order); it is then reduced asynchronously (every micro-step
  /// at stages 2-3, on the boundary micro-step at stages 0-1) while the next unit computes.
  void backward() {
    expect<Error>(forward_done_, "Engine::backward: call forward first");
    forward_done_ = false;
    const bool boundary = micro_step_ + 1 == options_.gradient_accumulation_steps;
    for (int u = units() - 1; u >= 0; --u) {
      acquire(u, /*with_grads=*/true);
      prefetch(u, -1);
      model_.backward_unit(u, ctx_);
      gradient_complete(u, boundary);
      if constexpr (stage == 3) {
        if (!unit(u).pinned && !unit(u).persistent) release_values(u);
      }
    }
    drain_reductions();
    if (++micro_step_ == options_.gradient_accumulation_steps) boundary_pending_ = true;
  }

  /// At the accumulation boundary: global norm (all ranks), skip on Inf/NaN, clip, update every
  /// slice, re-gather (stages 0-2). Returns false (and does nothing) between boundaries, true at
  /// a boundary whether the update was applied or skipped (see last_step_skipped()).
  bool step() {
    if (!boundary_pending_) return false;
    expect_intact("step");
    drain_reductions();
    // One all-reduce carries the sum of squares and the count of non-finite losses.
    double stats[2] = {0.0, static_cast<double>(nonfinite_in_window_)};
    for (int u = 0; u < units(); ++u) stats[0] += local_sum_sq(u);
    comm_.all_reduce(std::span<double>(stats, 2), parallel::ReduceOp::sum);
    const double scale = current_loss_scale();
    last_grad_norm_ = std::sqrt(stats[0]) / scale;
    const bool nonfinite = stats[1] > 0 || !std::isfinite(last_grad_norm_);
    bool apply = !nonfinite;
    if constexpr (loss_scaling) {
      apply = scaler_->update(nonfinite);  // DeepSpeed: an fp16 overflow is a skipped step
    } else if (nonfinite) {
      ++nonfinite_steps_;
      if (options_.nonfinite == NonFinitePolicy::raise) {
        clear_accumulators();
        finish_window();
        raise<NonFiniteError>("Engine: step ", steps_, ": ",
                              stats[1] > 0 ? "the loss was Inf/NaN on some rank"
                                           : "the gradient norm is Inf/NaN",
                              " (nonfinite_policy is raise)");
      }
    }
    last_step_skipped_ = !apply;
    if (apply) {
      const double clip = optim::clip_coefficient(last_grad_norm_, options_.gradient_clipping);
      const double factor = clip / scale;
      if (scheduler_) lr_ = scheduler_->lr();
      if (swapper_) {  // states stream in by sub-group (a unit), update, stream back out
        try {
          swapper_->for_each_group([&](std::size_t g, std::span<const std::span<float>> group) {
            const int u = static_cast<int>(g);
            SwappedIn in(*this, u, group);
            update_unit(u, factor);
            // The gather of the updated slice starts while it is in the buffer (stages 1-2 and
            // persistent stage-3 units) and overlaps the next groups' I/O and updates.
            if (unit(u).persistent) start_gather(u);
          });
        } catch (const std::exception& e) {
          // Some slices are updated and others not, and a group's states may be half written:
          // refuse to train on or save this state (a save would replace a good checkpoint).
          broken_ = e.what();
          clear_accumulators();
          finish_window();  // between steps again, so a checkpoint can be loaded
          throw;
        }
      } else {
        for (int u = 0; u < units(); ++u) update_unit(u, factor);
      }
      if (scheduler_) scheduler_->step();
      ++steps_;
    } else {
      ++skipped_steps_;
    }
    clear_accumulators();
    if (apply) regather_after_update();
    finish_window();
    return true;
  }

  /// Saves a checkpoint as <dir>/<tag> (a collective, atomic; `latest` then names it): the
  /// master slices, optimizer states, counters, scheduler and loss scaler, plus client_state
  /// (the program's own JSON, e.g. its data loader position). Call between steps.
  checkpoint::SaveResult save_checkpoint(const std::filesystem::path& dir, std::string_view tag,
                                         const nlohmann::json& client_state = {}) {
    return save_engine_checkpoint(*this, dir, tag, client_state);
  }
  /// Loads <dir>/<tag> (`latest` when tag is empty), saved at any world size and stage; returns
  /// the client_state saved with it.
  nlohmann::json load_checkpoint(const std::filesystem::path& dir, std::string_view tag = {}) {
    return load_engine_checkpoint(*this, dir, tag);
  }
  /// The engine's own state (counters, scheduler, loss scaler, how it ran) as saved.
  nlohmann::json state_json() const {
    nlohmann::json j;
    j["format"] = "zero-engine-1";
    j["stage"] = stage;
    j["world_size"] = comm_.size();
    j["precision"] = name_of(dtype_of<T>);
    j["master_dtype"] = name_of(dtype_of<MasterT>);
    j["optimizer"] = optimizers_.empty() ? "callback" : optimizers_[0].type_name();
    j["optimizer_step"] = optimizers_.empty() ? steps_ : optimizers_[0].step_count();
    j["steps"] = steps_;
    j["skipped_steps"] = skipped_steps_;
    j["nonfinite_steps"] = nonfinite_steps_;
    j["lr"] = lr_;
    if (scheduler_) j["scheduler"] = {{"last_batch_iteration", scheduler_->last_batch_iteration()}};
    if (scaler_) {
      const optim::StateDict d = scaler_->state_dict();
      j["loss_scaler"] = {{"counters", d.counters}, {"scalars", d.scalars}};
    }
    j["seed"] = options_.seed;
    return j;
  }
  /// Restores what state_json saved; CheckpointError when the optimizer type differs.
  void load_state_json(const nlohmann::json& j) {
    broken_.clear();  // a checkpoint load has just replaced every slice and state
    try {
      const std::string saved = j.at("optimizer").get<std::string>();
      const std::string mine = optimizers_.empty() ? "callback" : optimizers_[0].type_name();
      expect<CheckpointError>(saved == mine, "checkpoint: saved with optimizer ", saved,
                              ", this engine runs ", mine);
      steps_ = j.at("steps").get<std::int64_t>();
      skipped_steps_ = j.at("skipped_steps").get<std::int64_t>();
      nonfinite_steps_ = j.at("nonfinite_steps").get<std::int64_t>();
      lr_ = j.value("lr", 0.0);
      for (auto& o : optimizers_) o.set_step_count(j.at("optimizer_step").get<std::int64_t>());
      if (scheduler_ && j.contains("scheduler")) {
        scheduler_->step(j["scheduler"].at("last_batch_iteration").get<std::int64_t>());
      }
      if (scaler_) {
        expect<CheckpointError>(j.contains("loss_scaler"),
                                "checkpoint: no loss scaler state (saved without fp16)");
        optim::StateDict d;
        d.counters = j["loss_scaler"].at("counters").get<decltype(d.counters)>();
        d.scalars = j["loss_scaler"].at("scalars").get<decltype(d.scalars)>();
        scaler_->load_state_dict(d);
      }
    } catch (const nlohmann::json::exception& e) {
      raise<CheckpointError>("checkpoint: malformed engine state: ", e.what());
    }
  }
  /// Calls fn(unit, optimizer) with the optimizer's states readable (and bound, with NVMe
  /// offload: swapped in one unit at a time); write_back: fn's changes to the states are kept
  /// (NVMe: swapped back out; read_before false starts those units from zeros).
  /// With NVMe offload the unit's master slice is swapped in with its states, so master_span(u)
  /// is valid inside fn as well.
  template <class Fn>
  void for_each_optimizer(Fn&& fn, bool write_back = false, bool read_before = true) {
    if (swapper_) {
      swapper_->for_each_group(
          [&](std::size_t g, std::span<const std::span<float>> group) {
            SwappedIn in(*this, static_cast<int>(g), group);
            fn(static_cast<int>(g), optimizers_[g]);
          },
          offload::SwapPass{read_before, write_back});
      return;
    }
    for (int u = 0; u < static_cast<int>(optimizers_.size()); ++u) {
      fn(u, optimizers_[static_cast<std::size_t>(u)]);
    }
  }
  /// Calls fn(unit, master slice) for every unit: in place, or (NVMe offload) swapped in one
  /// unit at a time with its states and, when write_back, written back out with fn's changes.
  template <class Fn>
  void for_each_master(Fn&& fn, bool write_back) {
    if constexpr (offload_nvme) {
      for_each_optimizer([&](int u, auto&) { fn(u, master_span(u)); }, write_back, true);
    } else {
      for (int u = 0; u < units(); ++u) fn(u, master_span(u));
    }
  }
  /// True between optimizer steps (no micro-step of an accumulation window done yet).
  bool between_steps() const { return micro_step_ == 0 && !boundary_pending_ && !forward_done_; }
  /// Empty while the engine's state is whole; otherwise the error of the step that stopped
  /// part-way (an I/O failure of Offload<NVMe> in the middle of an update). Until a checkpoint
  /// is loaded, forward, evaluate, step and save_checkpoint then raise Error naming it.
  const std::string& broken_reason() const { return broken_; }
  /// Records why the state is inconsistent (a checkpoint load that stopped part-way).
  void mark_broken(std::string why) { broken_ = std::move(why); }
  /// Raises Error when broken_reason() is set; what names the refused operation.
  void expect_intact(std::string_view what) const {
    expect<Error>(broken_.empty(), "Engine::", what, ": an earlier step stopped part-way (",
                  broken_, "); its state is inconsistent, so load a checkpoint to continue");
  }
  /// True when the engine was built from a config (it owns optimizers).
  bool has_optimizer() const { return !optimizers_.empty(); }
  /// The data-parallel communicator (type-erased).
  parallel::AnyComm& comm() { return comm_; }

  /// Waits for every collective the engine still has in flight (the parameter gathers a step
  /// leaves running for the next forward).
  void synchronize() {
    drain_reductions();
    for (int u = 0; u < units(); ++u) finish_gather(u);
  }

  /// The whole flat parameters of unit u from the master (a collective; f64/f32 values).
  std::vector<MasterT> gather_unit_values(int u) {
    UnitState& s = unit(u);
    const auto numel = static_cast<std::size_t>(s.partition->numel());
    if constexpr (stage == 0) {
      const auto m = master_span(u);
      return std::vector<MasterT>(m.begin(), m.begin() + static_cast<std::ptrdiff_t>(numel));
    } else {
      std::vector<MasterT> whole(static_cast<std::size_t>(s.partition->padded_numel()));
      std::vector<MasterT> staging;
      comm_.all_gather(master_for_read(u, staging), std::span<MasterT>(whole));
      whole.resize(numel);
      return whole;
    }
  }

  /// Bytes of model state held by this rank right now, by category.
  MemoryReport memory_report() const {
    MemoryReport r;
    for (const UnitState& s : units_) {
      r.master_bytes += s.master.size() * sizeof(MasterT);
      if (stage == 0 && same_type) r.master_bytes += s.values ? s.values->size() * sizeof(T) : 0;
      r.grad_accumulator_bytes += s.grad_shard.size() * sizeof(MasterT) +
                                  s.whole_acc.size() * sizeof(MasterT);
      r.scratch_bytes += s.gather_scratch.size() * sizeof(T);
      if (s.values && !(stage == 0 && same_type)) r.whole_param_bytes += s.values->size() * sizeof(T);
      if (s.grads) r.whole_grad_bytes += s.grads->size() * sizeof(T);
    }
    for (const auto& o : optimizers_) r.optimizer_bytes += o.state_bytes();
    if (swapper_) {
      r.offloaded_bytes += swapper_->file_bytes();
      r.scratch_bytes += swapper_->buffer_bytes();
    }
    for (const auto& b : scratch_pool_) r.scratch_bytes += b.size() * sizeof(T);
    for (const auto& p : reductions_) r.scratch_bytes += p.scratch.size() * sizeof(T);
    return r;
  }

  /// Optimizer steps applied so far (skipped steps not counted).
  std::int64_t steps() const { return steps_; }
  /// Boundaries whose update was skipped (fp16 overflow or a non-finite loss/gradient).
  std::int64_t skipped_steps() const { return skipped_steps_; }
  /// Boundaries with an Inf/NaN loss or gradient norm (fp16 overflows are counted by the scaler).
  std::int64_t nonfinite_steps() const { return nonfinite_steps_; }
  /// Whether the last boundary skipped its update.
  bool last_step_skipped() const { return last_step_skipped_; }
  /// Global gradient L2 norm of the last boundary (unscaled, before clipping).
  double last_grad_norm() const { return last_grad_norm_; }
  /// Current fp16 loss scale (1 for other precisions).
  double loss_scale() const { return current_loss_scale(); }
  /// Learning rate of the last update (from the scheduler when there is one).
  double lr() const { return lr_; }
  /// The partition of unit u.
  const UnitPartition& partition(int u) const { return *unit_ref(u).partition; }
  /// Settings in effect.
  const EngineOptions& options() const { return options_; }
  /// The optimizer of unit u's slice (engines built from a config).
  optim::AnyOptimizer& optimizer(int u) { return optimizers_.at(static_cast<std::size_t>(u)); }
  /// The LR scheduler, if the config had one.
  std::optional<optim::LrScheduler>& scheduler() { return scheduler_; }
  /// The fp16 loss scaler (Precision<f16> only).
  std::optional<optim::LossScaler>& loss_scaler() { return scaler_; }
  /// The master slice of unit u this rank updates (stage 0: the whole padded unit).
  /// With NVMe offload the slice lives in its swap file and is only reachable inside
  /// for_each_master / for_each_optimizer (Error otherwise).
  std::span<MasterT> master_span(int u) {
    UnitState& s = unit(u);
    if constexpr (offload_nvme) {
      expect<Error>(s.master_in.has_value(), "Engine: the master slice of ", describe(u),
                    " is in its NVMe swap file; reach it through for_each_master");
      return *s.master_in;
    } else if constexpr (stage == 0 && same_type) {
      return std::span<MasterT>(s.values->data(), s.values->size());
    } else {
      return std::span<MasterT>(s.master.data(), s.master.size());
    }
  }
  /// First flat element of unit u's master slice (0 at stage 0).
  std::int64_t master_offset(int u) const {
    return stage == 0 ? 0 : unit_ref(u).partition->shard_begin(comm_.rank());
  }
  /// This rank and the world size.
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.size(); }
  /// Number of units of the model.
  int units() const { return static_cast<int>(units_.size()); }
  /// Parameters unit u declares.
  const std::vector<nn::ParamSpec>& unit_specs(int u) const { return unit_ref(u).specs; }
  /// Writes the master slices to the compute copies again after they were changed from
  /// outside (a checkpoint load): refreshes low-precision shards and gathered parameters.
  void refresh_from_master() {
    for (int u = 0; u < units(); ++u) write_back(u);
    regather_after_update();
  }

 private:
  struct UnitState {
    std::vector<nn::ParamSpec> specs;
    std::optional<UnitPartition> partition;
    Buffer<MasterT> master;      // owned slice (stage 0: whole); empty when values is the master
                                 // or (Offload<NVMe>) when it lives in the unit's swap file
    std::optional<std::span<MasterT>> master_in;  // Offload<NVMe>: the slice while swapped in
    Buffer<MasterT> grad_shard;  // stages 1-3: fp32 gradient of the owned slice
    Buffer<MasterT> whole_acc;   // stages 0-1 with T != MasterT: whole fp32 accumulator
    Buffer<T> gather_scratch;    // T != MasterT: the master slice rounded for an all-gather
    std::optional<Buffer<T>> values, grads;  // whole unit in compute type while gathered
    parallel::Work pending_gather;           // declared after the buffers it writes
    bool gathering = false;
    bool pinned = false;      // used by another unit: gathered from its forward to its backward
    bool persistent = false;  // small: gathered for the whole run (stage 3)
  };
  struct PendingReduction {
    int unit = 0;
    Buffer<T> scratch;    // stages 2-3: receives the reduced shard
    parallel::Work work;  // declared after the buffer it writes
  };

  void setup() {
    expect<ConfigError>(options_.gradient_accumulation_steps > 0,
                        "Engine: gradient_accumulation_steps ",
                        options_.gradient_accumulation_steps, " must be positive");
    expect<ConfigError>(options_.max_pending_reductions > 0,
                        "Engine: max_pending_reductions must be positive");
    if constexpr (loss_scaling) scaler_.emplace(options_.loss_scaler);
    const int n = model_.num_units();
    units_.resize(static_cast<std::size_t>(n));
    const int world = comm_.size(), rank = comm_.rank();
    for (int u = 0; u < n; ++u) {
      UnitState& s = unit(u);
      s.specs = model_.unit_params(u);
      s.partition.emplace(s.specs, world, options_.shard_alignment);
      const UnitPartition& p = *s.partition;
      const auto padded = static_cast<std::size_t>(p.padded_numel());
      const auto shard = static_cast<std::size_t>(p.shard_numel());
      for (int used : model_.unit_uses(u)) unit(used).pinned = true;
      s.persistent = stage < 3 || p.numel() <= options_.persistence_threshold;
      if constexpr (stage == 0) {
        // DDP: every rank holds (and initialises) the whole unit.
        Buffer<MasterT> whole(padded);
        for (int r = 0; r < world; ++r) {
          initialise_shard(s.specs, p, r,
                           whole.view().slice(p.shard_begin(r), p.shard_numel()), options_.seed);
        }
        if constexpr (same_type) {
          s.values.emplace(std::move(whole));
        } else {
          s.master = std::move(whole);
          s.values.emplace(padded);
          s.whole_acc = Buffer<MasterT>(padded);
        }
      } else {
        s.master = Buffer<MasterT>(shard);
        initialise_shard(s.specs, p, rank, s.master.view(), options_.seed);
        s.grad_shard = Buffer<MasterT>(shard);
        if (stage == 1 && !same_type) s.whole_acc = Buffer<MasterT>(padded);
      }
      if (stage < 2 && same_type) s.grads.emplace(padded);  // the accumulator itself
      if (!optimizer_spec_.type.empty()) build_optimizer(u);
    }
    if constexpr (offload_nvme) start_nvme_offload();
    for (int u = 0; u < n; ++u) write_back(u);
    regather_after_update();
    for (int u = 0; u < n; ++u) bind(u);
    synchronize();  // construction ends with every rank's parameters in place
  }

  // Offload<NVMe>: the fp32 master slice and optimizer states of every unit (one sub-group per
  // unit: master first, then the states) move to files under nvme_path; their memory is given
  // back and each step streams them through the swapper's buffer_count aligned buffers (read
  // ahead, update, write behind). Stage-3 gathers read the master slice from its file.
  void start_nvme_offload() {
    static_assert(std::is_same_v<MasterT, float>, "Offload<NVMe> swaps fp32 masters and states");
    std::vector<std::vector<offload::SwapTensor>> groups;
    for (const auto& o : optimizers_) {
      std::vector<offload::SwapTensor> g;
      g.push_back({"master", static_cast<std::int64_t>(o.numel())});
      for (const auto& name : o.state_names()) {
        g.push_back({name, static_cast<std::int64_t>(o.numel())});
      }
      groups.push_back(std::move(g));
    }
    offload::SwapperOptions so;
    so.rank = comm_.rank();
    so.faults = options_.nvme_faults;
    swapper_.emplace(*nvme_config_, std::move(groups), so);
    for (std::size_t u = 0; u < optimizers_.size(); ++u) {
      auto& o = optimizers_[u];
      UnitState& s = unit(static_cast<int>(u));
      std::vector<std::span<float>> tensors{std::span<float>(s.master.data(), s.master.size())};
      for (const auto& name : o.state_names()) tensors.push_back(o.state(name));
      swapper_->swap_out(u, std::span<const std::span<float>>(tensors));
      o.release_state_storage();
      s.master = Buffer<MasterT>();
    }
  }

  void build_optimizer(int u) {
    UnitState& s = unit(u);
    const UnitPartition& p = *s.partition;
    const auto numel = static_cast<std::size_t>(stage == 0 ? p.padded_numel() : p.shard_numel());
    std::vector<std::uint8_t> no_decay(numel, 0);
    std::vector<optim::Range> tensors;
    const int first = stage == 0 ? 0 : comm_.rank();
    const int last = stage == 0 ? comm_.size() : comm_.rank() + 1;
    for (int r = first; r < last; ++r) {
      const std::int64_t base = stage == 0 ? p.shard_begin(r) : 0;
      for (const ShardSegment& seg : p.segments(r)) {
        const auto offset = static_cast<std::size_t>(base + seg.shard_offset);
        const auto count = static_cast<std::size_t>(seg.count);
        tensors.push_back({offset, count});
        if (!s.specs[static_cast<std::size_t>(seg.param)].weight_decay) {
          std::fill_n(no_decay.begin() + static_cast<std::ptrdiff_t>(offset), count, 1);
        }
      }
    }
    expect<ConfigError>(optimizer_spec_.type != "LAMB" || stage == 0 || comm_.size() == 1,
                        "optimizer.type: LAMB's per-tensor trust ratio is not computed across "
                        "shards yet; use ZeRO stage 0 or one rank");
    optimizers_.push_back(optim::AnyOptimizer::from_config(optimizer_spec_, numel, no_decay,
                                                           std::move(tensors)));
  }

  void check_policies_against(const Config& config) const {
    const int want = config.zero_optimization.stage;
    expect<ConfigError>(want == stage, "zero_optimization.stage: the config asks for stage ", want,
                        " but this engine was built with ZeroStage<", stage,
                        "> (use zero::dispatch to pick the engine from the config)");
    const bool fp16 = config.fp16.enabled.value_or(std::is_same_v<T, f16>);
    const bool bf16 = config.bf16_enabled.value_or(std::is_same_v<T, zero::bf16>);
    expect<ConfigError>(fp16 == std::is_same_v<T, f16>, "fp16.enabled: the config says ",
                        fp16 ? "true" : "false", " but the engine computes in ", name_of(dtype_of<T>));
    expect<ConfigError>(bf16 == std::is_same_v<T, zero::bf16>, "bf16.enabled: the config says ",
                        bf16 ? "true" : "false", " but the engine computes in ",
                        name_of(dtype_of<T>));
    using O = typename policies::offload;
    const auto device = config.zero_optimization.offload_optimizer.device;
    const auto expected = std::is_same_v<O, NVMe>  ? config::OffloadDevice::nvme
                          : std::is_same_v<O, CPU> ? config::OffloadDevice::cpu
                                                   : config::OffloadDevice::none;
    // The master slice is a rank's only parameter copy at rest, so parameter offload (stage 3)
    // is the same move as optimizer offload: offload_param alone also selects Offload<NVMe>.
    const auto param_device = config.zero_optimization.offload_param.device;
    const bool param_only = device == config::OffloadDevice::none && param_device == expected &&
                            expected == config::OffloadDevice::nvme;
    expect<ConfigError>(device == expected || param_only,
                        "zero_optimization.offload_optimizer.device: the config says '",
                        config::name_of(device), "' but the engine was built with Offload<",
                        config::name_of(expected), ">");
    expect<ConfigError>(param_device == config::OffloadDevice::none || param_device == expected,
                        "zero_optimization.offload_param.device: the config says '",
                        config::name_of(param_device), "' but the engine was built with Offload<",
                        config::name_of(expected), "> (parameters go where the master goes)");
  }

  T run_forward(const MicroBatch& batch, bool training) {
    expect<Error>(!boundary_pending_ || !training,
                  "Engine::forward: the accumulation boundary was reached; call step() first");
    arena_.reset();
    ctx_ = {};
    ctx_.arena = &arena_;
    ctx_.tokens = batch.tokens;
    ctx_.targets = batch.targets;
    ctx_.batch = batch.batch;
    ctx_.seq_len = batch.seq_len;
    ctx_.training = training;
    ctx_.step = static_cast<std::uint64_t>(steps_ + skipped_steps_) *
                    static_cast<std::uint64_t>(options_.gradient_accumulation_steps) +
                static_cast<std::uint64_t>(micro_step_);
    ctx_.loss_scale = static_cast<compute_type_t<T>>(current_loss_scale() /
                                     static_cast<double>(options_.gradient_accumulation_steps));
    for (int u = 0; u < units(); ++u) {
      acquire(u, false);
      prefetch(u, +1);
      model_.forward_unit(u, ctx_);
      if constexpr (stage == 3) {
        if (!unit(u).pinned && !unit(u).persistent) release_values(u);
      }
    }
    forward_done_ = training;  // evaluate never runs between a forward and its backward
    return ctx_.loss;
  }

  UnitState& unit(int u) { return units_[static_cast<std::size_t>(u)]; }
  const UnitState& unit_ref(int u) const { return units_[static_cast<std::size_t>(u)]; }
  double current_loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }

  // Names a unit in messages: its index and first parameter.
  std::string describe(int u) const {
    const auto& specs = unit_ref(u).specs;
    return "unit " + std::to_string(u) + (specs.empty() ? "" : " (" + specs.front().name + ")");
  }
  // Waits for work, adding the engine's context (op, unit, step) to a communication failure.
  void wait(parallel::Work& work, const char* op, int u) {
    try {
      work.wait();
    } catch (const CommError& e) {
      raise<CommError>("Engine rank ", comm_.rank(), ": ", op, " of ", describe(u), " at step ",
                       steps_ + skipped_steps_, " micro-step ", micro_step_, " failed: ", e.what());
    }
  }

  // Binds unit u's views to its current buffers (grads empty while there are none).
  void bind(int u) {
    UnitState& s = unit(u);
    std::vector<nn::ParamView<T>> views;
    if (!s.values) return;
    for (int p = 0; p < s.partition->num_params(); ++p) {
      const ParamSlot& slot = s.partition->slot(p);
      const Shape& shape = s.specs[static_cast<std::size_t>(p)].shape;
      nn::ParamView<T> v;
      v.value = s.values->view().slice(slot.offset, slot.numel).reshape(shape);
      if (s.grads) v.grad = s.grads->view().slice(slot.offset, slot.numel).reshape(shape);
      views.push_back(v);
    }
    model_.bind_unit(u, views);
  }

  // The buffer the all-gather of unit u reads: the master slice itself, or (bf16/f16) the slice
  // rounded into a pooled scratch that lives until the gather finished. No low-precision copy
  // is kept between gathers, so stage 3 holds 16 psi / N at rest whatever the precision.
  // With NVMe offload the slice is copied from the swap buffer it is in (during a step) or read
  // from its file (a stage-3 gather before forward or backward) into the scratch.
  std::span<const T> gather_source(int u) {
    UnitState& s = unit(u);
    if constexpr (same_type && !offload_nvme) {
      return std::span<const T>(s.master.data(), s.master.size());
    } else {
      const auto n = static_cast<std::size_t>(s.partition->shard_numel());
      s.gather_scratch = take_scratch(n);
      T* out = s.gather_scratch.data();
      if constexpr (offload_nvme && same_type) {
        if (!s.master_in) {  // straight from the file into the scratch
          swapper_->swap_in_tensor(static_cast<std::size_t>(u), 0, std::span<float>(out, n));
          return std::span<const T>(out, n);
        }
      }
      const std::span<const MasterT> m = master_for_read(u, master_staging_);
      for (std::size_t i = 0; i < n; ++i) out[i] = convert<T>(m[i]);
      return std::span<const T>(out, n);
    }
  }
  // Unit u's master slice for reading: in place, in the swap buffer it is in, or (NVMe offload,
  // not swapped in) read from its file into staging.
  std::span<const MasterT> master_for_read(int u, std::vector<MasterT>& staging) {
    if constexpr (offload_nvme) {
      UnitState& s = unit(u);
      if (s.master_in) return *s.master_in;
      staging.resize(static_cast<std::size_t>(s.partition->shard_numel()));
      swapper_->swap_in_tensor(static_cast<std::size_t>(u), 0, std::span<float>(staging));
      return staging;
    } else {
      (void)staging;
      return master_span(u);
    }
  }
  // Binds unit u's master slice (group tensor 0) and optimizer states (the rest) to a swap
  // buffer for the life of the object.
  struct SwappedIn {
    Engine& eng;
    int u;
    SwappedIn(Engine& e, int unit_index, std::span<const std::span<float>> group)
        : eng(e), u(unit_index) {
      if constexpr (offload_nvme) {
        eng.unit(u).master_in = group[0];
        eng.optimizers_[static_cast<std::size_t>(u)].bind_state(group.subspan(1));
      } else {
        (void)group;  // only engines with a swapper swap in
      }
    }
    ~SwappedIn() {
      if constexpr (offload_nvme) {
        eng.unit(u).master_in.reset();
        eng.optimizers_[static_cast<std::size_t>(u)].bind_state({});
      }
    }
    SwappedIn(const SwappedIn&) = delete;
    SwappedIn& operator=(const SwappedIn&) = delete;
  };
  // Starts the all-gather of unit u's params into a (new, at stage 3) whole buffer.
  void start_gather(int u) {
    UnitState& s = unit(u);
    if (s.gathering) return;
    const bool fresh = !s.values;
    if (fresh) s.values.emplace(static_cast<std::size_t>(s.partition->padded_numel()));
    s.pending_gather = comm_.all_gather_async(gather_source(u), std::span<T>(s.values->data(), s.values->size()));
    s.gathering = true;
    if (fresh) bind(u);
  }
  void finish_gather(int u) {
    UnitState& s = unit(u);
    if (!s.gathering) return;
    wait(s.pending_gather, "all-gather", u);
    s.gathering = false;
    if (s.gather_scratch.size() > 0) scratch_pool_.push_back(std::move(s.gather_scratch));
  }
  // Makes unit u and the units it uses ready to run (gathered; with gradient buffers for
  // backward).
  void acquire(int u, bool with_grads) {
    auto ready = [&](int v) {
      if (!unit(v).values) start_gather(v);
      finish_gather(v);
      if (with_grads && !unit(v).grads) {
        unit(v).grads.emplace(static_cast<std::size_t>(unit(v).partition->padded_numel()));
        bind(v);
      }
    };
    ready(u);
    for (int used : model_.unit_uses(u)) ready(used);
  }
  // Stage 3: starts gathers of the units after u in direction dir, up to the prefetch budget.
  void prefetch(int u, int dir) {
    if constexpr (stage == 3) {
      std::int64_t budget = options_.prefetch_elems;
      for (int v = u + dir; v >= 0 && v < units() && budget > 0; v += dir) {
        if (unit(v).values) continue;
        budget -= unit(v).partition->padded_numel();
        start_gather(v);
      }
    } else {
      (void)u;
      (void)dir;
    }
  }
  void release_values(int u) {
    UnitState& s = unit(u);
    finish_gather(u);
    s.values.reset();
  }
  void release(int u) {
    release_values(u);
    unit(u).grads.reset();
  }

  // Unit u's backward is done, so its compute gradient is final for this micro-step: fold it
  // into the fp32 accumulator and start its reduction where the stage asks for one.
  void gradient_complete(int u, bool boundary) {
    UnitState& s = unit(u);
    if constexpr (stage <= 1) {
      if constexpr (!same_type) {  // fold into the fp32 accumulator, free the compute gradient
        MasterT* acc = s.whole_acc.data();
        const T* g = s.grads->data();
        for (std::size_t i = 0; i < s.whole_acc.size(); ++i) acc[i] += convert<MasterT>(g[i]);
        s.grads.reset();
        bind(u);
      }
      if (!boundary) return;
      PendingReduction p;
      p.unit = u;
      const std::span<MasterT> acc = whole_accumulator(u);
      if constexpr (stage == 0) {
        p.work = comm_.all_reduce_async(std::span<const MasterT>(acc), acc, parallel::ReduceOp::avg);
      } else {
        p.work = comm_.reduce_scatter_async(std::span<const MasterT>(acc),
                                            std::span<MasterT>(s.grad_shard.data(), s.grad_shard.size()),
                                            parallel::ReduceOp::avg);
      }
      push_reduction(std::move(p));
    } else {
      (void)boundary;
      PendingReduction p;
      p.unit = u;
      p.scratch = take_scratch(s.grad_shard.size());
      p.work = comm_.reduce_scatter_async(std::span<const T>(s.grads->data(), s.grads->size()),
                                          std::span<T>(p.scratch.data(), p.scratch.size()),
                                          parallel::ReduceOp::avg);
      push_reduction(std::move(p));
    }
  }
  std::span<MasterT> whole_accumulator(int u) {
    UnitState& s = unit(u);
    if constexpr (same_type) {
      return std::span<MasterT>(s.grads->data(), s.grads->size());
    } else {
      return std::span<MasterT>(s.whole_acc.data(), s.whole_acc.size());
    }
  }
  void push_reduction(PendingReduction p) {
    reductions_.push_back(std::move(p));
    while (static_cast<int>(reductions_.size()) > options_.max_pending_reductions) {
      finish_oldest_reduction();
    }
  }
  void finish_oldest_reduction() {
    PendingReduction p = std::move(reductions_.front());
    reductions_.pop_front();
    wait(p.work, stage == 0 ? "all-reduce" : "reduce-scatter", p.unit);
    if constexpr (stage >= 2) {
      UnitState& s = unit(p.unit);
      MasterT* acc = s.grad_shard.data();
      const T* r = p.scratch.data();
      for (std::size_t i = 0; i < s.grad_shard.size(); ++i) acc[i] += convert<MasterT>(r[i]);
      s.grads.reset();  // the whole gradient is released once reduced
      if constexpr (stage == 3) {
        if (s.pinned && !s.persistent) s.values.reset();  // its last user is done
      }
      if (s.values) bind(p.unit);
      scratch_pool_.push_back(std::move(p.scratch));
    }
  }
  void drain_reductions() {
    while (!reductions_.empty()) finish_oldest_reduction();
  }
  Buffer<T> take_scratch(std::size_t n) {
    for (auto it = scratch_pool_.begin(); it != scratch_pool_.end(); ++it) {
      if (it->size() == n) {
        Buffer<T> b = std::move(*it);
        scratch_pool_.erase(it);
        return b;
      }
    }
    return Buffer<T>(n);
  }

  // The gradient the update of unit u reads: stage 0 the whole (all-reduced) accumulator,
  // stages 1-3 this rank's shard.
  std::span<MasterT> update_grad(int u) {
    if constexpr (stage == 0) {
      return whole_accumulator(u);
    } else {
      return std::span<MasterT>(unit(u).grad_shard.data(), unit(u).grad_shard.size());
    }
  }
  // Sum of squares of this rank's part of the global gradient (at stage 0 every rank holds the
  // whole reduced gradient, so each counts only its own slice).
  double local_sum_sq(int u) {
    std::span<MasterT> g = update_grad(u);
    if constexpr (stage == 0) {
      const UnitPartition& p = *unit(u).partition;
      g = g.subspan(static_cast<std::size_t>(p.shard_begin(comm_.rank())),
                    static_cast<std::size_t>(p.shard_numel()));
    }
    if constexpr (std::is_same_v<MasterT, float>) {
      const optim::GradStats st = optim::grad_stats(g.data(), DType::f32, g.size());
      return st.finite ? st.sum_sq : std::numeric_limits<double>::infinity();
    } else {
      double sum = 0;
      for (MasterT v : g) sum += static_cast<double>(v) * static_cast<double>(v);
      return sum;
    }
  }
  void update_unit(int u, double factor) {
    const std::span<MasterT> param = master_span(u);
    const std::span<MasterT> grad = update_grad(u);
    if (!optimizers_.empty()) {
      optim::AnyOptimizer& opt = optimizers_[static_cast<std::size_t>(u)];
      if (scheduler_) opt.set_lr(lr_);
      lr_ = opt.lr();
      if constexpr (std::is_same_v<MasterT, float>) {
        auto io = optim::FusedIo::over(param, std::span<const float>(grad));
        io.scale_grad(static_cast<float>(factor));
        opt.step(io);
        if constexpr (!same_type && stage == 0) write_back(u);
      }
    } else {
      if (factor != 1.0) {
        for (MasterT& g : grad) g = static_cast<MasterT>(g * factor);
      }
      update_(u, param, grad);
      write_back(u);
    }
  }
  // Stage 0 in bf16/f16: refreshes the whole compute params from the whole master (stages 1-3
  // round the master slice when they gather it).
  void write_back(int u) {
    if constexpr (!same_type && stage == 0) {
      UnitState& s = unit(u);
      const std::span<MasterT> m = master_span(u);
      T* out = s.values->data();
      for (std::size_t i = 0; i < m.size(); ++i) out[i] = convert<T>(m[i]);
    } else {
      (void)u;
    }
  }
  // Stages 1-2 (and persistent units at stage 3) gather the updated params; the gathers run
  // while later units update and are waited for when a unit is next used.
  void regather_after_update() {
    if constexpr (stage >= 1) {
      for (int u = 0; u < units(); ++u) {
        UnitState& s = unit(u);
        if (s.persistent) {
          start_gather(u);
        } else if (s.values) {  // stage 3: a stale gathered copy (evaluate left it) is dropped
          release(u);
        }
      }
    }
  }
  void clear_accumulators() {
    for (int u = 0; u < units(); ++u) {
      UnitState& s = unit(u);
      auto zero = [](auto* p, std::size_t n) {
        for (std::size_t i = 0; i < n; ++i) p[i] = {};
      };
      zero(s.grad_shard.data(), s.grad_shard.size());
      zero(s.whole_acc.data(), s.whole_acc.size());
      if (stage < 2 && same_type) zero(s.grads->data(), s.grads->size());
    }
  }
  void finish_window() {
    micro_step_ = 0;
    boundary_pending_ = false;
    nonfinite_in_window_ = 0;
  }

  M& model_;
  parallel::AnyComm comm_;
  EngineOptions options_;
  UpdateFn update_;
  NamedParams optimizer_spec_;
  std::vector<optim::AnyOptimizer> optimizers_;
  std::optional<offload::NvmeConfig> nvme_config_;
  std::optional<offload::NvmeSwapper> swapper_;  // Offload<NVMe>: the optimizer states' files
  std::string broken_;  // why the state is inconsistent (see broken_reason); empty when whole
  std::vector<MasterT> master_staging_;  // Offload<NVMe>, bf16/f16: a slice read for a gather
  std::optional<optim::LrScheduler> scheduler_;
  std::optional<optim::LossScaler> scaler_;
  Arena<Host> arena_;
  std::vector<UnitState> units_;
  std::vector<Buffer<T>> scratch_pool_;
  std::deque<PendingReduction> reductions_;  // after the buffers its work writes into
  nn::StepContext<T> ctx_;
  int micro_step_ = 0;
  bool boundary_pending_ = false;
  bool forward_done_ = false;
  bool last_step_skipped_ = false;
  std::int64_t nonfinite_in_window_ = 0;
  std::int64_t steps_ = 0, skipped_steps_ = 0, nonfinite_steps_ = 0;
  double last_grad_norm_ = 0.0;
  double lr_ = 0.0;
};

}  // namespace zero::engine

namespace zero {
/// zero::Engine<Model, Policies...> (see zero::engine::Engine).
template <nn::Model M, class... Policies>
using Engine = engine::Engine<M, Policies...>;
}  // namespace zero
