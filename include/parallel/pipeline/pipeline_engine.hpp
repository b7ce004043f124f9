#pragma once
// PipelineEngine<Model, Policies...>: pipeline parallelism over the pp axis of a Grid, composed
// with data parallelism (ZeRO 0-1 over the dp group), tensor parallelism (the model's own
// group), Ulysses sequence parallelism (cp) and expert parallelism (ep: each stage's MoE blocks
// exchange their tokens over the ep ranks of that stage, which run the same schedule, so their
// all-to-alls meet in order). Each rank builds, from the same full model object:
//   Partition      (partition.hpp)     the units of every virtual stage, the same on every rank;
//   StageModel     (stage_model.hpp)   its own chunks (and replicas of tied units it reads);
//   Engine         (zero::Engine)      over the StageModel: shards, reduces and steps its part,
//                                      the gradient norm summed over dp, tp and pp;
//   StageExecutor  (executor.hpp)      its list of the schedule, checked once per shape
//                                      (schedule_check.hpp) before anything runs.
// train_batch runs one optimizer step over gradient_accumulation_steps micro-batches: the
// schedule, then the tied units' gradients added over their group (the first and last stages
// of a GPT: Megatron's embedding group), then the engine's step.
// ZeRO stages 2 and 3 are refused: gradient accumulation over a pipeline's micro-batches needs
// whole gradients on every rank until the last one (stage 2 would reduce-scatter after every
// micro-batch, m times the traffic), and stage 3 would gather every stage's parameters for every
// micro-batch's forward and backward (DeepSpeed refuses both for the same reasons).

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/pipeline/executor.hpp>
#include <parallel/pipeline/partition.hpp>
#include <parallel/pipeline/schedule.hpp>
#include <parallel/pipeline/schedule_check.hpp>
#include <parallel/pipeline/stage_model.hpp>
#include <parallel/process_groups.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/engine.hpp>

namespace zero::parallel::pipeline {

/// How the pipeline runs.
struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::one_f_one_b;  ///< gpipe, 1f1b, interleaved or zb
  int virtual_stages = 1;                             ///< chunks per rank (interleaved: >= 2)
  std::string partition_method = "parameters";        ///< uniform, parameters, type:<regex>
};

/// What one train_batch did.
struct PipelineStep {
  double loss = 0.0;              ///< mean loss of the micro-batches (every rank gets it)
  bool stepped = false;           ///< the window ended in a step (applied or skipped)
  double wall_s = 0.0;            ///< longest schedule run over the stages (seconds)
  double busy_s = 0.0;            ///< most forward/backward seconds of any stage
  double bubble_fraction = 0.0;   ///< (wall - busy) / busy: the time the busiest stage waited
  int recomputed_forwards = 0;    ///< this stage's forwards run again before their backward
  int peak_live_activations = 0;  ///< this stage's most stage inputs held at once
};

/// The type name of unit u for partition_method type:<regex> (the model's unit_type, or
/// "unit").
template <class M>
std::string unit_type_of(const M& model, int u) {
  if constexpr (requires { model.unit_type(u); }) {
    return std::string(model.unit_type(u));
  } else {
    return "unit";
  }
}

/// Partitions model's units over pp * v virtual stages by method (partition.hpp), keeping a
/// unit on the stage of the unit just before it when it reads that unit's parameters
/// (unit_uses: an MoE block and its experts unit); ties across the model (the LM head reading
/// the embedding's table) are replicated instead (stage_model.hpp).
template <nn::Model M>
Partition partition_model(const M& model, std::string_view method, int pp, int v) {
  std::vector<std::int64_t> params;
  std::vector<std::string> types;
  std::vector<bool> joined;
  const auto reads = [&](int reader, int read) {
    const std::vector<int> uses = model.unit_uses(reader);
    return std::find(uses.begin(), uses.end(), read) != uses.end();
  };
  for (int u = 0; u < model.num_units(); ++u) {
    std::int64_t n = 0;
    for (const nn::ParamSpec& p : model.unit_params(u)) n += p.shape.numel();
    params.push_back(n);
    types.push_back(unit_type_of(model, u));
    joined.push_back(u > 0 && reads(u, u - 1));  // a unit reads only units before it
  }
  return partition_units(method, pp, v, params, types, joined);
}

