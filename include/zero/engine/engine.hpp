#pragma once
// Engine<Model, Policies...>: data-parallel training of any nn::Model with ZeRO stage 0-3 over a
// data-parallel communicator (type-erased to AnyComm, so one instantiation per policy set).
// This header is the flow: forward, backward and step, written once for every stage, precision,
// offload target and device. The pieces it composes, each in its own header:
//
//   StageTraits<S>      (stage_traits.hpp)      what the stage means, as named facts
//   unit_buffer_plan    (unit_storage.hpp)      which buffers a unit has, and UnitState
//   backend_t<Device>   (backend.hpp)           buffers, streams, the flow's own kernels
//   state_store_t       (state_store.hpp,       where master slices and optimizer states live
//                        nvme_state_store.hpp)   (memory, or NVMe swap files)
//   UnitExchange        (unit_exchange.hpp)     gathers, prefetch, gradient reductions
//   MicroSteps          (micro_step.hpp)        the accumulation window, the unit context
//   TrainingState       (training_state.hpp)    counters, LR scheduler, loss scaler
//   EngineState         (engine_state.hpp)      the view checkpoints and weight tools use
//   engine_config.hpp                           config vs policies, optimizers from the config
//
// The fp32 (f64) master slice is the source of truth, initialised slice by slice. Every rank
// issues the same collectives in the same order because units run in a static order; gradients
// are averaged over ranks and micro-steps, so the result equals one process on the global batch.
// bf16/f16 units compute on parameters a gather rounds from the master (no low-precision copy
// between steps), gradients accumulate in fp32, and an Inf/NaN anywhere (fp16 overflow) is seen
// by every rank through the global-norm all-reduce, so every rank skips the same steps.
// forward_units/backward_units run a contiguous range of units (a pipeline stage's slice).

#include <algorithm>
#include <any>
#include <cmath>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <optim/any_optimizer.hpp>
#include <optim/grad_norm.hpp>
#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/comm/text_collectives.hpp>
#include <parallel/process_groups.hpp>
#include <zero/config/config.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/worker_thread.hpp>
#include <zero/engine/backend.hpp>
#include <zero/engine/engine_checkpoint.hpp>
#include <zero/engine/engine_config.hpp>
#include <zero/engine/engine_groups.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/engine_policies.hpp>
#include <zero/engine/engine_state.hpp>
#include <zero/engine/host_value_comm.hpp>
#include <zero/engine/memory_estimator.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/engine/micro_step.hpp>
#include <zero/engine/model_memory_estimate.hpp>
#include <zero/engine/nvme_state_store.hpp>
#include <zero/engine/partition.hpp>
#include <zero/engine/stage_traits.hpp>
#include <zero/engine/training_state.hpp>
#include <zero/engine/unit_exchange.hpp>
#include <zero/engine/unit_storage.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/model.hpp>
#include <zero/offload/preflight.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/profile/step_timers.hpp>

namespace zero::engine {

template <nn::Model M, class... Policies>
class Engine {
 public:
  using policies = EnginePolicies<M, Policies...>;
  using model_type = M;                            ///< the model this engine trains
  using T = typename M::value_type;                ///< compute element type
  using MasterT = typename policies::master_type;  ///< master / accumulator element type
  static constexpr int stage = policies::stage;
  using stage_traits = StageTraits<stage>;
  using backend_type = backend_t<typename policies::compute>;
  /// The compute type is the master type (f32, or f64 reference models): no rounded copies.
  static constexpr bool compute_is_master = std::is_same_v<T, MasterT>;
  static constexpr bool loss_scaling = std::is_same_v<T, f16>;
  static constexpr bool offload_nvme = std::is_same_v<typename policies::offload, NVMe>;
  /// ZeRO-Offload: master slices, optimizer states and gradient shards in pinned host memory,
  /// updated by the host optimizer (a device backend only).
  static constexpr bool offload_cpu = std::is_same_v<typename policies::offload, CPU>;
  /// The backend runs the built-in optimizers' passes on its device (a fused executor): where
  /// Offload<CPU> keeps some units on the device (EngineOptions::offload_ratio), their updates
  /// run there.
  static constexpr bool has_fused_executor = requires(const backend_type& b) {
    b.fused_executor();
  };
  /// The optimizer's states live in the backend's memory beside the master slices, and its fused
  /// passes run on the backend's executor (a device backend without offload: the GPU's AdamW,
  /// SGD, ... kernels). Host backends run them on the host's threads.
  static constexpr bool device_optimizer =
      std::is_same_v<typename policies::offload, None> && has_fused_executor;
  /// The host reads the master slices and optimizer states where they live (host memory, or
  /// pinned host memory under Offload<CPU>); else checkpoints and weight tools stage them
  /// through host copies (EngineState).
  static constexpr bool host_reads_states =
      backend_type::Device::kind == DeviceKind::host || offload_cpu;
  /// Updates a master slice from its gradient (already averaged, unscaled and clipped):
  /// (unit, master, grad). Stage 0 passes the whole padded unit, stages 1-3 this rank's shard.
  using UpdateFn = std::function<void(int, std::span<MasterT>, std::span<const MasterT>)>;

 private:
  using Unit = UnitState<T, MasterT, backend_type, offload_cpu, device_optimizer>;
  using Store = state_store_t<typename policies::offload, Unit>;
  using Exchange = UnitExchange<M, Unit, Store, backend_type, stage>;
  friend class EngineState<Engine>;

 public:
  /// The master slices are always in memory (false: offloaded to files).
  static constexpr bool states_in_memory = Store::in_memory;

  /// An engine whose update is a callback (any optimizer, or an f64 reference SGD), sharding
  /// over comm (the data-parallel group).
  template <parallel::Communicator C>
  Engine(M& model, C& comm, UpdateFn update, EngineOptions options = {})
      : Engine(model, EngineGroups(comm), std::move(update), options) {}

  /// An engine configured from a DeepSpeed JSON config (accumulation, clipping, fp16 scaler,
  /// stage-3 buckets, the optimizer, the LR scheduler, NVMe offload, and comm_timeout_s, which
  /// becomes comm's deadline when the config sets it), sharding over comm. The config's stage,
  /// precision and offload must agree with the policies (ConfigError otherwise).
  template <parallel::Communicator C>
  Engine(M& model, C& comm, const Config& config, EngineOptions options = {})
      : Engine(model, EngineGroups(apply_comm_timeout(config, comm)), config, options) {}

  /// The engines above, sharding over the grid's data-parallel group (dp, or dp x cp with
  /// context parallelism); the model keeps its own tensor, pipeline, expert and sequence groups.
  /// With tensor parallelism (grid tp > 1) the gradient norm and checkpoints also span the
  /// tensor-parallel group (EngineGroups).
  template <parallel::Communicator C, class Update>
  Engine(M& model, parallel::ProcessGroups<C>& groups, Update&& update_or_config,
         EngineOptions options = {})
      : Engine(model, EngineGroups(apply_comm_timeout(update_or_config, groups)),
               std::forward<Update>(update_or_config), options) {}

  /// An engine over explicit groups, with an update callback.
  Engine(M& model, EngineGroups groups, UpdateFn update, EngineOptions options = {})
      : model_(model),
        groups_(std::move(groups)),
        options_(options),
        update_(std::move(update)),
        micro_(options_.activation_bytes, options_.gradient_accumulation_steps, arena_maker(),
               layer_kernels_.get(), options_.seed) {
    static_assert(!offload_nvme,
                  "zero::Engine: Offload<NVMe> swaps the states of an optimizer built from the "
                  "config; construct the engine from a Config");
    setup({});
  }

