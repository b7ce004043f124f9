// A model's memory estimate before any engine exists (engine/model_memory_estimate.hpp: the model
// built over shape-only groups, a pipeline rank's StageModel, the shard groups from the grid's
// sizes) against what each rank's engine measures at rest (memory_report()), over tensor,
// pipeline, expert and Ulysses layouts, hybrid sharding and hpZ; and the shape-only groups'
// refusal to run.
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/pipeline/stage_model.hpp>
#include <zero/engine/model_memory_estimate.hpp>
#include <zero/nn/gpt.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using zero::parallel::LocalComm;

namespace {

struct EstimateCase {
  int tp = 1, ep = 1, sp = 1, dp = 1, pp = 1;
  int virtual_stages = 1;
  int experts = 0;             // MoE blocks with this many experts (0: dense)
  bool whole_experts = false;  // tp splits the experts, not their hidden units
  int shard_size = 0, hpz_size = 0;
  std::int64_t persistence_threshold = 0;
  bool loco = false;  // ZeRO++ qgZ with LoCo's kept errors
  int ranks() const { return tp * ep * sp * dp * pp; }
  parallel::GridSizes grid() const { return {.tp = tp, .cp = sp, .ep = ep, .dp = dp, .pp = pp}; }
  std::string describe() const {
    return "tp " + std::to_string(tp) + ", ep " + std::to_string(ep) + ", sp " +
           std::to_string(sp) + ", dp " + std::to_string(dp) + ", pp " + std::to_string(pp) +
           " (v " + std::to_string(virtual_stages) + "), experts " + std::to_string(experts) +
           (whole_experts ? " whole over tp" : "") + ", shard_size " + std::to_string(shard_size) +
           ", hpz_size " + std::to_string(hpz_size) + ", persistence threshold " +
           std::to_string(persistence_threshold) + (loco ? ", qgZ with LoCo" : "");
  }
  nn::MoEBlocks blocks(parallel::ExpertParallel group) const {
    nn::MoEBlocks b;
    if (experts == 0) return b;
    b.router.num_experts = experts;
    b.every = 2;
    b.ep = std::move(group);
    if (whole_experts) b.expert_tp = nn::ExpertTensorParallel::experts;
    return b;
  }
};

nn::GPTConfig estimate_cfg() {
  nn::GPTConfig c;
  c.vocab_size = 96;
  c.max_seq_len = 16;
  c.num_layers = 4;
  c.num_heads = 4;
  c.channels = 32;
  return c;
}

Config estimate_config(int stage, std::int64_t threshold, int accumulation) {
  return Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )" +
      std::to_string(accumulation) + R"(,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
          "zero_optimization": {"stage": )" +
      std::to_string(stage) + R"(, "stage3_param_persistence_threshold": )" +
      std::to_string(threshold) + "}}");
}

// A rank's model-state bytes: at rest as its engine measures them and as the estimate before
// the engine figures them, and the device peak (with the working buffers: stage 3's gathered
// units and hpZ's secondary shards) as the engine's own estimate and the one before it.
// LoCo's kept errors are made at a unit's first reduction, so memory_report() holds none before
// a step; the engine's estimate counts them (the qgZ tests check it against the report after
// steps), and the estimate before the engine is checked against that.
struct RankBytes {
  double measured = 0, estimated = 0;
  double engine_at_rest = 0, engine_peak = 0, estimated_peak = 0;
};

// Rank bytes of model's units (this rank's, over shape-only groups) against engine E's.
template <int S, class M, class E>
RankBytes rank_bytes(const M& model, const EstimateCase& c, const E& eng) {
  engine::MemoryEstimateInput in = engine::model_estimate_input(
      model, S, engine::shard_groups_of(c.grid(), eng.options()), eng.options());
  in.precision = DType::f32;
  const engine::MemoryEstimate e = engine::estimate_model_states(in);
  const engine::MemoryReport m = eng.memory_report();
  const engine::MemoryEstimate engine_e = eng.memory_estimate();
  return {static_cast<double>(m.total() - m.scratch_bytes),
          e.device_at_rest + e.host,  // one memory on the host
          engine_e.device_at_rest + engine_e.host, engine_e.device_peak(), e.device_peak()};
}