/// Pipeline-parallel training of M (see the file comment).
template <nn::Model M, class... Policies>
class PipelineEngine {
 public:
  using stage_model_type = StageModel<M>;
  using engine_type = engine::Engine<stage_model_type, Policies...>;
  using T = typename engine_type::T;
  static_assert(engine_type::stage <= 1,
                "zero::PipelineEngine: ZeRO stages 2 and 3 do not compose with pipeline "
                "parallelism: accumulating gradients over the pipeline's micro-batches needs "
                "whole gradients until the last one (stage 2 would reduce-scatter after every "
                "micro-batch), and stage 3 would gather each stage's parameters for every "
                "micro-batch's forward and backward; use ZeroStage<0> or ZeroStage<1>");
  static_assert(std::is_same_v<typename engine_type::policies::compute, Host>,
                "zero::PipelineEngine: the stages run on the host for now (the boundary tensors "
                "and the loss go through host memory over the communicators); drop Compute<...> "
                "or use the engine without pipeline parallelism on a device");

  /// Rank world.rank() of groups' grid trains its pipeline stage of model; update_or_config is
  /// an Engine's update callback or DeepSpeed config (its gradient_accumulation_steps is the
  /// number of micro-batches per step). Collective over world.
  template <Communicator C, class UpdateOrConfig>
  PipelineEngine(M& model, C& world, ProcessGroups<C>& groups, UpdateOrConfig&& update_or_config,
                 PipelineOptions options = {}, engine::EngineOptions engine_options = {})
      : options_(std::move(options)),
        pp_(groups.grid().size(Axis::pp)),
        stage_(groups.grid().coord(world.rank(), Axis::pp)),
        partition_(checked_partition(model, options_, pp_)),
        stage_model_(model, partition_, stage_, pp_),
        engine_(stage_model_, groups, std::forward<UpdateOrConfig>(update_or_config),
                engine_options),
        executor_(engine_, stage_model_, AnyComm(groups.pp()), stage_, pp_) {
    build_tied_groups(model, world, groups);
    // A schedule that cannot run this many micro-batches is refused now, not at the first step
    // after a model was built and a checkpoint loaded (every rank throws the same).
    (void)schedule_for(engine_.options().gradient_accumulation_steps);
  }

  PipelineEngine(const PipelineEngine&) = delete;
  PipelineEngine& operator=(const PipelineEngine&) = delete;