  /// An engine over explicit groups, configured from a DeepSpeed JSON config.
  Engine(M& model, EngineGroups groups, const Config& config, EngineOptions options = {})
      : model_(model),
        groups_(std::move(groups)),
        options_(options.with_config(config, groups_.sample_ranks)),
        micro_(options_.activation_bytes, options_.gradient_accumulation_steps, arena_maker(),
               layer_kernels_.get(), options_.seed) {
    static_assert(!policies::reference_model,
                  "zero::Engine: an optimizer from the config updates fp32 masters; an f64 "
                  "reference model takes an UpdateFn");
    check_config_against_policies<T, typename policies::offload, typename policies::compute>(config,
                                                                                             stage);
    expect<ConfigError>(config.optimizer.has_value(),
                        "optimizer: required to build an Engine from a config");
    optimizer_spec_ = *config.optimizer;
    // CPU offload met on the host as it stands: every state is in host memory, so none is kept
    // on a device, whatever the config's offload_optimizer.ratio.
    if (offload_cpu_already_host<typename policies::offload, typename policies::compute>(config)) {
      options_.offload_ratio = 1.0;
    }
    StoreOptions store_options;
    if constexpr (offload_nvme) store_options.nvme = nvme_settings(config);
    setup(store_options);
    const double lr = optimizer_spec_.get("lr", optimizers_.empty() ? 1e-3 : optimizers_[0].lr());
    training_.scheduler = scheduler_from_config(config, lr);
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- the flow ------------------------------------------------------------------------------

  /// Forward through every unit; returns this rank's mean loss of the micro-batch (unscaled).
  T forward(const MicroBatch& batch) {
    forward_units({0, num_units()}, batch);
    return loss();
  }
  /// Forward without dropout and without a backward to follow (evaluation, generation: with
  /// null targets only the logits are computed, readable from the model until the next forward).
  T evaluate(const MicroBatch& batch) {
    evaluate_pass({0, num_units()}, batch);
    return loss();
  }
  /// Backward through every unit. A unit's gradient is complete once its own backward ran (its
  /// users run before it in reverse order); it is then reduced asynchronously (every micro-step
  /// at stages 2-3, on the boundary micro-step at stages 0-1) while the next unit computes.
  void backward() {
    communicating("backward", [&] {
      expect<Error>(micro_.forward_done(), "Engine::backward: call forward first");
      backward_units({0, num_units()});
    });
  }

  /// Runs the forward of units [r.first, r.last) of this micro-batch. input, when given, is the
  /// activation entering unit r.first (it must live until that unit's backward); a range that
  /// starts at unit 0 starts the micro-step (unit 0 of a GPT reads the tokens). Ranges must
  /// follow each other in order. Returns the activation leaving unit r.last - 1 (valid until
  /// the next forward; after the last unit read loss()).
  Tensor<T> forward_units(UnitRange r, const MicroBatch& batch, Tensor<T> input = {}) {
    return communicating("forward", [&]() -> Tensor<T> {
      micro_.check_forward(r, num_units());
      expect_consistent("forward");
      const auto timed = timers_.phase(profile::Phase::forward);
      if (r.first == 0) timers_.count_micro_step();
      try {
        if (r.first == 0) begin_micro_step(batch, true);
        if (input.data() != nullptr) micro_.ctx().x = input;
        run_forward(r);
      } catch (...) {
        abandon_forward();
        throw;
      }
      return micro_.ctx().x;
    });
  }
  /// Runs the backward of units [r.first, r.last): dy, when given, is the gradient arriving at
  /// unit r.last - 1's output (the last unit seeds it from the loss). Ranges must come down in
  /// order after the whole forward. Returns the gradient at unit r.first's input (valid until
  /// the next backward; empty past unit 0, whose backward ends the micro-step).
  Tensor<T> backward_units(UnitRange r, Tensor<T> dy = {}) {
    return communicating("backward", [&]() -> Tensor<T> {
      micro_.check_backward(r, num_units());
      apply_deferred_updates();  // the folds below overwrite the gradients it reads
      const auto timed = timers_.phase(profile::Phase::backward);
      const bool boundary = micro_.at_boundary();
      try {
        run_backward(r, dy, [&](int u) { exchange_.gradient_complete(u, boundary); });
        const Tensor<T> dx = micro_.ctx().dx;
        if (!micro_.backward_ran(r)) return dx;
        exchange_.drain_reductions();  // the micro-step ends with every reduction done
      } catch (const std::exception& e) {
        abandon_backward(e.what());
        throw;
      }
      return {};
    });
  }

  // ---- pipeline passes -------------------------------------------------------------------------
  // A pipeline stage runs micro-batches through its ranges in the order of its schedule: a pass
  // is one micro-batch (its index in the window given) through one range, forward then backward.
  // When the schedule runs other passes before this one's backward, the executor parks it
  // (park_pass: its activations stay in their own arena, the units' saved state moves into the
  // ParkedPass) and resumes it before the backward. A model that cannot park (nn::ParksPasses,
  // parks(r)) has the pass discarded and started again from the same input just before the
  // backward instead (the same dropout masks: they follow the micro-batch index). Each unit's
  // gradient is reduced after its own last pass of the window.

  /// Runs the forward of micro-batch `micro` (0 <= micro < gradient_accumulation_steps) through
  /// units r: input, when given, enters unit r.first (it must live until the pass's backward).
  /// Returns the activation leaving unit r.last - 1 (valid until the next pass; after the last
  /// unit read loss()).
  Tensor<T> forward_pass(UnitRange r, int micro, const MicroBatch& batch, Tensor<T> input = {}) {
    return communicating("forward_pass", [&]() -> Tensor<T> {
      micro_.check_pass(r, micro, num_units());
      expect_consistent("forward_pass");
      const auto timed = timers_.phase(profile::Phase::forward);
      micro_.begin_pass(batch, rng_step_of(micro, batch), micro_loss_scale(), r, num_units());
      run_pass_forward(r, input);
      return micro_.ctx().x;
    });
  }
  /// Runs the backward of the pass in flight: dy, when given, is the gradient at its last
  /// unit's output (the model's last unit seeds it from the loss). Returns the gradient at its
  /// first unit's input (valid until the next pass).
  Tensor<T> backward_pass(Tensor<T> dy = {}) {
    return communicating("backward_pass", [&]() -> Tensor<T> {
      (void)micro_.pass_in_flight("backward_pass");  // refused before anything ran
      apply_deferred_updates();
      const auto timed = timers_.phase(profile::Phase::backward);
      try {
        const UnitRange r = pass_backward("backward_pass", dy, [&](int u) {
          exchange_.gradient_complete(u, micro_.pass_at_boundary(u));
        });
        if (micro_.weight_pass_ran(r, num_units())) exchange_.drain_reductions();
      } catch (const std::exception& e) {
        abandon_backward(e.what());
        throw;
      }
      return micro_.ctx().dx;
    });
  }
  /// The input half of the backward of the pass in flight (zero-bubble schedules): as
  /// backward_pass, but layers that can leave their weight-gradient GEMMs in `deferred` (with
  /// copies of what they read, nn/deferred_weight_grads.hpp), so the gradient at the pass's
  /// input is ready sooner. The units' gradients are complete, and reduced, only after
  /// weight_pass ran `deferred`. Returns the gradient at the pass's first unit's input.
  Tensor<T> backward_input_pass(Tensor<T> dy, nn::DeferredWeightGrads<T>& deferred) {
    static_assert(!stage_traits::shards_grads,
                  "Engine::backward_input_pass: a split backward keeps whole gradients until "
                  "its weight half ran; ZeRO stages 2-3 reduce them after every pass");
    return communicating("backward_input_pass", [&]() -> Tensor<T> {
      expect<Error>(deferred.empty(),
                    "Engine::backward_input_pass: the deferred weight "
                    "gradients given still hold ",
                    deferred.size(),
                    " products of an earlier pass; run its weight_pass first (or clear() it "
                    "when a failure ended that pass's window)");
      (void)micro_.pass_in_flight("backward_input_pass");  // refused before anything ran
      apply_deferred_updates();
      const auto timed = timers_.phase(profile::Phase::backward);
      // Only this backward reads it: every pass (and micro-step) starts from a fresh context.
      micro_.ctx().weight_grads = &deferred;
      try {
        (void)pass_backward("backward_input_pass", dy, [](int) {});
      } catch (const std::exception& e) {
        deferred.clear();  // its products aim at gradients the abandoned window clears
        abandon_backward(e.what());
        throw;
      }
      micro_.ctx().weight_grads = nullptr;
      return micro_.ctx().dx;
    });
  }
  /// The weight half of the split backward over units r that left `deferred`: computes its
  /// products, after which each unit's gradient is complete and reduced after its last pass of
  /// the window, as backward_pass does. Weight halves of one range run in the order of their
  /// input halves.
  void weight_pass(UnitRange r, nn::DeferredWeightGrads<T>& deferred) {
    communicating("weight_pass", [&] {
      micro_.check_weight_pass(r, num_units());
      const auto timed = timers_.phase(profile::Phase::backward);
      try {
        deferred.run();
        for (int u = r.last - 1; u >= r.first; --u) {
          // A later pass's input half may have run already, accumulating into u's gradient
          // buffer and leaving products aimed at it: fold that buffer only once no such pass is
          // left.
          if (micro_.weight_passes_outstanding(u) == 1) {
            exchange_.gradient_complete(u, micro_.pass_at_boundary(u));
          }
        }
        if (micro_.weight_pass_ran(r, num_units())) exchange_.drain_reductions();
      } catch (const std::exception& e) {
        deferred.clear();
        abandon_backward(e.what());
        throw;
      }
    });
  }
  /// Forward without dropout through units r, input entering unit r.first (a pipeline stage's
  /// part of an evaluation: no backward follows). Returns the activation leaving unit
  /// r.last - 1 (valid until the next forward; after the last unit read loss(), and the model's
  /// logits).
  Tensor<T> evaluate_pass(UnitRange r, const MicroBatch& batch, Tensor<T> input = {}) {
    return communicating("evaluate", [&]() -> Tensor<T> {
      expect<Error>(micro_.idle(),
                    "Engine::evaluate: a training forward is waiting for its backward; evaluating "
                    "now would overwrite what that backward needs");
      expect_consistent("evaluate");
      micro_.begin_pass(batch, 0, 1.0, r, num_units(), /*training=*/false);
      run_pass_forward(r, input);
      discard_pass();
      // hpZ: no backward follows these gathers, so the secondary shards they kept go (a pass
      // parked before gathers its units again from the master slices).
      exchange_.forget_secondaries();
      // No step follows to agree on reads that failed: the evaluation's loss may hold zeros.
      // Pipeline stages evaluate one after another, so a pipeline agrees once all have run.
      if (!groups_.pp) agree_on_reads("evaluate");
      return micro_.ctx().x;
    });
  }
  /// Offload<NVMe>: a collective over every rank of the engine (dp, tp and pp) that raises on
  /// each, as a step does, when a gather since the last step or agreement went on with zeros
  /// for a master slice its rank could not read from its swap file; nothing otherwise (and no
  /// collective with the states in memory). evaluate_pass agrees by itself without pipeline
  /// parallelism; with it, the pipeline's evaluation calls this once every stage ran its passes
  /// (a stage raising alone would leave the next one waiting for its activations).
  void agree_on_reads(std::string_view what) {
    if constexpr (!states_in_memory) {
      communicating(what, [&] {
        double failed = static_cast<double>(exchange_.failed_reads());
        sum_host_values(comm_, std::span<double>(&failed, 1));
        if (groups_.tp) sum_host_values(*groups_.tp, std::span<double>(&failed, 1));
        if (groups_.pp) sum_host_values(*groups_.pp, std::span<double>(&failed, 1));
        if (failed > 0) raise_failed_reads(what, /*at_boundary=*/false);
      });
    } else {
      (void)what;
    }
  }
  /// True when the model can park a pass through units r (nn::ParksPasses and every unit of r
  /// parks): park_pass and resume_pass may then be used for them.
  bool parks(UnitRange r) const {
    if constexpr (nn::ParksPasses<M>) {
      for (int u = r.first; u < r.last; ++u) {
        if (!model_.parks_unit(u)) return false;
      }
      return true;
    } else {
      (void)r;
      return false;
    }
  }
  /// Sets the pass in flight aside after its forward, keeping its activations (see the comment
  /// above); another pass may start. Error unless parks() holds for its range.
  ParkedPass<T> park_pass() {
    const UnitRange r = micro_.pass_in_flight("park_pass");
    expect<Error>(parks(r), "Engine::park_pass: units [", r.first, ", ", r.last,
                  ") cannot park (a layer does not implement Layer::park); discard_pass and run "
                  "the forward again instead");
    std::vector<std::any> units;
    if constexpr (nn::ParksPasses<M>) {
      for (int u = r.first; u < r.last; ++u) units.push_back(model_.park_unit(u));
    }
    ParkedPass<T> parked = micro_.park(std::move(units));
    // As discard_pass: the backward gathers again. Waiting for reductions communicates, so a
    // CommError here makes later calls fail fast, as in every other call.
    recording_comm_failure([&] { release_gathered(); });
    return parked;
  }
  /// Makes a parked pass the pass in flight again, for its backward (no pass may be in flight).
  void resume_pass(ParkedPass<T>&& parked) {
    const UnitRange r = parked.range();
    std::vector<std::any> units = micro_.resume(std::move(parked));
    if constexpr (nn::ParksPasses<M>) {
      for (int u = r.first; u < r.last; ++u) {
        model_.resume_unit(u, std::move(units[static_cast<std::size_t>(u - r.first)]));
      }
    }
  }
  /// Drops the pass in flight without running its backward (see the comment above).
  void discard_pass() {
    micro_.discard_pass();
    recording_comm_failure([&] { release_gathered(); });
  }

  /// At the accumulation boundary: global norm (all ranks), skip on Inf/NaN, clip, update every
  /// slice, re-gather (stages 1-3). Returns false (and does nothing) between boundaries, true at
  /// a boundary whether the update was applied or skipped (see last_step_skipped()).
  bool step() {
    return communicating("step", [&]() -> bool {
      if (!micro_.boundary_pending()) return false;
      if (!inconsistent_.empty()) abandon_window();  // between steps, so a load can recover
      expect_consistent("step");
      // The step's host time includes the wait for a delayed update (below).
      const auto timed = timers_.phase(profile::Phase::step);
      apply_deferred_updates();
      // delayed_param_update: waits for the last step's update (its slices go up below).
      try {
        finish_delayed_update();
      } catch (const std::exception&) {
        clear_accumulators();
        finish_window();  // between steps again, so a checkpoint can be loaded
        throw;
      }
      const int n = num_units();
      exchange_.drain_reductions();
      for (int u = 0; u < num_units(); ++u) start_unfolded_gradient(u);
      // Offload<CPU>: the norm and the host optimizer read gradient shards the device's kernels
      // wrote.
      if constexpr (offload_cpu) backend_.host_waits_for_compute();
      // One all-reduce carries the sum of squares, the count of non-finite losses and, reading
      // states from files, the count of gathers that went on without a master slice their rank
      // could not read (a second one adds up the tensor-parallel ranks' parts).
      constexpr std::size_t n_stats = states_in_memory ? 2 : 3;
      double stats[3] = {0.0, static_cast<double>(micro_.nonfinite_losses()),
                         static_cast<double>(exchange_.failed_reads())};
      stats[0] = local_sum_of_squares();
      sum_host_values(comm_, std::span<double>(stats, n_stats));
      if (groups_.tp) sum_host_values(*groups_.tp, std::span<double>(stats, n_stats));
      if (groups_.pp) sum_host_values(*groups_.pp, std::span<double>(stats, n_stats));
      if (stats[2] > 0) raise_failed_reads("step", /*at_boundary=*/true);
      // The last delayed update's slices go up to the device now, after the host's wait for
      // compute above, so that wait does not include their copies (nor, below fp32, does this
      // step's update, which writes the other compute copy: start_delayed_update).
      if (std::exchange(delayed_regather_, false)) publish_delayed_update();
      const double scale = training_.loss_scale();
      last_grad_norm_ = std::sqrt(stats[0]) / scale;
      const bool nonfinite = stats[1] > 0 || !std::isfinite(last_grad_norm_);
      bool apply = !nonfinite;
      // LoCo: a step that is not applied drops its gradients, and with them what the errors
      // kept from their packings stand for (a raise or a skip alike).
      if (nonfinite) exchange_.forget_kept_errors();
      // nonfinite_policy raise: an Inf/NaN loss raises in every precision (under fp16 too: no
      // smaller loss scale mends a forward), an Inf/NaN gradient norm where no loss scaler
      // skips it. A boundary that raises counts as skipped, so the next window draws new
      // dropout masks.
      const bool raises = loss_scaling ? stats[1] > 0 : nonfinite;
      if (raises && options_.nonfinite == NonFinitePolicy::raise) {
        ++training_.nonfinite_steps;
        ++training_.skipped_steps;
        clear_accumulators();
        finish_window();
        raise<NonFiniteError>(
            "Engine: step ", training_.steps, ": ",
            stats[1] > 0 ? "the loss was Inf/NaN on some rank" : "the gradient norm is Inf/NaN",
            " (nonfinite_policy is raise)");
      }
      // The scaler before this boundary's update: a delayed update that cannot start leaves the
      // window for a retry (start_delayed_update), whose own scaler update must not count twice.
      std::optional<optim::LossScaler> scaler_before;
      if constexpr (loss_scaling) {
        scaler_before = training_.scaler;
        try {
          apply = training_.scaler->update(nonfinite);  // DeepSpeed: an fp16 overflow is a skip
        } catch (const std::exception&) {
          // LossScaleError at the minimum scale: the step is over (skipped, as the scaler
          // counted it) on every rank, so the engine is between steps again and a checkpoint
          // can be loaded.
          ++training_.skipped_steps;
          clear_accumulators();
          finish_window();
          throw;
        }
      } else if (nonfinite) {
        ++training_.nonfinite_steps;
      }
      last_step_skipped_ = !apply;
      // LoCo: the kept errors are in the loss scale's units; a new scale starts them anew (at
      // most once a loss_scale_window of applied steps, or at an overflow, forgotten above).
      if (training_.loss_scale() != scale) exchange_.forget_kept_errors();
      bool delayed = false;  // the update runs on its own thread (delayed_param_update)
      if (apply) {
        const double factor =
            optim::clip_coefficient(last_grad_norm_, options_.gradient_clipping) / scale;
        if (training_.scheduler) training_.lr = training_.scheduler->lr();
        set_update_lr();
        if (delays_update()) {
          try {
            start_delayed_update(factor);
          } catch (...) {
            if (scaler_before) training_.scaler = scaler_before;
            throw;
          }
          delayed = true;
        } else if (defers_update()) {
          // The next forward applies the offloaded units' updates unit by unit, each just before
          // the unit's gather; the units kept on the device (offload_ratio) update now.
          if (keeps_units_on_device()) update_all_units(factor, UnitsToUpdate::kept_on_device);
          DeferredUpdate d{factor, std::vector<char>(static_cast<std::size_t>(n), 0), 0};
          for (int u = 0; u < n; ++u) {
            if (unit(u).offloaded()) {
              ++d.left;
            } else {
              d.done[static_cast<std::size_t>(u)] = 1;
            }
          }
          if (d.left > 0) deferred_.emplace(std::move(d));
        } else {
          update_all_units(factor);
        }
        if (training_.scheduler) training_.scheduler->step();
        ++training_.steps;
      } else {
        ++training_.skipped_steps;
      }
      clear_accumulators();
      // hpZ: the next backward gathers from the shards its own forward keeps.
      exchange_.forget_secondaries();
      if (apply && !deferred_ && !delayed) {
        exchange_.regather_after_update();
      } else if (apply) {
        // The offloaded units' updates come later (and regather then); the units kept on the
        // device updated above.
        exchange_.regather_after_update([this](int u) { return !unit(u).offloaded(); });
      }
      finish_window();
      return true;
    });
  }

  // ---- state: checkpoints, weights ------------------------------------------------------------

  /// Saves a checkpoint as <dir>/<tag> (a collective, atomic; `latest` then names it): the
  /// master slices, optimizer states, counters, scheduler and loss scaler, plus client_state
  /// (the program's own JSON, e.g. its data loader position). Call between steps.
  checkpoint::SaveResult save_checkpoint(const std::filesystem::path& dir, std::string_view tag,
                                         const nlohmann::json& client_state = {}) {
    return communicating("save_checkpoint", [&] {
      apply_deferred_updates();
      finish_delayed_update();
      return save_engine_checkpoint(*this, dir, tag, client_state);
    });
  }
  /// Loads <dir>/<tag> (`latest` when tag is empty), saved at any world size and stage; returns
  /// the client_state saved with it.
  nlohmann::json load_checkpoint(const std::filesystem::path& dir, std::string_view tag = {}) {
    return communicating("load_checkpoint", [&] {
      apply_deferred_updates();  // the load replaces what it would write
      // A delayed update that failed is what a load recovers from: its error stays the state's
      // broken_reason() until the load below succeeds, rather than stopping this call.
      try {
        finish_delayed_update();
      } catch (const std::exception&) {
      }
      nlohmann::json client_state = load_engine_checkpoint(*this, dir, tag);
      exchange_.forget_kept_errors();  // LoCo's errors are not saved: a loaded run starts anew
      return client_state;
    });
  }
  /// The view of this engine's state that checkpoint and weight tools use.
  EngineState<Engine> state() {
    apply_deferred_updates_for("state");
    return EngineState<Engine>(*this);
  }

  /// True between optimizer steps (no micro-step of an accumulation window done yet).
  bool between_steps() const { return micro_.between_steps(); }
  /// Empty while the engine's state is whole; otherwise the error of the step or load that
  /// stopped part-way (an I/O failure of Offload<NVMe>). Until a checkpoint is loaded, forward,
  /// evaluate, step and save_checkpoint then raise Error naming it.
  const std::string& broken_reason() const { return inconsistent_; }
  /// Empty while the communicator works; otherwise the CommError (a deadline, a departed rank)
  /// that stopped a collective. The communicator cannot be used again (MPI cannot cancel a
  /// collective, and the ranks stopped at different points), so every later call that
  /// communicates raises a CommError naming it instead of hanging: restart the job from the
  /// last checkpoint, at any world size.
  const std::string& comm_failure() const { return comm_failure_; }

  /// Applies the host updates a step left to the next forward (Offload<CPU>), waits for the
  /// update in flight (delayed_param_update: its slices are gathered at the next step, so the
  /// run goes on as without the call) and for every collective the engine still has in flight
  /// (the parameter gathers a step leaves running for the next forward).
  void synchronize() {
    communicating("synchronize", [&] {
      apply_deferred_updates();
      finish_delayed_update();
      exchange_.synchronize();
    });
  }

  /// Sums values (host doubles, as many on every rank) over the data-parallel group, in place (a
  /// collective): a program's own statistics, such as its mean loss, go through here rather than
  /// comm(), because a device engine's communicator may move device memory only (they travel
  /// through a buffer of the units' memory: HostValueComm).
  void sum_over_data_parallel(std::span<double> values) {
    communicating("sum_over_data_parallel", [&] { sum_host_values(comm_, values); });
  }

  /// The whole flat parameters of unit u from the master (a collective; f64/f32 values).
  std::vector<MasterT> gather_unit_values(int u) {
    return communicating("gather_unit_values", [&]() -> std::vector<MasterT> {
      apply_deferred_updates();
      finish_delayed_update();
      Unit& s = unit(u);
      const auto numel = static_cast<std::size_t>(s.partition->numel());
      // Read and gathered in the units' memory (the communicator's), then copied to the host.
      const std::size_t n =
          s.numel(stage_traits::shards_optimizer_states ? Extent::shard : Extent::whole);
      auto read = backend_.template make_buffer<MasterT>(n);
      // From swap files a read may fail on this rank alone: the gather below still runs, with
      // zeros in its place, and then every rank raises.
      std::exception_ptr failed;
      std::string why;
      try {
        store_.read_master_into(u, std::span<MasterT>(read.data(), n), backend_);
      } catch (const IoError& e) {
        if (states_in_memory || !stage_traits::shards_optimizer_states) throw;
        failed = std::current_exception();
        why = e.what();
        backend_.clear(std::span<MasterT>(read.data(), n));
      }
      if constexpr (stage_traits::shards_optimizer_states) {
        auto whole = backend_.template make_buffer<MasterT>(s.numel(Extent::whole));
        backend_.comm_waits_for_compute();
        s.group->all_gather(std::span<const MasterT>(read.data(), n),
                            std::span<MasterT>(whole.data(), whole.size()));
        backend_.compute_waits_for_comm();
        if constexpr (!states_in_memory) {
          const std::string mine =
              failed ? zero::detail::concat("rank ", s.group->rank(), ": ", why) : "";
          auto group = host_values(*s.group);
          const std::string first = parallel::first_nonempty_text(group, mine);
          if (failed) std::rethrow_exception(failed);
          expect<Error>(first.empty(), "Engine::gather_unit_values: unit ", u,
                        "'s master slice could not be read from its swap file on ", first);
        }
        read = std::move(whole);
      }
      std::vector<MasterT> mine(read.size());
      backend_.copy_to_host(std::span<MasterT>(mine),
                            std::span<const MasterT>(read.data(), mine.size()));
      mine.resize(numel);
      return mine;
    });
  }

  /// The memory estimator's figures for this engine's layout, per rank: its units' padded
  /// sizes, each over the group it is sharded over (an expert unit over the expert data-parallel
  /// group), at this stage, precision, optimizer, offload and options. Built before allocating,
  /// its device_peak() is what a device backend's free memory is checked against; at rest it
  /// equals memory_report()'s model states.
  MemoryEstimate memory_estimate() const { return estimate_model_states(memory_estimate_input()); }

  /// Bytes of model state held by this rank right now, by category.
  MemoryReport memory_report() const {
    MemoryReport r;
    for (const Unit& s : units_) s.report(r);
    for (std::size_t u = 0; u < optimizers_.size(); ++u) {
      const std::size_t bytes = optimizers_[u].state_bytes();
      r.optimizer_bytes += bytes;
      if (units_[u].offloaded()) r.host_bytes += bytes;  // the host optimizer's states
    }
    store_.report(r);
    exchange_.report(r);
    return r;
  }
  /// Stage 3: the most unit elements gathered at once so far (bounded by the prefetch window and
  /// stage3_max_live_parameters, beyond the units a forward or backward needs at once).
  std::int64_t peak_gathered_elems() const { return exchange_.peak_gathered_elems(); }
  /// Offload<NVMe>: where the gathers' master slices came from (read ahead by the prefetch,
  /// handed over or kept by the step's pass, or read from the swap file when the gather started)
  /// and the time waited for reads, since the engine was made. All zero for the other stores.
  offload::TensorReadStats nvme_read_stats() const { return store_.read_stats(); }
  /// Highest bytes the activation arena held in any micro-step so far (its high-water mark).
  std::size_t activation_peak_bytes() const { return micro_.activation_peak_bytes(); }
  /// The buffers each unit has under this engine's policies (what memory_report sums); a unit
  /// that keeps its states on the device under Offload<CPU> has those of the plan without
  /// offload instead (unit_offloaded).
  const std::vector<BufferPlan>& buffer_plan() const { return plan_; }
  /// Offload<CPU>: whether unit u's master slice, optimizer states and gradient shard are in host
  /// memory, updated by the host, rather than kept on the device (EngineOptions::offload_ratio
  /// below 1 keeps the last units there). false without Offload<CPU>.
  bool unit_offloaded(int u) const { return unit_ref(u).offloaded(); }

  /// The wall-clock accumulators of forward, backward, step, the communication waits and each
  /// unit (off until enabled; zero::profile reads them).
  profile::StepTimers& timers() { return timers_; }
  /// Read-only view of timers().
  const profile::StepTimers& timers() const { return timers_; }

  // ---- queries -------------------------------------------------------------------------------

  /// Optimizer steps applied so far (skipped steps not counted).
  std::int64_t steps() const { return training_.steps; }
  /// Boundaries whose update was skipped (fp16 overflow or a non-finite loss/gradient).
  std::int64_t skipped_steps() const { return training_.skipped_steps; }
  /// Boundaries with an Inf/NaN loss or gradient norm (fp16 overflows are counted by the scaler).
  std::int64_t nonfinite_steps() const { return training_.nonfinite_steps; }
  /// Whether the last boundary skipped its update.
  bool last_step_skipped() const { return last_step_skipped_; }
  /// Global gradient L2 norm of the last boundary (unscaled, before clipping).
  double last_grad_norm() const { return last_grad_norm_; }
  /// Current fp16 loss scale (1 for other precisions).
  double loss_scale() const { return training_.loss_scale(); }
  /// Learning rate of the last update (from the scheduler when there is one).
  double lr() const { return training_.lr; }
  /// This rank's mean loss of the last forward that reached the last unit.
  T loss() const { return micro_.ctx().loss; }
  /// The weighted auxiliary losses (an MoE router's) the units of the last forward or pass
  /// reported. The loss layer adds them to loss() on the pass that computes it; a pipeline stage
  /// without the loss holds its blocks' share here.
  compute_type_t<T> aux_loss() const { return micro_.ctx().aux_loss; }
  /// The partition of unit u.
  const UnitPartition& partition(int u) const { return *unit_ref(u).partition; }
  /// This rank in the group unit u is sharded over (the data-parallel group, or the expert
  /// data-parallel group for an expert unit; EngineGroups::shard_group).
  int unit_rank(int u) const { return unit_ref(u).group->rank(); }
  /// This rank among the ranks holding the same shards of unit u under hybrid sharding
  /// (EngineOptions::shard_size; EngineGroups::replica_group), 0 without it: replica 0 counts
  /// the shard in the gradient norm and saves it in checkpoints.
  int unit_replica_rank(int u) const {
    const parallel::AnyComm* r = unit_ref(u).replicas;
    return r == nullptr ? 0 : r->rank();
  }
  /// Settings in effect.
  const EngineOptions& options() const { return options_; }
  /// True when the engine was built from a config (it owns optimizers).
  bool has_optimizer() const { return !optimizers_.empty(); }
  /// The optimizer of unit u's slice (engines built from a config). Its states live where the
  /// engine keeps them: on a device engine without Offload<CPU>, state(name) spans device memory
  /// (copy it with the backend before reading it on the host).
  optim::AnyOptimizer& optimizer(int u) {
    apply_deferred_updates_for("optimizer");
    return optimizers_.at(static_cast<std::size_t>(u));
  }
  /// Offload<CPU> with overlap_offload_update: units whose part of the last step's update the
  /// next forward (or whatever reads the state first) has yet to apply; 0 otherwise.
  int deferred_updates() const { return deferred_ ? deferred_->left : 0; }
  /// delayed_param_update: a step's host update is running on its own thread (until the next
  /// step, or whatever reads the state, waits for it).
  bool update_in_flight() const { return delayed_update_.valid(); }
  /// The LR scheduler, if the config had one.
  std::optional<optim::LrScheduler>& scheduler() { return training_.scheduler; }
  /// The fp16 loss scaler (Precision<f16> only).
  std::optional<optim::LossScaler>& loss_scaler() { return training_.scaler; }
  /// The data-parallel communicator (type-erased).
  parallel::AnyComm& comm() { return comm_; }
  /// The communicators the engine works over (data, tensor parallel, state).
  EngineGroups& groups() { return groups_; }
  /// This rank in the data-parallel group, and the group's size.
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.size(); }
  /// Number of units of the model.
  int num_units() const { return static_cast<int>(units_.size()); }
  /// Parameters unit u declares.
  const std::vector<nn::ParamSpec>& unit_specs(int u) const { return unit_ref(u).specs; }
  /// True when unit u is a replica of a unit another pipeline stage owns (tied weights; the
  /// model's unit_is_replica): left out of the gradient norm and of checkpoints.
  bool unit_is_replica(int u) const { return unit_ref(u).replica; }
  /// This rank's reduced gradient of unit u while a boundary is pending (the whole unit at
  /// stage 0, this rank's shard at stage 1), unscaled by the clip: a pipeline adds the gradients
  /// of tied replicas into it before step().
  std::span<MasterT> boundary_gradient(int u) {
    expect<Error>(micro_.boundary_pending(),
                  "Engine::boundary_gradient: no accumulation boundary is pending");
    static_assert(!stage_traits::shards_grads,
                  "Engine::boundary_gradient: stages 2-3 reduce gradients as they are produced");
    communicating("boundary_gradient", [&] { exchange_.drain_reductions(); });
    start_unfolded_gradient(u);
    return update_grad(u);
  }