// Each rank's bytes under c at ZeRO stage S.
template <int S>
std::vector<RankBytes> measured_and_estimated(const EstimateCase& c) {
  return testing::per_rank<RankBytes>(c.ranks(), [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid(c.grid()));
    const parallel::TensorParallel tp =
        c.tp > 1 ? parallel::TensorParallel(groups.tp()) : parallel::TensorParallel();
    const parallel::SequenceParallel sp =
        c.sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel();
    const parallel::ExpertParallel ep =
        c.ep > 1 ? parallel::ExpertParallel(groups.ep()) : parallel::ExpertParallel();
    nn::GPT<float> model(estimate_cfg(), tp, sp, c.blocks(ep));
    // The same rank's model over groups that only have a shape.
    nn::GPT<float> shape(estimate_cfg(), parallel::TensorParallel::shape_only(c.tp, tp.rank()), {},
                         c.blocks(parallel::ExpertParallel::shape_only(c.ep, ep.rank())));
    engine::EngineOptions options;
    options.shard_size = c.shard_size;
    options.hpz_size = c.hpz_size;
    options.quantized_gradients = c.loco;
    options.loco = c.loco;
    options.activation_bytes = 16 << 20;
    // An interleaved pipeline takes its micro-batches in groups of pp.
    const Config config = estimate_config(S, c.persistence_threshold, c.pp);
    if (c.pp == 1) {
      engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(model, groups, config, options);
      return rank_bytes<S>(shape, c, eng);
    }
    if constexpr (S >= 2) {
      throw std::logic_error("measured_and_estimated: a pipeline runs ZeRO stages 0-1 only");
    } else {
      parallel::pipeline::PipelineOptions po;
      po.virtual_stages = c.virtual_stages;
      po.schedule = c.virtual_stages > 1 ? parallel::pipeline::ScheduleKind::interleaved
                                         : parallel::pipeline::ScheduleKind::one_f_one_b;
      parallel::pipeline::PipelineEngine<nn::GPT<float>, ZeroStage<S>> pipe(model, world, groups,
                                                                            config, po, options);
      const parallel::pipeline::Partition part =
          parallel::pipeline::partition_model(shape, po.partition_method, c.pp, c.virtual_stages);
      const parallel::pipeline::StageModel<nn::GPT<float>> stage(shape, part, groups.pp().rank(),
                                                                 c.pp);
      return rank_bytes<S>(stage, c, pipe.engine());
    }
  });
}

template <int S>
void check_case(const EstimateCase& c) {
  const auto ranks = measured_and_estimated<S>(c);
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankBytes& b = ranks[r];
    INFO(c.describe() << ", ZeRO " << S << ", rank " << r << ": measured " << b.measured
                      << " bytes at rest, estimated " << b.estimated << "; peak " << b.engine_peak
                      << " by the engine's estimate, " << b.estimated_peak << " before it");
    if (!c.loco) CHECK(b.estimated == b.measured);
    CHECK(b.estimated == b.engine_at_rest);
    CHECK(b.estimated_peak == b.engine_peak);
  }
}

}  // namespace