  /// One optimizer step over batches (one per micro-batch: gradient_accumulation_steps of them;
  /// every stage passes the same batches): run_schedule, reduce_tied_gradients, the engine's
  /// step. Collective over the world.
  PipelineStep train_batch(std::span<const engine::MicroBatch> batches) {
    const StageRun run = run_schedule(batches);
    reduce_tied_gradients();
    PipelineStep out;
    out.stepped = engine_.step();
    // The loss lives on the last stage, and the auxiliary losses of earlier stages' blocks on
    // theirs: their sum over stages, per micro-batch. The timings of every stage decide the
    // bubble.
    const double m = static_cast<double>(batches.size());
    double stats[3] = {(run.loss_sum + run.aux_sum) / m, run.wall_s, run.busy_s};
    if (engine_.groups().pp) {
      parallel::AnyComm& pp = *engine_.groups().pp;
      pp.all_reduce(std::span<double>(stats, 1), ReduceOp::sum);
      pp.all_reduce(std::span<double>(stats + 1, 2), ReduceOp::max);
    }
    out.loss = stats[0];
    out.wall_s = stats[1];
    out.busy_s = stats[2];
    out.bubble_fraction = out.busy_s > 0 ? (out.wall_s - out.busy_s) / out.busy_s : 0.0;
    out.recomputed_forwards = run.recomputed_forwards;
    out.peak_live_activations = run.peak_live_activations;
    return out;
  }
  /// Runs this stage's list of the schedule over batches: every micro-batch's forward and
  /// backward, each unit's gradient reduced over dp after its last one. The first part of
  /// train_batch.
  StageRun run_schedule(std::span<const engine::MicroBatch> batches) {
    const int m = static_cast<int>(batches.size());
    expect<ConfigError>(m == engine_.options().gradient_accumulation_steps, "PipelineEngine: got ",
                        m, " micro-batches; gradient_accumulation_steps is ",
                        engine_.options().gradient_accumulation_steps,
                        " (a pipeline step runs exactly one accumulation window)");
    const Schedule& schedule = schedule_for(m);
    return executor_.run(
        std::span<const Instruction>(schedule.stages[static_cast<std::size_t>(stage_)]), batches);
  }
  /// Adds the gradients of every tied unit over its owner and replicas (after run_schedule,
  /// before the engine's step), so they all take the same update. The second part of
  /// train_batch.
  void reduce_tied_gradients() {
    for (Tied& t : tied_) {
      const std::span<typename engine_type::MasterT> g = engine_.boundary_gradient(t.local_unit);
      t.comm.all_reduce(g, ReduceOp::sum);
    }
  }
  /// Forward of batch without dropout through every virtual stage in turn (no backward):
  /// returns the mean loss on every rank (0 without targets), with every stage's auxiliary
  /// losses; the last stage's model then holds the logits. Collective over every rank.
  double evaluate(const engine::MicroBatch& batch) {
    const int stages = pp_ * stage_model_.num_chunks();
    AnyComm* pp = engine_.groups().pp ? &*engine_.groups().pp : nullptr;
    double loss = 0.0;
    BoundaryTensor<T> input;
    std::vector<Work> works;
    for (int vs = 0; vs < stages; ++vs) {
      if (vs % pp_ != stage_) continue;
      if (vs > 0) {
        post_boundary_recv(*pp, input, (stage_ + pp_ - 1) % pp_, true, works);
        wait_all(works);
      }
      const Tensor<T> y =
          engine_.evaluate_pass(stage_model_.chunk_units(vs / pp_), batch, input.view());
      if (vs + 1 < stages) {
        BoundaryHeader header;
        post_boundary_send(*pp, header, Tensor<const T>(y), (stage_ + 1) % pp_, true, works);
        wait_all(works);
        // The loss layer's pass lacks this stage's auxiliary losses (no loss without targets).
        if (batch.targets != nullptr) loss += static_cast<double>(engine_.aux_loss());
      } else {
        loss += convert<double>(engine_.loss());
      }
    }
    // Offload<NVMe>: a master slice some stage could not read raises on every rank now.
    engine_.agree_on_reads("evaluate");
    if (pp != nullptr) pp->all_reduce(std::span<double>(&loss, 1), ReduceOp::sum);
    return loss;
  }
  /// True on the stage that runs the model's last unit (its loss and logits).
  bool holds_last_unit() const { return stage_ == pp_ - 1; }

  /// The engine of this rank's stage (checkpoints, counters, memory).
  engine_type& engine() { return engine_; }
  /// This rank's part of the model.
  const stage_model_type& stage_model() const { return stage_model_; }
  /// The units of every virtual stage.
  const Partition& partition() const { return partition_; }
  /// This rank's pipeline stage and the number of stages.
  int stage() const { return stage_; }
  int stages() const { return pp_; }
  /// The options the pipeline runs with.
  const PipelineOptions& options() const { return options_; }
  /// The checked schedule for m micro-batches.
  const Schedule& schedule_for(int m) {
    auto it = schedules_.find(m);
    if (it == schedules_.end()) {
      Schedule s = make_schedule(options_.schedule, {pp_, m, options_.virtual_stages});
      (void)check_schedule(s);  // refused (ScheduleError) before anything runs
      it = schedules_.emplace(m, std::move(s)).first;
    }
    return it->second;
  }