 private:
  // ---- setup ---------------------------------------------------------------------------------

  void setup(const StoreOptions& store_options) {
    groups_.expect_one_device_stream();
    backend_.use_comm_stream(comm_.device_stream());
    if constexpr (backend_type::Device::kind != DeviceKind::host && !offload_cpu &&
                  !device_optimizer) {
      expect<ConfigError>(optimizer_spec_.type.empty(), "Engine: optimizer.type '",
                          optimizer_spec_.type,
                          "' runs on the host, so on a device without a fused executor its master "
                          "slices and states must be in host memory: use Offload<CPU> "
                          "(zero_optimization.offload_optimizer.device \"cpu\"), or an update "
                          "callback that runs on the device");
    }
    if constexpr (device_optimizer) {
      expect<ConfigError>(optimizer_spec_.type != "LAMB",
                          "Engine: optimizer.type 'LAMB' sums its trust-ratio norms on the host, "
                          "so it has no device pass: on a device use Adam, AdamW, SGD, Lion, "
                          "RMSprop or Adagrad, or LAMB with Offload<CPU> "
                          "(zero_optimization.offload_optimizer.device \"cpu\")");
    }
    expect<ConfigError>(options_.gradient_accumulation_steps > 0,
                        "Engine: gradient_accumulation_steps ",
                        options_.gradient_accumulation_steps, " must be positive");
    expect<ConfigError>(options_.max_pending_reductions > 0,
                        "Engine: max_pending_reductions must be positive");
    if (options_.delayed_param_update) {
      expect<ConfigError>(offload_cpu,
                          "Engine: delayed_param_update overlaps the host optimizer of "
                          "Offload<CPU> with the device's next window; this engine has no "
                          "Offload<CPU> (zero_optimization.offload_optimizer.device \"cpu\")");
      expect<ConfigError>(stage >= 1 && (stage <= 2 || !compute_is_master),
                          "Engine: delayed_param_update needs ZeRO stage 1 or 2, or stage 3 "
                          "below fp32, not stage ",
                          stage, " in ", name_of(dtype_of<T>),
                          " (in f32 a stage-3 gather reads the master slice the update writes)");
      expect<ConfigError>(!options_.overlap_offload_update,
                          "Engine: delayed_param_update and overlap_offload_update both move "
                          "the host update out of step(); choose one");
      expect<ConfigError>(options_.delayed_update_after >= 0, "Engine: delayed_update_after ",
                          options_.delayed_update_after, " must not be negative");
    }
    check_offload_ratio();
    expect<ConfigError>(
        !options_.accumulate_grads_on_device || (offload_cpu && stage >= 2),
        "Engine: accumulate_grads_on_device sums the reduced gradient shards of "
        "Offload<CPU> at ZeRO stages 2-3 on the device; this engine is stage ",
        stage,
        offload_cpu ? " (stage 1 sums its whole gradient there already)" : " without Offload<CPU>");
    if constexpr (loss_scaling) training_.scaler.emplace(options_.loss_scaler);
    if constexpr (requires { model_.tensor_parallel().size(); }) {
      const int model_tp = model_.tensor_parallel().size();
      expect<ConfigError>(model_tp == 1 || model_tp == groups_.tp_size(),
                          "Engine: the model is split over a tensor-parallel group of ",
                          model_.tensor_parallel().size(),
                          " ranks but the engine's groups have tp = ", groups_.tp_size(),
                          " (build the engine from the ProcessGroups the model's group came from)");
    }
    plan_ = unit_buffer_plan({stage, sizeof(T), sizeof(MasterT), compute_is_master,
                              offload_device_of<typename policies::offload>,
                              options_.delayed_param_update, options_.accumulate_grads_on_device});
    // offload_ratio: the units kept on the device have the buffers of an engine without offload.
    kept_plan_ = unit_buffer_plan(
        {stage, sizeof(T), sizeof(MasterT), compute_is_master, OffloadDevice::none, false, false});
    if constexpr (requires { model_.sequence_parallel().size(); }) {
      // A model split over sp ranks whose engine averages without them lets the copies drift;
      // a cp grid whose model attends locally trains on the wrong attention.
      expect<ConfigError>(model_.sequence_parallel().size() == groups_.cp,
                          "Engine: the model splits its sequences over a sequence-parallel group "
                          "of ",
                          model_.sequence_parallel().size(),
                          " ranks but the engine's groups have cp = ", groups_.cp,
                          " (build the model's SequenceParallel from the cp group of the "
                          "ProcessGroups the engine is built from)");
    }
    if constexpr (requires { model_.expert_parallel().size(); }) {
      expect<ConfigError>(model_.expert_parallel().size() == groups_.ep,
                          "Engine: the model's experts are split over an expert-parallel group of ",
                          model_.expert_parallel().size(),
                          " ranks but the engine's groups have ep = ", groups_.ep,
                          " (build the engine from the ProcessGroups the model's group came from)");
    }
    // Before the groups are split: every rank must split with the same shard_size.
    check_options_agree();
    if (options_.shard_size > 0) {
      expect<ConfigError>(stage >= 1,
                          "Engine: shard_size (hybrid sharding, zero_optimization."
                          "mics_shard_size) shards states over part of the data-parallel group; "
                          "ZeRO stage 0 shards nothing: use stage 1, 2 or 3");
      groups_.shard_within(options_.shard_size);
    }
    if (options_.hpz_size > 1) {
      expect<ConfigError>(stage == 3,
                          "Engine: hpz_size (ZeRO++ hierarchical partitioning, "
                          "zero_optimization.zero_hpz_partition_size) keeps secondary shards for "
                          "stage 3's backward gathers; stage ",
                          stage, " gathers no parameters per pass: use stage 3");
      expect<ConfigError>(options_.shard_size == 0,
                          "Engine: hpz_size (ZeRO++ hpZ) and shard_size (hybrid sharding, "
                          "mics_shard_size) both keep gathers inside groups of ranks; set one");
      // qgZ's exchange takes two hops then: inside each secondary group, then across them.
      groups_.secondary_within(options_.hpz_size, options_.quantized_gradients);
    }
    expect<ConfigError>(!options_.quantized_weights || stage == 3,
                        "Engine: quantized_weights (ZeRO++ qwZ, zero_optimization."
                        "zero_quantized_weights) quantizes stage 3's parameter gathers; stage ",
                        stage, " gathers no parameters per pass: use stage 3");
    expect<ConfigError>(!options_.quantized_gradients || stage >= 2,
                        "Engine: quantized_gradients (ZeRO++ qgZ, zero_optimization."
                        "zero_quantized_gradients) quantizes the reduce-scatter of each "
                        "micro-step's gradients at stages 2-3; stage ",
                        stage,
                        " reduces the fp32 accumulator at the window's end: use stage 2 or 3");
    expect<ConfigError>(
        options_.quantized_gradient_bits == 8 || options_.quantized_gradient_bits == 4,
        "Engine: quantized_gradient_bits (zero_optimization.zero_quantized_gradient_bits) is ",
        options_.quantized_gradient_bits, "; qgZ packs gradients in 8 or 4 bits a code");
    if (options_.loco) {
      expect<ConfigError>(options_.quantized_gradients,
                          "Engine: loco (ZeRO++ LoCo, zero_optimization.zeropp_loco_param) feeds "
                          "back the errors of qgZ's packings; quantized_gradients is off");
      expect<ConfigError>(options_.loco_err_beta >= 0.0f && options_.loco_err_beta < 1.0f,
                          "Engine: loco_err_beta (zeropp_loco_param.err_beta) is ",
                          options_.loco_err_beta, "; it must be in [0, 1)");
      expect<ConfigError>(options_.loco_reset_interval >= 1,
                          "Engine: loco_reset_interval (zeropp_loco_param.reset_T) is ",
                          options_.loco_reset_interval, "; it must be at least 1");
    }
    const int n = model_.num_units();
    units_.resize(static_cast<std::size_t>(n));
    std::set<std::string, std::less<>> names;
    for (int u = 0; u < n; ++u) {
      Unit& s = unit(u);
      s.specs = model_.unit_params(u);
      for (const nn::ParamSpec& p : s.specs) check_param_name(u, p.name, names);
      bool expert = false;
      if constexpr (nn::HasExpertUnits<M>) expert = model_.unit_is_expert(u);
      // With experts split over ep, a parameter split over ep (ParamSpec::expert_split) is an
      // expert's and an expert unit holds nothing else: a model that does not say which units
      // hold its experts (a SequentialModel with a split MixtureOfExperts) would have different
      // experts' values averaged and sharded as one tensor.
      for (const nn::ParamSpec& p : s.specs) {
        if (groups_.ep == 1 || p.expert_split.is_split() == expert) continue;
        raise<ConfigError>(
            "Engine: unit ", u, "'s parameter '", p.name, "' ",
            expert ? "is not split over the expert-parallel group, but its unit is an expert unit "
                     "(sharded and averaged over the expert data-parallel group only): keep "
                     "dense parameters out of expert units"
                   : "is split (the experts over the expert-parallel group of " +
                         std::to_string(groups_.ep) +
                         " ranks), but the model does not say its unit holds experts "
                         "(nn::HasExpertUnits: unit_is_expert), so the engine would average "
                         "different experts' values as one tensor");
      }
      s.group = &groups_.shard_group(expert);
      s.replicas = groups_.replica_group(expert);
      s.secondary_group = groups_.secondary_group(expert);
      s.across_secondary = groups_.across_secondary_group(expert);
      // Averaged over its group (and its replicas), a gradient is divided by the whole
      // data-parallel size.
      const int averaged = s.group->size() * (s.replicas ? s.replicas->size() : 1);
      s.grad_scale = static_cast<double>(averaged) / static_cast<double>(comm_.size());
      s.partition.emplace(s.specs, s.group->size(), options_.shard_alignment);
      for (int used : model_.unit_uses(u)) {
        // A unit read by a later one: its gradient must be complete (the reader's backward ran
        // first) before its own backward reduces it.
        expect<ConfigError>(0 <= used && used < u, "Engine: unit ", u, " reads unit ", used,
                            " (unit_uses); a unit may only read the parameters of units before "
                            "it, in [0, ",
                            u, ")");
        unit(used).pinned = true;
      }
      s.persistent = stage_traits::holds_whole_params ||
                     s.partition->numel() <= options_.persistence_threshold;
      if constexpr (requires { model_.unit_is_replica(u); }) s.replica = model_.unit_is_replica(u);
    }
    check_expert_placement();
    if constexpr (offload_cpu) {
      const std::vector<bool> kept = units_kept_on_device(shard_elems(), options_.offload_ratio);
      for (int u = 0; u < n; ++u) unit(u).states_on_device = kept[static_cast<std::size_t>(u)];
    }
    check_device_memory();  // before the first allocation
    for (int u = 0; u < n; ++u) {
      Unit& s = unit(u);
      const int rank = s.group->rank();
      const UnitPartition& p = *s.partition;
      for (const BufferPlan& b : s.offloaded() || !offload_cpu ? plan_ : kept_plan_) {
        if (b.lifetime == Lifetime::at_rest) s.allocate(b, backend_);
      }
      s.initialise_master(!stage_traits::shards_optimizer_states, rank, options_.seed, backend_);
      if (!optimizer_spec_.type.empty()) {
        if (sums_whole_norms(u)) check_whole_norms_schedule();
        optimizers_.push_back(unit_optimizer(optimizer_spec_, s.specs, p,
                                             !stage_traits::shards_optimizer_states, rank));
        if constexpr (device_optimizer) {
          s.adopt_optimizer_states(optimizers_.back(), backend_);
        } else if constexpr (offload_cpu && has_fused_executor) {
          // A unit kept on the device: its update runs on the device's executor.
          if (s.states_on_device) s.adopt_optimizer_states(optimizers_.back(), backend_);
        }
      }
    }
    StoreOptions so = store_options;
    // Swap files are named after a rank no other holder of state shares: with tp or pp several
    // ranks have the same dp rank.
    so.rank = groups_.state_group().rank();
    so.faults = options_.nvme_faults;
    // Stage 3 reading ahead: the step's pass leaves the first units' slices to the next forward.
    so.hand_over_masters = stage_traits::gathers_before_use && options_.nvme_read_ahead;
    store_.settle(so);
    masters_replaced();
    exchange_.set_timers(&timers_);
    if constexpr (offload_cpu) {
      exchange_.set_before_gather([this](int u) { apply_deferred_update(u); });
    }
    for (int u = 0; u < n; ++u) exchange_.bind(u);
    synchronize();  // construction ends with every rank's parameters in place
  }