TEST_CASE("a model's estimate before its engine equals what each rank's engine holds",
          "[unit][engine][tp][moe][pipeline]") {
  // Dense, and persistent units at stage 3 (the threshold keeps the head's LayerNorm whole).
  check_case<0>({.dp = 4});
  check_case<3>({.tp = 2, .dp = 2, .persistence_threshold = 100});
  // hpZ: stage 3's secondary shards inside pairs of the 4 data-parallel ranks.
  check_case<3>({.tp = 2, .dp = 4, .hpz_size = 2});
  // Experts over ep 2, each split over tp 2 or whole over it; expert units over the expert
  // data-parallel group (dp), the dense ones over ep x dp, hybrid sharding in pairs.
  check_case<2>({.tp = 2, .ep = 2, .dp = 2, .experts = 4});
  check_case<3>({.tp = 2, .ep = 2, .dp = 2, .experts = 8, .whole_experts = true});
  check_case<1>({.ep = 2, .dp = 4, .experts = 4, .shard_size = 2});
  // Pipelines: a stage's units and the last stage's replica of the token table, interleaved.
  check_case<1>({.tp = 2, .dp = 2, .pp = 2});
  check_case<1>({.tp = 2, .pp = 2, .virtual_stages = 2});
  check_case<0>({.ep = 2, .dp = 2, .pp = 2, .experts = 4});
  // Ulysses: the states over dp x sp.
  check_case<3>({.sp = 2, .dp = 2});
  // LoCo's kept errors: in one hop over the expert group, and in two under hpZ.
  check_case<2>({.ep = 2, .dp = 2, .experts = 4, .loco = true});
  check_case<3>({.dp = 4, .hpz_size = 2, .loco = true});
}

TEST_CASE("shape-only groups size a rank's model and refuse to run", "[unit][engine][tp][moe]") {
  const auto tp = parallel::TensorParallel::shape_only(4, 3, true);
  CHECK(tp.size() == 4);
  CHECK(tp.rank() == 3);
  CHECK(tp.sequence_parallel());
  CHECK_THROWS_WITH(tp.comm(), Catch::Contains("shape-only group") && Catch::Contains("tp = 4"));
  CHECK_THROWS_AS(parallel::TensorParallel::shape_only(2, 2), ConfigError);
  const auto ep = parallel::ExpertParallel::shape_only(2, 1);
  CHECK(ep.size() == 2);
  CHECK(ep.rank() == 1);
  CHECK_THROWS_WITH(ep.comm(), Catch::Contains("shape-only group") && Catch::Contains("ep = 2"));
  CHECK_THROWS_AS(parallel::ExpertParallel::shape_only(0, 0), ConfigError);
  // A model over them has the rank's parts, and a collective raises instead of running.
  nn::GPT<float> model(estimate_cfg(), parallel::TensorParallel::shape_only(2, 1));
  std::int64_t embedding = 0;
  for (const nn::ParamSpec& p : model.unit_params(0)) embedding += p.numel();
  const nn::GPTConfig c = estimate_cfg();
  CHECK(embedding == c.vocab_size / 2 * c.channels + c.max_seq_len * c.channels);
}

TEST_CASE("shard_groups_of splits the data-parallel groups as EngineGroups does",
          "[unit][engine]") {
  engine::EngineOptions o;
  const parallel::GridSizes grid{.tp = 2, .cp = 2, .ep = 2, .dp = 4, .pp = 2};
  engine::ShardGroups g = engine::shard_groups_of(grid, o);
  CHECK(g.dense == 16);   // ep x dp x cp
  CHECK(g.experts == 8);  // dp x cp
  o.shard_size = 4;
  g = engine::shard_groups_of(grid, o);
  CHECK((g.dense == 4 && g.experts == 4));
  o.shard_size = 0;
  o.hpz_size = 8;  // splits the dense group only: the expert group is no larger
  g = engine::shard_groups_of(grid, o);
  CHECK((g.dense == 16 && g.dense_secondary == 8 && g.experts_secondary == 0));
  o.hpz_size = 3;
  CHECK_THROWS_WITH(engine::shard_groups_of(grid, o),
                    Catch::Contains("hpz_size") && Catch::Contains("must divide the 16"));
  o.hpz_size = 2;
  o.shard_size = 2;
  CHECK_THROWS_WITH(engine::shard_groups_of(grid, o), Catch::Contains("set one"));
  // Without expert parallelism, expert units are sharded as dense ones.
  o = {};
  o.shard_size = 2;
  g = engine::shard_groups_of({.dp = 4}, o);
  CHECK((g.dense == 2 && g.experts == 2));
}