 private:
  static Partition checked_partition(const M& model, const PipelineOptions& o, int pp) {
    expect<ConfigError>(o.virtual_stages >= 1, "pipeline: virtual_pipeline_model_parallel_size ",
                        o.virtual_stages, " must be at least 1");
    expect<ConfigError>(o.virtual_stages == 1 || pp > 1,
                        "pipeline: virtual_pipeline_model_parallel_size ", o.virtual_stages,
                        " needs more than one pipeline stage (pp is 1), as "
                        "Megatron's: one stage holds the whole model, in one chunk");
    expect<ConfigError>(o.virtual_stages == 1 || o.schedule == ScheduleKind::interleaved,
                        "pipeline: virtual_pipeline_model_parallel_size ", o.virtual_stages,
                        " needs the interleaved schedule (the ", name_of(o.schedule),
                        " schedule runs one chunk per stage)");
    return partition_model(model, o.partition_method, pp, o.virtual_stages);
  }

  // For each unit some stage reads without owning it: a group of its owner and the stages
  // replicating it, at this rank's other coordinates (every rank splits once per such unit).
  template <Communicator C>
  void build_tied_groups(const M& model, C& world, ProcessGroups<C>& groups) {
    const Grid& grid = groups.grid();
    for (int g = 0; g < model.num_units(); ++g) {
      const int owner = partition_.virtual_stage_of(g) % pp_;
      std::vector<bool> member(static_cast<std::size_t>(pp_), false);
      member[static_cast<std::size_t>(owner)] = true;
      bool tied = false;
      for (int u = 0; u < model.num_units(); ++u) {
        const int reader = partition_.virtual_stage_of(u) % pp_;
        for (int used : model.unit_uses(u)) {
          if (used == g && reader != owner) {
            member[static_cast<std::size_t>(reader)] = true;
            tied = true;
          }
        }
      }
      if (!tied) continue;
      const int rank = world.rank();
      const bool in = member[static_cast<std::size_t>(stage_)];
      auto comm = std::make_shared<C>(
          world.split(in ? grid.color(rank, AxisMask{Axis::pp}) : undefined_color,
                      grid.coord(rank, Axis::pp), "tied"));
      if (!in) continue;
      // The pipeline group's deadline (the config's comm_timeout_s, set by the engine), rather
      // than the world's the split inherited.
      if constexpr (requires { comm->set_options(groups.pp().options()); }) {
        comm->set_options(groups.pp().options());
      }
      const int local = stage_model_.local_unit(g);
      expect<Error>(local >= 0, "PipelineEngine: stage ", stage_, " holds no copy of tied unit ",
                    g);
      tied_.push_back({local, AnyComm(*comm), comm});
    }
  }

  struct Tied {
    int local_unit;
    AnyComm comm;
    std::shared_ptr<void> owner;  // keeps the split communicator alive
  };

  PipelineOptions options_;
  int pp_, stage_;
  Partition partition_;
  stage_model_type stage_model_;
  engine_type engine_;
  StageExecutor<engine_type, stage_model_type> executor_;
  std::vector<Tied> tied_;
  std::map<int, Schedule> schedules_;
};

/// The pipeline engine with E's model and policies (E = engine::Engine<M, Policies...>): what a
/// program that picks its engine by policies (zero::dispatch) runs with pipeline stages.
template <class E>
struct pipeline_engine_of;
template <class M, class... Policies>
struct pipeline_engine_of<engine::Engine<M, Policies...>> {
  using type = PipelineEngine<M, Policies...>;
};
template <class E>
using pipeline_engine_of_t = typename pipeline_engine_of<E>::type;

}  // namespace zero::parallel::pipeline