  // Sums a few host values (the step's statistics) over group: in place where the units'
  // memory is host memory, else through a buffer of the units' memory, the only memory a device
  // communicator moves.
  void sum_host_values(parallel::AnyComm& group, std::span<double> values) {
    host_values(group).all_reduce(values, parallel::ReduceOp::sum);
  }
  // The collectives on host values over group (staged through the backend's memory where the
  // communicator cannot read the host's).
  HostValueComm<backend_type> host_values(parallel::AnyComm& group) { return {group, backend_}; }
  // Activation arenas from the backend, in the memory its kernels compute on.
  ArenaMaker arena_maker() {
    return [this](std::size_t bytes) { return backend_.make_arena(bytes, "engine activations"); };
  }
  // The memory estimator's input for this engine's units (their padded sizes, each over its
  // own shard group), stage, precision, optimizer and options; model_estimate_input
  // (model_memory_estimate.hpp) counts a model's units before an engine exists the same way.
  MemoryEstimateInput memory_estimate_input() const {
    MemoryEstimateInput in;
    in.stage = stage;
    for (const Unit& s : units_) {
      in.add_unit(s.partition->padded_numel(), s.group->size(), s.persistent,
                  s.secondary_group != nullptr ? s.secondary_group->size() : 0, s.states_on_device);
      in.kept_error_bytes +=
          static_cast<double>(exchange_.kept_error_bytes(static_cast<int>(&s - units_.data())));
    }
    in.gpus_per_node = comm_.size();
    in.precision = dtype_of<T>;
    in.master = dtype_of<MasterT>;
    in.optimizer_state_bytes = optimizer_state_bytes(optimizer_spec_);
    in.offload_optimizer = offload_device_of<typename policies::offload>;
    apply_options(in, options_, static_cast<int>(units_.size()));
    return in;
  }
  // The step's update pass over every unit's slice. In memory, the gather of an updated slice
  // starts at once and overlaps the next units' updates. Offloaded to files, a failed read or
  // write may be one rank's alone: the ranks agree on the outcome before any gather starts, so a
  // failure on one rank raises on every rank (the one that failed rethrows its own error) instead
  // of leaving the others waiting in gathers it never starts. Either way a failure leaves some
  // slices updated and others not, and an offloaded group maybe half written: the engine refuses
  // to train on or save this state (a save would replace a good checkpoint) until a load.
  // Offload<CPU> updates the units kept on the device (offload_ratio) first; `which` kept_on_device
  // updates those alone (the offloaded ones' update is deferred or delayed).
  enum class UnitsToUpdate { all, kept_on_device };
  // Offload<CPU>: whether offload_ratio keeps any unit's states on the device.
  bool keeps_units_on_device() const {
    return std::any_of(units_.begin(), units_.end(), [](const Unit& s) { return !s.offloaded(); });
  }
  void update_all_units(double factor, UnitsToUpdate which = UnitsToUpdate::all) {
    std::exception_ptr failed;
    std::string why;
    // One pass over the units `wanted` names.
    const auto update_pass = [&](auto&& wanted) {
      store_.for_each_unit(
          StateAccess::update,
          [&](int u) {
            if (!wanted(u)) return;
            update_unit(u, factor);
            if constexpr (stage_traits::regathers_after_update) {
              // The units regather_after_update gathers: in memory at once; from files after the
              // ranks agreed, from the slice kept here rather than a second read.
              if (unit(u).persistent) {
                if constexpr (states_in_memory) {
                  exchange_.start_gather(u);
                } else {
                  store_.keep_for_gather(u, backend_);
                }
              }
            }
          },
          /*step=*/true);
    };
    try {
      if constexpr (offload_cpu) {
        // The units kept on the device first (offload_ratio): their updates and gathers are
        // queued on the device, which runs them while the host updates the offloaded units.
        update_pass([&](int u) { return !unit(u).offloaded(); });
        if (which == UnitsToUpdate::all) update_pass([&](int u) { return unit(u).offloaded(); });
      } else {
        (void)which;
        update_pass([](int) { return true; });
      }
    } catch (const std::exception& e) {
      failed = std::current_exception();
      why = e.what();
    }
    if constexpr (!states_in_memory) {
      const std::string mine =
          failed ? zero::detail::concat("rank ", groups_.state_group().rank(), ": ", why) : "";
      inconsistent_ = "an offloaded update did not finish";  // the agreement itself may fail
      std::string first;
      try {
        auto comm = state().state_comm();
        first = parallel::first_nonempty_text(comm, mine);
      } catch (const std::exception&) {
        if (!failed) throw;  // the agreement's own failure; this rank's update went through
        first = mine;
      }
      if (first.empty()) {
        inconsistent_.clear();
        return;
      }
      inconsistent_ = "the step's offloaded update failed on " + first;
      clear_accumulators();
      finish_window();  // between steps again, so a checkpoint can be loaded
      if (failed) std::rethrow_exception(failed);
      raise<Error>("Engine::step: ", inconsistent_,
                   "; this rank's slices are updated and that rank's maybe not: load a checkpoint "
                   "on every rank before training on or saving");
    } else if (failed) {
      inconsistent_ = why;
      clear_accumulators();
      finish_window();
      std::rethrow_exception(failed);
    }
  }
  // A parameter's name keys its tensor in checkpoints, where "<name>/<state>" keys its optimizer
  // states: a name must be non-empty, hold no '/', and be the model's only one.
  static void check_param_name(int u, const std::string& name,
                               std::set<std::string, std::less<>>& seen) {
    expect<ConfigError>(!name.empty() && name.find('/') == std::string::npos, "Engine: unit ", u,
                        "'s parameter '", name,
                        "': a parameter name must be non-empty and hold no '/' (checkpoints key "
                        "a parameter's optimizer states as '<name>/<state>')");
    expect<ConfigError>(seen.insert(name).second, "Engine: unit ", u, "'s parameter '", name,
                        "' has the name of another parameter of the model; give each its own");
  }
  // With experts split over ep ranks, the ranks that shard and average an expert unit (the
  // expert data-parallel group) must hold the same experts, i.e. the same rank of the model's
  // expert group: a model split over another group of ep ranks (the dp group) passes the size
  // check but would have different experts averaged as one tensor. Collective over that group,
  // with one verdict.
  void check_expert_placement() {
    if constexpr (requires { model_.expert_parallel().rank(); }) {
      if (groups_.ep == 1) return;
      parallel::AnyComm& g = *groups_.expert_dp;
      std::vector<double> held(static_cast<std::size_t>(g.size()), 0.0);
      const double mine = model_.expert_parallel().rank();
      held[static_cast<std::size_t>(g.rank())] = mine;
      sum_host_values(g, held);
      for (std::size_t r = 0; r < held.size(); ++r) {
        expect<ConfigError>(held[r] == mine, "Engine: this rank holds the experts of rank ", mine,
                            " of the model's expert-parallel group, but rank ", r,
                            " of its expert data-parallel group holds those of rank ", held[r],
                            ": the model's experts are split over another group than the "
                            "engine's ep axis (build the model's ExpertParallel from the ep group "
                            "of the ProcessGroups the engine is built from)");
      }
    }
  }
  // The options every rank of the engine must share, compared before anything is allocated: a
  // seed that differs gives stage 0's replicas (and a tensor-parallel rank's part) other
  // initial values, which the averaged updates never bring together (DeepSpeed broadcasts rank
  // 0's parameters instead); a differing accumulation, shard alignment, persistence threshold or
  // prefetch mismatches the collectives until their deadline; a differing clipping or loss
  // scaler updates the replicas apart. Collective over every rank of the engine.
  void check_options_agree() {
    const double mine[] = {
        static_cast<double>(options_.seed >> 32), static_cast<double>(options_.seed & 0xffffffffu),
        static_cast<double>(options_.gradient_accumulation_steps), options_.gradient_clipping,
        static_cast<double>(options_.shard_alignment),
        // Each rank splits its groups by it.
        static_cast<double>(options_.shard_size), static_cast<double>(options_.hpz_size),
        options_.quantized_weights ? 1.0 : 0.0, options_.quantized_gradients ? 1.0 : 0.0,
        static_cast<double>(options_.quantized_gradient_bits), options_.loco ? 1.0 : 0.0,
        static_cast<double>(options_.loco_err_beta),
        static_cast<double>(options_.loco_reset_interval),
        static_cast<double>(options_.persistence_threshold),
        // Stage 3's prefetch orders the gathers among the reductions; a
        // differing one interleaves the collectives differently.
        static_cast<double>(options_.prefetch_elems), static_cast<double>(options_.max_live_elems),
        // One rank raising where the others skip leaves them waiting.
        static_cast<double>(options_.nonfinite),
        // Each rank scales its own loss: the averaged gradients would mix
        // scales and each rank unscale them by its own.
        options_.loss_scaler.loss_scale,
        static_cast<double>(options_.loss_scaler.initial_scale_power),
        static_cast<double>(options_.loss_scaler.loss_scale_window),
        static_cast<double>(options_.loss_scaler.hysteresis),
        options_.loss_scaler.consecutive_hysteresis ? 1.0 : 0.0,
        options_.loss_scaler.min_loss_scale,
        static_cast<double>(options_.loss_scaler.max_overflows_at_min_scale)};
    static constexpr const char* names[] = {"seed",
                                            "seed",
                                            "gradient_accumulation_steps",
                                            "gradient_clipping",
                                            "shard_alignment",
                                            "shard_size",
                                            "hpz_size",
                                            "quantized_weights",
                                            "quantized_gradients",
                                            "quantized_gradient_bits",
                                            "loco",
                                            "loco_err_beta",
                                            "loco_reset_interval",
                                            "persistence_threshold",
                                            "prefetch_elems",
                                            "max_live_elems",
                                            "nonfinite",
                                            "loss_scaler.loss_scale",
                                            "loss_scaler.initial_scale_power",
                                            "loss_scaler.loss_scale_window",
                                            "loss_scaler.hysteresis",
                                            "loss_scaler.consecutive_hysteresis",
                                            "loss_scaler.min_loss_scale",
                                            "loss_scaler.max_overflows_at_min_scale"};
    static_assert(std::size(names) == std::size(mine));
    constexpr std::size_t k = std::size(mine);
    parallel::AnyComm& all = groups_.state_group();
    std::vector<double> every(k * static_cast<std::size_t>(all.size()), 0.0);
    const std::size_t me = static_cast<std::size_t>(all.rank());
    std::copy(std::begin(mine), std::end(mine),
              every.begin() + static_cast<std::ptrdiff_t>(me * k));
    sum_host_values(all, every);
    const auto text = [&](std::size_t r, std::size_t i) -> std::string {
      const double* v = every.data() + r * k;
      if (i <= 1) {
        return std::to_string((static_cast<std::uint64_t>(v[0]) << 32) |
                              static_cast<std::uint64_t>(v[1]));
      }
      if (std::isfinite(v[i]) && v[i] == std::floor(v[i]) && std::fabs(v[i]) < 0x1p53) {
        return std::to_string(static_cast<std::int64_t>(v[i]));  // counts, not 1.04858e+06
      }
      return zero::detail::concat(v[i]);
    };
    for (std::size_t r = 0; r < static_cast<std::size_t>(all.size()); ++r) {
      for (std::size_t i = 0; i < k; ++i) {
        const double theirs = every[r * k + i];
        const bool same = theirs == mine[i] || (std::isnan(theirs) && std::isnan(mine[i]));
        expect<ConfigError>(same, "Engine rank ", me, ": EngineOptions::", names[i], " is ",
                            text(me, i), " here but ", text(r, i), " on rank ", r,
                            "; every rank of an engine must pass the same");
      }
    }
  }
  // Offload<CPU>'s offload_ratio (Twin-Flow): in (0, 1], and below 1 only where the units kept
  // on the device can run their update there.
  void check_offload_ratio() const {
    const double ratio = options_.offload_ratio;
    expect<ConfigError>(ratio > 0.0 && ratio <= 1.0, "Engine: offload_ratio ",
                        "(zero_optimization.offload_optimizer.ratio) is ", ratio,
                        "; it must be in (0, 1]: the fraction of the states offloaded");
    if (ratio == 1.0) return;
    expect<ConfigError>(offload_cpu, "Engine: offload_ratio ", ratio,
                        " (zero_optimization.offload_optimizer.ratio) keeps part of Offload<CPU>'s "
                        "states on the device; this engine has no Offload<CPU> "
                        "(zero_optimization.offload_optimizer.device \"cpu\")");
    if (optimizer_spec_.type.empty()) return;  // an update callback runs where the values are
    if constexpr (has_fused_executor) {
      expect<ConfigError>(optimizer_spec_.type != "LAMB", "Engine: offload_ratio ", ratio,
                          " keeps units' states on the device, and optimizer.type 'LAMB' has no "
                          "device pass (it sums its trust-ratio norms on the host); use ratio 1");
    } else {
      expect<ConfigError>(backend_type::Device::kind == DeviceKind::host, "Engine: offload_ratio ",
                          ratio,
                          " keeps units' states on the device, but this backend has no "
                          "fused executor to run optimizer.type '",
                          optimizer_spec_.type, "' there; use ratio 1");
    }
  }
  // Each unit's share of this rank's sharded states, in elements: its shard.
  std::vector<std::int64_t> shard_elems() const {
    std::vector<std::int64_t> out;
    for (const Unit& s : units_) out.push_back(s.partition->shard_numel());
    return out;
  }
  // Throws OutOfMemoryError, before anything is allocated, when the backend reports less free
  // device memory than this layout's model states need on the ranks that compute on the device:
  // the memory estimator's figure (memory_estimator.hpp) for these units, this stage, precision,
  // optimizer and world, at rest plus the units gathered at once and the gradients pending
  // reductions hold, times the ranks of the job on the same device (CudaLocalComm's threads
  // share one). Collective, with one verdict: every rank throws when any rank lacks memory,
  // rather than the others allocating and then waiting for it in a collective. Backends that
  // report nothing (the host) are not checked.
  void check_device_memory() {
    const std::optional<std::size_t> free = backend_.free_device_bytes();
    if (!free) return;
    const MemoryEstimateInput in = memory_estimate_input();
    // A rank without parameters (a pipeline stage of none) needs nothing but still joins the
    // collectives below, which the others wait in.
    const MemoryEstimate e = in.params > 0 ? estimate_model_states(in) : MemoryEstimate{};
    // The ranks on this device: equal identities, counted over every rank of the engine (tensor
    // and pipeline ranks too), which also share the verdict.
    parallel::AnyComm& all = groups_.state_group();
    std::vector<double> devices(static_cast<std::size_t>(all.size()), 0.0);
    const auto me = static_cast<std::size_t>(all.rank());
    devices[me] = static_cast<double>(backend_.device_identity());
    sum_host_values(all, devices);
    const auto sharing = std::count(devices.begin(), devices.end(), devices[me]);
    const double need = e.device_peak() * static_cast<double>(sharing);
    std::vector<double> short_of(devices.size(), 0.0);
    short_of[me] = need <= static_cast<double>(*free) ? 0.0 : 1.0;
    sum_host_values(all, short_of);
    const auto bytes = [](double b) { return offload::human_bytes(static_cast<std::uint64_t>(b)); };
    const std::string per_device =
        sharing > 1
            ? zero::detail::concat(", times the ", sharing, " ranks on this device: ", bytes(need))
            : std::string();
    expect<OutOfMemoryError>(
        short_of[me] == 0.0, "Engine rank ", all.rank(), ": the model states need ",
        bytes(e.device_peak()), " of device memory a rank (", in.params,
        " parameters at ZeRO stage ", stage, " over ", comm_.size(),
        " ranks: ", bytes(e.device_at_rest), " at rest + ", bytes(e.device_working),
        " for the units gathered at once and the gradients pending reductions hold; the memory "
        "estimator's figure",
        per_device, ") but the device has ", bytes(static_cast<double>(*free)),
        " free; use a higher ZeRO stage, more ranks, Offload<CPU> or a smaller model");
    std::string lacking;
    for (std::size_t r = 0; r < short_of.size(); ++r) {
      if (short_of[r] != 0.0) lacking += zero::detail::concat(lacking.empty() ? "" : ", ", r);
    }
    expect<OutOfMemoryError>(lacking.empty(), "Engine rank ", all.rank(), ": ranks [", lacking,
                             "] have too little free device memory for this layout (their "
                             "errors give the figures); no rank allocates");
  }

  // ---- forward and backward ------------------------------------------------------------------

  // Dropout masks follow the run's seed and the micro-step's index over the whole run (every
  // context micro_ starts carries options_.seed), or the optimizer step and the rows' global
  // index (MicroBatch::first_row); the loss seed averages over the window (and carries the fp16
  // scale).
  void begin_micro_step(const MicroBatch& batch, bool training) {
    micro_.begin(batch, training, rng_step_of(micro_.done(), batch), micro_loss_scale(),
                 num_units());
  }
  // The dropout step of micro-batch `micro` of this window: the optimizer step when the batch
  // says where its rows sit in the step's global batch (its rows then tell the micro-batches
  // apart, as in one process on the whole batch), else the micro-step counted over the run.
  std::uint64_t rng_step_of(int micro, const MicroBatch& batch) const {
    const auto step = static_cast<std::uint64_t>(training_.boundaries());
    if (batch.first_row >= 0) return step;
    return step * static_cast<std::uint64_t>(options_.gradient_accumulation_steps) +
           static_cast<std::uint64_t>(micro);
  }
  // The loss seed of one micro-batch: the (fp16) loss scale averaged over the window.
  double micro_loss_scale() const {
    return training_.loss_scale() / static_cast<double>(options_.gradient_accumulation_steps);
  }
  void run_forward(UnitRange r) {
    for (int u = r.first; u < r.last; ++u) forward_unit(u);
    micro_.forward_ran(r);
  }
  // The forward of the pass just begun through units r, input (when given) entering unit
  // r.first. A failure drops the pass as if it had not begun (its place in the window given
  // back), as a forward's micro-step is: no backward may run over units whose forward did not.
  void run_pass_forward(UnitRange r, Tensor<T> input) {
    if (input.data() != nullptr) micro_.ctx().x = input;
    try {
      for (int u = r.first; u < r.last; ++u) forward_unit(u);
    } catch (...) {
      micro_.abandon_pass();
      abandon_forward();
      throw;
    }
  }
  void forward_unit(int u) {
    exchange_.acquire(u, false);
    exchange_.prefetch(u, +1, /*backward_follows=*/micro_.ctx().training);
    {
      const auto unit_timed = timers_.unit(profile::Phase::forward, u, micro_.ctx().training);
      model_.forward_unit(u, micro_.ctx());
    }
    exchange_.release_after_use(u, /*forward=*/true);
  }
  // Runs units r backward from dy (when given), calling unit_done(u) once unit u's backward ran.
  template <class UnitDone>
  void run_backward(UnitRange r, Tensor<T> dy, UnitDone&& unit_done) {
    nn::StepContext<T>& ctx = micro_.ctx();
    if (dy.data() != nullptr) ctx.dy = dy;
    for (int u = r.last - 1; u >= r.first; --u) {
      exchange_.acquire(u, /*with_grads=*/true);
      exchange_.prefetch(u, -1);
      ctx.window_end = micro_.last_backward_of_window(u);
      {
        const auto unit_timed = timers_.unit(profile::Phase::backward, u);
        model_.backward_unit(u, ctx);
      }
      unit_done(u);
      exchange_.release_after_use(u, /*forward=*/false);
    }
  }

  // The backward of the pass in flight (its input half when layers defer their weight
  // products), recorded as such; returns the pass's range.
  template <class UnitDone>
  UnitRange pass_backward(const char* what, Tensor<T> dy, UnitDone&& unit_done) {
    const UnitRange r = micro_.pass_in_flight(what);
    if (r.first == 0) timers_.count_micro_step();
    run_backward(r, dy, unit_done);
    micro_.pass_input_ran(num_units());
    return r;
  }

  // Stage 3: gives back every gathered unit that is not persistent (a pass set aside or dropped
  // does not keep its units' parameters). Gradient buffers stay: once its reductions are done, a
  // unit's buffer holds a part not yet reduced (the tied head's product in the embedding's, from
  // a later range's backward), which the unit's own backward adds to and reduces.
  void release_gathered() {
    if constexpr (stage_traits::gathers_before_use) {
      for (int u = 0; u < num_units(); ++u) {
        if (unit(u).persistent) continue;
        exchange_.finish_reductions_of(u);
        exchange_.release_params(u);
      }
    }
  }

  Unit& unit(int u) { return units_[static_cast<std::size_t>(u)]; }
  const Unit& unit_ref(int u) const { return units_[static_cast<std::size_t>(u)]; }

  // Runs fn, a part of the flow that communicates, recording a CommError it raises (see
  // comm_failure()); refuses to start once one was recorded.
  template <class Fn>
  decltype(auto) communicating(std::string_view what, Fn&& fn) {
    expect<CommError>(comm_failure_.empty(), "Engine::", what,
                      ": refused: an earlier collective failed and this engine's communicator "
                      "cannot be used again (",
                      comm_failure_,
                      "); restart the job from the last checkpoint (it loads at any world size)");
    return recording_comm_failure(std::forward<Fn>(fn));
  }
  // Runs fn, recording a CommError it raises, without refusing to start: for setting a pass
  // aside or dropping it, which waits for the reductions in flight.
  template <class Fn>
  decltype(auto) recording_comm_failure(Fn&& fn) {
    try {
      return fn();
    } catch (const CommError& e) {
      if (comm_failure_.empty()) comm_failure_ = e.what();
      throw;
    }
  }

  void expect_consistent(std::string_view what) const {
    expect<Error>(inconsistent_.empty(), "Engine::", what, ": an earlier step stopped part-way (",
                  inconsistent_, "); its state is inconsistent, so load a checkpoint to continue");
  }

  // ---- the update ----------------------------------------------------------------------------

  // The gradient the update of unit u reads: the whole (all-reduced) accumulator when the
  // optimizer states are whole, else this rank's shard.
  std::span<MasterT> update_grad(int u) {
    if constexpr (stage_traits::shards_optimizer_states) {
      return std::span<MasterT>(unit(u).grad_shard.data(), unit(u).grad_shard.size());
    } else {
      return unit(u).whole_accumulator();
    }
  }
  // Sum of squares of this rank's part of the global gradient, unit by unit in unit order. Each
  // unit's sum is taken into its slot in the units' memory and the slots come back in one copy,
  // so a device is waited for once, not once a unit: without offload every unit's is taken here;
  // under Offload<CPU> the exchange took a unit's on its shard's way down beside the backward,
  // which stands in for a pass of the host over the pinned shard (a unit without one is summed
  // there). Tensor-parallel ranks other than 0 count only some of a shard's parameters, so they
  // read the shard.
  double local_sum_of_squares() {
    std::vector<std::optional<double>> taken(static_cast<std::size_t>(num_units()));
    if (groups_.tp_rank() == 0) {
      for (int u = 0; u < num_units(); ++u) {
        // Offload<CPU>'s offloaded units were summed on their way down.
        if (counts_in_norm(u) && !unit(u).offloaded()) {
          exchange_.take_shard_sum(u, local_gradient(u));
        }
      }
      taken = exchange_.shard_sums_of_squares();
    }
    double sum = 0.0;
    for (int u = 0; u < num_units(); ++u) {
      const std::optional<double>& t = taken[static_cast<std::size_t>(u)];
      if (t && counts_in_norm(u)) {
        sum += std::isfinite(*t) ? *t : std::numeric_limits<double>::infinity();
      } else {
        sum += local_sum_of_squares(u);
      }
    }
    return sum;
  }
  // Whether this rank counts its part of unit u's gradient in the global norm: not a pipeline
  // replica (the stage that owns the unit counts it), and under hybrid sharding replica 0 of
  // the shard only (every replica holds the same averaged shard).
  bool counts_in_norm(int u) const { return !unit_ref(u).replica && unit_replica_rank(u) == 0; }
  // Sum of squares of this rank's part of unit u's gradient (with whole states every rank holds
  // the whole reduced gradient, so each counts only its own slice). With tensor parallelism a
  // parameter whole on every tp rank counts on tp rank 0 only.
  double local_sum_of_squares(int u) {
    if (!counts_in_norm(u)) return 0.0;
    const std::span<const MasterT> g = local_gradient(u);
    const UnitPartition& p = *unit(u).partition;
    if (groups_.tp_rank() == 0) return sum_of_squares(u, g);
    double sum = 0.0;
    for (const ShardSegment& s : p.segments(unit(u).group->rank())) {
      if (!unit(u).specs[static_cast<std::size_t>(s.param)].split.is_split()) continue;
      sum += sum_of_squares(u, g.subspan(static_cast<std::size_t>(s.shard_offset),
                                         static_cast<std::size_t>(s.count)));
    }
    return sum;
  }
  // This rank's slice of unit u's gradient (its shard, or its part of a whole gradient).
  std::span<const MasterT> local_gradient(int u) {
    std::span<MasterT> g = update_grad(u);
    if constexpr (!stage_traits::shards_optimizer_states) {
      const UnitPartition& p = *unit(u).partition;
      g = g.subspan(static_cast<std::size_t>(p.shard_begin(unit(u).group->rank())),
                    static_cast<std::size_t>(p.shard_numel()));
    }
    return g;
  }
  // Sum of squares of unit u's gradient values where they live: for a unit Offload<CPU>
  // offloaded the host's threads read the pinned shard (a device kernel would pull it over the
  // bus), else the backend's.
  double sum_of_squares(int u, std::span<const MasterT> g) {
    if (unit(u).offloaded()) return HostBackend::sum_of_squares(g);
    return backend_.sum_of_squares(g);
  }
  // The learning rate every unit's optimizer uses in this step's update (the scheduler's, else
  // the optimizer's own), set before any update runs (a delayed update runs on its own thread).
  void set_update_lr() {
    const auto betas = training_.scheduler ? training_.scheduler->betas() : std::nullopt;
    if (betas && !(betas->first >= 0.0 && betas->first < 1.0)) {
      // OneCycle's decay_mom_rate grows beta1 after the cycle; at 1 Adam's moment never forgets.
      // Nothing is updated: a skipped step, counted as one (the next window draws new dropout
      // masks), and the engine is between steps.
      ++training_.skipped_steps;
      last_step_skipped_ = true;
      clear_accumulators();
      finish_window();
      raise<ConfigError>("scheduler.params.decay_mom_rate: OneCycle's momentum reached ",
                         betas->first, " at iteration ",
                         training_.scheduler->last_batch_iteration(),
                         " (beta1 must stay below 1); lower decay_mom_rate or cycle_max_mom");
    }
    for (optim::AnyOptimizer& opt : optimizers_) {
      if (training_.scheduler) opt.set_lr(training_.lr);
      // OneCycle's momentum (an optimizer without betas keeps its own, as DeepSpeed's does).
      if (betas) opt.set_betas(betas->first, betas->second);
      training_.lr = opt.lr();
    }
  }
  void update_unit(int u, double factor) { update_unit(u, factor, update_grad(u)); }
  // Updates unit u's master slice from grad (its update_grad(u), or the delayed update's shard),
  // scaled by factor; a host optimizer's pass runs on `threads` OpenMP threads (0: all).
  // Offload<CPU> below fp32 writes the rounded copy into compute_copy, or, for a delayed update,
  // into delayed_copy, which publish_delayed_update makes the compute copy.
  void update_unit(int u, double factor, std::span<MasterT> grad, int threads = 0,
                   bool delayed = false) {
    const std::span<MasterT> param = unit(u).resident_master();
    const auto rounded_copy = [&](Unit& s) {
      auto& b = delayed ? s.delayed_copy : s.compute_copy;
      return std::span<T>(b.data(), b.size());
    };
    bool params_rounded = false;  // the optimizer's pass wrote the whole params' rounded copy
    const bool offloaded = unit(u).offloaded();
    if (!optimizers_.empty()) {
      optim::AnyOptimizer& opt = optimizers_[static_cast<std::size_t>(u)];
      if constexpr (std::is_same_v<MasterT, float>) {
        auto io = optim::FusedIo::over(param, std::span<const float>(grad));
        io.scale_grad(static_cast<float>(factor));
        // Offload<CPU> below fp32: the pass also writes the rounded copy a gather copies up.
        if constexpr (offload_cpu && !compute_is_master) {
          if (offloaded) io.write_back(rounded_copy(unit(u)));
        } else if constexpr (rounds_whole_params) {
          // Stage 0 below fp32: the pass rounds the updated master into the whole params as it
          // goes (what refresh_compute_params would do in a second pass over the master).
          Unit& s = unit(u);
          io.write_back(std::span<T>(s.params->data(), s.params->size()));
          params_rounded = true;
        }
        optim::StepOptions run;
        run.threads = threads;
        if constexpr (device_optimizer) {
          run.executor = backend_.fused_executor();
        } else if constexpr (offload_cpu && has_fused_executor) {
          if (!offloaded) run.executor = backend_.fused_executor();  // kept on the device
        }
        if (sums_whole_norms(u)) {
          run.sum_over_ranks = [this, u](std::span<double> sums) { sum_whole_norms(u, sums); };
        }
        opt.step(io, run);
      }
      if (offloaded && !compute_is_master && !delayed) {
        unit(u).compute_copy_current = std::is_same_v<MasterT, float>;
      }
    } else {
      if (factor != 1.0) {
        if (offloaded) {
          HostBackend::scale(grad, factor);  // the pinned shard, which the host waited for
        } else {
          backend_.scale(grad, factor);
        }
      }
      update_(u, param, grad);
      if (offloaded && !compute_is_master) {  // the host rounds the copy itself
        Unit& s = unit(u);
        HostBackend::convert_into(rounded_copy(s), std::span<const MasterT>(param));
        if (!delayed) s.compute_copy_current = true;
      }
    }
    if (!params_rounded) refresh_compute_params(u);
  }
  // Whole params kept beside a whole master of another type (stage 0 in bf16/f16) are rounded
  // from it after each update (by the fused optimizers' own pass, else here); stages 1-3 gather
  // them from the updated slices instead.
  static constexpr bool rounds_whole_params =
      !stage_traits::regathers_after_update && !compute_is_master;
  void refresh_compute_params(int u) {
    if constexpr (rounds_whole_params) {
      Unit& s = unit(u);
      backend_.convert_into(std::span<T>(s.params->data(), s.params->size()),
                            std::span<const MasterT>(s.resident_master()));
    } else {
      (void)u;
    }
  }
  // The master slices were written from outside (checkpoint or weights load).
  void masters_replaced() {
    delayed_regather_ = false;  // regathered below
    for (Unit& s : units_) s.compute_copy_current = false;
    for (int u = 0; u < num_units(); ++u) refresh_compute_params(u);
    exchange_.regather_after_update();
  }
  // Ends the window's gradients: the next window's first fold starts the fp32 accumulators
  // (Fold::start) instead of a clear here; whole f32 gradients, which the layers add into, are
  // cleared.
  void clear_accumulators() {
    exchange_.forget_shard_sums();
    for (Unit& s : units_) {
      s.window_folded = false;
      if constexpr (!stage_traits::shards_grads && compute_is_master) {
        backend_.clear(std::span<T>(s.grads->data(), s.grads->size()));
      }
    }
  }
  // Makes unit u's fp32 accumulators hold this window's gradient when no fold started them (a
  // unit that ran no backward in the window): they are cleared, as every step used to.
  void start_unfolded_gradient(int u) {
    Unit& s = unit(u);
    if (std::exchange(s.window_folded, true)) return;
    backend_.clear(std::span<MasterT>(s.grad_shard.data(), s.grad_shard.size()));
    backend_.clear(std::span<MasterT>(s.grad_accumulator.data(), s.grad_accumulator.size()));
  }
  void finish_window() { micro_.finish_window(); }

  // ---- failures inside the flow ---------------------------------------------------------------

  // A forward (or evaluation) that threw: its micro-step is dropped as if it had not begun and
  // the units it gathered are released; what earlier micro-steps of the window accumulated
  // stays, so the window goes on with the next forward. When the failure left the state
  // inconsistent (a deferred update that threw), the window ends, so a checkpoint can be loaded.
  void abandon_forward() noexcept {
    micro_.abandon_forward();
    release_after_failure();
    if (!inconsistent_.empty()) abandon_window();
  }
  // A backward that threw part-way: some units' gradients were folded or reduced and others
  // not, so the window cannot go on. It ends with its accumulators cleared and the state marked
  // inconsistent: forward and step are refused until load_checkpoint (which is accepted).
  void abandon_backward(const char* why) noexcept {
    if (inconsistent_.empty()) {
      try {
        inconsistent_ = std::string("a backward stopped part-way: ") + why;
      } catch (...) {
        // no memory for the message: the window still ends below
      }
    }
    abandon_window();
  }
  // Ends the window after a failure: the reductions in flight finish (their buffers are about
  // to be cleared), gathered units are released and the accumulators cleared, with the whole
  // gradients the failed backward had begun to add into (a unit's own part, or a tied head's
  // part in the embedding's buffer): they held no reduced gradient, and the next window's
  // backward would add to them.
  void abandon_window() noexcept {
    try {
      exchange_.drain_reductions();
    } catch (...) {
      // a failed reduction: the exception already in flight says why
    }
    release_after_failure();
    try {
      drop_whole_gradients();
      clear_accumulators();
    } catch (...) {
      // a device that failed: the exception in flight says why
    }
    micro_.abandon_window();
  }
  // Some rank's gathers went on with zeros for a master slice it could not read from its swap
  // file (UnitExchange::take_failed_read), as the sum just taken told every rank: every rank
  // raises, the one whose read failed with its own IoError, the others naming it. Reads change
  // nothing, so the master slices and optimizer states stay as they were; what may have used the
  // zeros goes: the accumulation window (its boundary counts as skipped at a step; an evaluation
  // may come between a window's micro-steps) and the units kept gathered, gathered again.
  // Collective over the state group (every rank of the engine; a rank is named by its rank
  // there, which names its swap files).
  [[noreturn]] void raise_failed_reads(std::string_view what, bool at_boundary) {
    const auto failed = exchange_.take_failed_read();
    const std::string mine =
        failed ? zero::detail::concat("rank ", groups_.state_group().rank(), " (unit ",
                                      failed->unit, "'s slice: ", failed->what, ")")
               : "";
    auto all = host_values(groups_.state_group());
    const std::string first = parallel::first_nonempty_text(all, mine);
    if (at_boundary) ++training_.skipped_steps;
    exchange_.forget_kept_errors();  // LoCo: they hold the dropped window's packings' losses
    abandon_window();
    exchange_.regather_after_update();
    if (failed) std::rethrow_exception(failed->error);
    raise<Error>("Engine::", what, ": a master slice could not be read from its swap file on ",
                 first,
                 ", and the gathers went on with zeros in its place; the accumulation window's "
                 "gradients are dropped and no update made (the states are unchanged: training "
                 "can go on, reading the file again)");
  }
  // Gives back the whole gradient buffers that live only while a unit computes (every layout
  // but stages 0-1 with the master as compute copy, whose buffers clear_accumulators clears).
  void drop_whole_gradients() {
    if constexpr (stage_traits::shards_grads || !compute_is_master) {
      for (int u = 0; u < num_units(); ++u) {
        if (!unit(u).grads) continue;
        unit(u).grads.reset();
        exchange_.bind(u);
      }
    }
  }
  // Whether unit u's LAMB sums its per-tensor norms over ranks: its tensors are parts of whole
  // ones, in shards over its group (stage >= 1), split over the tensor-parallel group, or
  // stacked experts split over the expert-parallel group.
  bool sums_whole_norms(int u) const {
    if (optimizer_spec_.type != "LAMB") return false;
    const bool sharded = stage_traits::shards_optimizer_states && unit_ref(u).group->size() > 1;
    return sharded || groups_.tp_size() > 1 || holds_split_experts(u);
  }
  // True for an expert unit whose experts are split over ep > 1 ranks (the engine's setup made
  // sure such a unit holds nothing else).
  bool holds_split_experts(int u) const {
    const auto& specs = unit_ref(u).specs;
    return groups_.ep > 1 && !specs.empty() && specs.front().expert_split.is_split();
  }
  // Those sums are collectives inside the update pass, so every rank must run that pass in step,
  // on the thread that drives its communicators, and together: an update on a thread of its own
  // or inside the next forward would issue them beside the exchange's, and over NVMe a rank
  // whose read failed would leave the others in the sum instead of in the agreement on failures.
  void check_whole_norms_schedule() const {
    const char* why = options_.delayed_param_update     ? "delayed_param_update"
                      : options_.overlap_offload_update ? "overlap_offload_update"
                      : !states_in_memory               ? "offloading the states to NVMe"
                                                        : nullptr;
    expect<ConfigError>(why == nullptr,
                        "optimizer.type: LAMB over ZeRO shards, a tensor-parallel group or "
                        "experts split over ep sums its trust-ratio norms over the ranks "
                        "inside step(), which ",
                        why == nullptr ? "" : why,
                        " does not allow; turn it off, or use another optimizer");
  }
  // LAMB's sums of unit u's whole tensors (2 values a parameter: its p^2, then its u^2 sums, as
  // Lamb::whole_norms lays them out): over the unit's shard group, then a tensor-parallel
  // weight's over the tensor-parallel group, then stacked experts' over the expert-parallel
  // ranks (each holds other experts of the same tensors: one trust ratio for the whole stack,
  // as a single process has). A parameter whole on every tp rank has the same sums on each: the
  // group takes tp rank 0's (the others add zeros), so they stay equal bit for bit; likewise
  // the expert data-parallel ranks' copies of one ep part, summed over the dense group (ep x dp,
  // x cp) from expert data-parallel rank 0 only.
  void sum_whole_norms(int u, std::span<double> sums) {
    Unit& s = unit(u);
    if (stage_traits::shards_optimizer_states && s.group->size() > 1) {
      sum_host_values(*s.group, sums);
    }
    const std::size_t n = s.specs.size();
    expect<Error>(sums.size() == 2 * n, "Engine: LAMB summed ", sums.size(),
                  " norm values for unit ", u, "'s ", n, " parameters");
    if (groups_.tp) {
      if (groups_.tp->rank() != 0) {
        for (std::size_t i = 0; i < n; ++i) {
          if (!s.specs[i].split.is_split()) sums[i] = sums[n + i] = 0.0;
        }
      }
      sum_host_values(*groups_.tp, sums);
    }
    if (holds_split_experts(u)) {
      if (groups_.expert_dp->rank() != 0) std::fill(sums.begin(), sums.end(), 0.0);
      sum_host_values(groups_.dp, sums);
    }
  }
  void release_after_failure() noexcept {
    try {
      release_gathered();
    } catch (...) {
      // a gather that failed: the exception in flight says why
    }
  }

  // ---- the deferred update (Offload<CPU>, EngineOptions::overlap_offload_update) ------------

  // What step() left for the next forward: the factor its units' updates use, and which units
  // have had theirs.
  struct DeferredUpdate {
    double factor = 1.0;
    std::vector<char> done;
    int left = 0;
  };
  bool defers_update() const {
    if constexpr (offload_cpu) {
      return options_.overlap_offload_update && num_units() > 0;
    } else {
      return false;
    }
  }
  // Applies unit u's part of the deferred update, then starts its gather (or drops a stale
  // gathered copy) as step() would have. The exchange calls it before any gather or use of u.
  void apply_deferred_update(int u) {
    if (!deferred_ || deferred_->done[static_cast<std::size_t>(u)] != 0) return;
    deferred_->done[static_cast<std::size_t>(u)] = 1;
    const double factor = deferred_->factor;
    if (--deferred_->left == 0) deferred_.reset();
    try {
      const auto timed = timers_.phase(profile::Phase::step);
      update_unit(u, factor);
    } catch (const std::exception& e) {
      inconsistent_ = e.what();  // as a step that stopped part-way
      deferred_.reset();
      throw;
    }
    if constexpr (stage_traits::regathers_after_update) {
      if (unit(u).persistent) {
        exchange_.start_gather(u);
      } else if (unit(u).params) {
        exchange_.release(u);
      }
    }
  }
  // Applies what is left of the deferred update, in unit order.
  void apply_deferred_updates() {
    for (int u = 0; deferred_ && u < num_units(); ++u) apply_deferred_update(u);
  }
  // The same before the state is read from outside the flow (`what`): communicating (its
  // gathers) only when an update is pending, so reading the state works as before otherwise.
  void apply_deferred_updates_for(std::string_view what) {
    finish_delayed_update();
    if (deferred_) communicating(what, [&] { apply_deferred_updates(); });
  }

  // ---- the delayed update (Offload<CPU>, EngineOptions::delayed_param_update) ----------------

  bool delays_update() const {
    if constexpr (offload_cpu) {
      return options_.delayed_param_update && training_.steps >= options_.delayed_update_after;
    } else {
      return false;
    }
  }
  // Starts this step's update of the offloaded units on a thread of its own: it reads the
  // window's gradient shards, swapped into delayed_grad, while the next window's reductions write
  // grad_shard. Below fp32 it writes its rounded copy into delayed_copy, so every gather until it
  // is done (the ones just started, and at stage 3 the next window's) copies the last update's
  // values up from compute_copy while it runs; the buffer it writes was last copied up a step
  // ago, which the host waited for at this step's norm. The master slices it writes are read by
  // nothing else until it is done. In f32 (stages 1-2) the gathers read the master itself, so
  // those in flight are waited for first. The host optimizer's passes leave one of the OpenMP
  // threads to the thread that drives the device (the passes are elementwise, so their results
  // do not depend on the count).
  // The units kept on the device (offload_ratio) are not delayed: they update here, in step(),
  // before the thread starts (an update callback is never called from two threads at once), and
  // their gathers read their own device slices, nothing the thread writes.
  // What can throw runs before the swap, and a run that cannot start swaps back: a step that
  // throws here leaves the window's gradient in grad_shard for a retry (it was left in
  // delayed_grad, and the retry updated with the previous window's), unless the kept units were
  // updated already, which leaves the state inconsistent until a load.
  void start_delayed_update(double factor) {
    if constexpr (compute_is_master) {
      exchange_.synchronize();
      backend_.host_waits_for_compute();  // the gathers' copies up have read the slices
    }
    const int threads = std::max(1, ops::cpu::num_threads() - 1);
    // One thread for every step's update, made at the first: its OpenMP team lives as long.
    if (!update_worker_) update_worker_.emplace();
    const bool keeps_units = keeps_units_on_device();
    if (keeps_units) update_all_units(factor, UnitsToUpdate::kept_on_device);
    const auto swap_gradients = [this] {
      for (Unit& s : units_) {
        if (s.offloaded()) std::swap(s.grad_shard, s.delayed_grad);
      }
    };
    swap_gradients();
    try {
      delayed_update_ = update_worker_->run([this, factor, threads] {
        for (int u = 0; u < num_units(); ++u) {
          Unit& s = unit(u);
          if (!s.offloaded()) continue;
          update_unit(u, factor, std::span<MasterT>(s.delayed_grad.data(), s.delayed_grad.size()),
                      threads, true);
        }
      });
    } catch (...) {
      swap_gradients();
      if (keeps_units) {
        inconsistent_ =
            "the delayed update did not start after the units kept on the device "
            "were updated";
        clear_accumulators();
        finish_window();
      }
      throw;
    }
  }
  // Waits for the update in flight, if any; its result goes up to the device at the next step
  // (whoever waited: step, synchronize, a state reader). An update that threw leaves the state
  // inconsistent, as a step that stopped part-way.
  void finish_delayed_update() {
    if (!delayed_update_.valid()) return;
    std::future<void> running = std::move(delayed_update_);
    delayed_regather_ = true;
    try {
      running.get();
    } catch (const std::exception& e) {
      inconsistent_ = e.what();
      // A reader that waited mid-window (synchronize, state, optimizer) ends the window too:
      // nothing more can train on it, and a checkpoint loads only between steps.
      abandon_window();
      throw;
    }
  }
  // The finished delayed update goes up (at the step after it, whoever waited for it): below
  // fp32 its rounded copy becomes the compute copy the gathers read, then the units kept
  // gathered gather it. Until then every gather reads the values before it, so a state reader
  // waiting for the update mid-window does not change what the window computes. The units kept
  // on the device (offload_ratio) had theirs at their own step.
  void publish_delayed_update() {
    const auto offloaded = [this](int u) { return unit(u).offloaded(); };
    if constexpr (!compute_is_master) {
      for (int u = 0; u < num_units(); ++u) {
        if (!offloaded(u)) continue;
        Unit& s = unit(u);
        std::swap(s.compute_copy, s.delayed_copy);
        s.compute_copy_current = true;
      }
    }
    exchange_.regather_after_update(offloaded);
  }

  M& model_;
  EngineGroups groups_;
  parallel::AnyComm& comm_ = groups_.dp;  // the data-parallel group
  EngineOptions options_;
  UpdateFn update_;
  NamedParams optimizer_spec_;
  backend_type backend_;
  // What the units compute with: the backend's kernel set (micro_'s contexts point at it).
  std::unique_ptr<nn::Kernels<T>> layer_kernels_ = backend_.template make_layer_kernels<T>();
  std::vector<BufferPlan> plan_;
  std::vector<BufferPlan> kept_plan_;  // offload_ratio: the plan of a unit kept on the device
  std::vector<Unit> units_;
  std::vector<optim::AnyOptimizer> optimizers_;
  Store store_{units_, optimizers_};
  TrainingState training_;
  std::string inconsistent_;  // why the state is inconsistent; empty when whole
  std::string comm_failure_;  // the CommError that broke the communicator; empty while it works
  MicroSteps<T> micro_;
  Exchange exchange_{model_, units_, store_, backend_, options_, [this] {
                       return " at step " + std::to_string(training_.boundaries()) +
                              " micro-step " + std::to_string(micro_.done());
                     }};
  profile::StepTimers timers_;
  bool last_step_skipped_ = false;
  double last_grad_norm_ = 0.0;
  std::optional<DeferredUpdate> deferred_;
  // delayed_param_update: the update in flight, whether a finished one's slices have yet to be
  // gathered, and the thread the updates run on. The worker is declared last, so the engine
  // waits for an update in flight (its destructor joins) before anything it touches is destroyed.
  bool delayed_regather_ = false;
  std::future<void> delayed_update_;
  std::optional<WorkerThread> update_worker_;
};

}  // namespace zero::engine

namespace zero {
/// zero::Engine<Model, Policies...> (see zero::engine::Engine).
template <nn::Model M, class... Policies>
using Engine = engine::Engine<M, Policies...>;
}  // namespace zero
