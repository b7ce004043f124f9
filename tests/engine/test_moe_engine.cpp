// The engine with a mixture-of-experts GPT (nn::LayerGPT with MoEBlocks): every (ep, dp, stage)
// layout equals one process running the same micro-batches in turn over several AdamW steps with
// gradient clipping (f64 1e-10), with activation checkpointing too (the all-to-alls run again
// before each block's backward); without the expert data-parallel reduction it does not; the
// all-to-all volume of an MoE layer equals its formula; a checkpoint saved at (ep 2, dp 2,
// stage 3) resumes at (ep 4, dp 1, stage 1) and (ep 1, dp 4, stage 2) equal to the
// uninterrupted run; at stage 3 the experts are not held gathered past their block's forward;
// bad layouts are refused naming the key. In a pipeline (ep x dp x pp): every schedule equals
// the same reference, and a checkpoint saved at (ep 2, pp 2) resumes at other ep, pp and
// without a pipeline. With Ulysses (ep x sp x dp, and x pp), routed dropless: equal to the
// reference, not without the expert reduction over dp x sp, and checkpoints resume across
// ep, sp and pp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <optim/grad_norm.hpp>
#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/moe/expert_stack.hpp>
#include <zero/nn/moe/moe_layer.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"
#include "moe_test_util.hpp"
#include "resume_check.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;

namespace {

using test::dropless_blocks;
using test::micro_rows;
using test::moe_blocks;
using test::moe_cfg;
using test::moe_pipe_cfg;
using test::moe_reference;

struct Layout {
  int ep, dp, stage;
  bool drop_expert_reduction = false;  // the negative control
  bool checkpoint = false;  // activation checkpointing: each block's forward, all-to-alls
                            // included, runs again before its backward
  int shard_size = 0;       // hybrid sharding (EngineOptions::shard_size); 0: none
  int hpz_size = 0;         // ZeRO++ hpZ's secondary groups (EngineOptions::hpz_size); 0: none
  bool quantized_gradients = false;  // ZeRO++ qgZ (EngineOptions::quantized_gradients)
  // Routing with random draws: top-1 with random token selection (test::rts_blocks), or the
  // noisy gate (test::noisy_blocks); the micro-batches are then placed in the global batch.
  enum class Draws { none, random_tokens, noisy } draws = Draws::none;
};

// norm: the last step's global gradient norm, when not null.
template <int S>
std::vector<test::HeldParam> f64_rank(LocalComm& world, const Layout& l, int accumulation,
                                      int steps, double* norm = nullptr) {
  parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = l.ep, .dp = l.dp}));
  nn::GPTConfig cfg = moe_cfg();
  cfg.checkpoint_activations = l.checkpoint;
  parallel::ExpertParallel ep(groups.ep());
  nn::GPT<double> model(cfg, {}, {},
                        l.draws == Layout::Draws::random_tokens ? test::rts_blocks(std::move(ep))
                        : l.draws == Layout::Draws::noisy       ? test::noisy_blocks(std::move(ep))
                                                                : moe_blocks(std::move(ep)));
  engine::EngineGroups engine_groups(groups);
  // The control: expert units "reduced" over a group of one rank, i.e. not at all.
  if (l.drop_expert_reduction) engine_groups.expert_dp.emplace(groups.tp());
  engine::EngineOptions options = test::tp_options(accumulation);
  options.shard_size = l.shard_size;
  options.hpz_size = l.hpz_size;
  options.quantized_gradients = l.quantized_gradients;
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, std::move(engine_groups),
                                                    test::AdamW64{}, options);
  const int dense_rank = groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank();
  // Random token selection draws by the tokens' rows in the global batch: placed micro-batches.
  test::train(eng, dense_rank, l.ep * l.dp, accumulation, steps, moe_cfg().vocab_size, 0,
              l.draws != Layout::Draws::none);
  if (norm != nullptr) *norm = eng.last_grad_norm();
  return test::held_params(eng);
}

}  // namespace

TEST_CASE(
    "MoE GPT: every (ep, dp, stage) layout equals the single-process reference (f64 AdamW, "
    "clipping, tokens dropped), with activation checkpointing too, and not without the expert "
    "data-parallel reduction",
    "[unit][moe]") {
  const int accumulation = 2, steps = 3;
  for (int dp : {1, 2}) {
    for (int ep : {1, 2, 4}) {
      std::int64_t dropped = 0;
      const auto want = moe_reference(ep * dp, accumulation, steps, &dropped);
      CHECK(dropped > 0);  // the capacity limit is exercised
      for (int stage = 0; stage <= 3; ++stage) {
        const Layout l{ep, dp, stage};
        const auto ranks =
            testing::per_rank<std::vector<test::HeldParam>>(ep * dp, [&](LocalComm& world) {
              return test::with_stage(l.stage, [&](auto s) {
                return f64_rank<decltype(s)::value>(world, l, accumulation, steps);
              });
            });
        double copies_differ = 0;
        const auto got = test::assemble(ranks, &copies_differ);
        INFO("ep " << ep << ", dp " << dp << ", stage " << stage);
        CHECK(test::max_difference(got, want) <= 1e-10);
        CHECK(copies_differ == 0.0);  // the router and dense parameters agree on every rank
      }
      if (dp == 2 && ep == 2) {
        for (int stage : {0, 3}) {
          auto differs = [&](const Layout& l) {
            const auto ranks =
                testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
                  return test::with_stage(l.stage, [&](auto s) {
                    return f64_rank<decltype(s)::value>(world, l, accumulation, steps);
                  });
                });
            return test::max_difference(test::assemble(ranks), want);
          };
          INFO("stage " << stage);
          CHECK(differs({ep, dp, stage, true}) > 1e-6);           // the control
          CHECK(differs({ep, dp, stage, false, true}) <= 1e-10);  // activation checkpointing
        }
      }
    }
  }
}

TEST_CASE(
    "MoE GPT with random draws (random token selection, DeepSpeed's noisy gate): ep x dp "
    "layouts draw what one process draws, equal to its reference, with activation "
    "checkpointing too",
    "[unit][moe]") {
  const int accumulation = 2, steps = 3;
  using Draws = Layout::Draws;
  for (const Draws draws : {Draws::random_tokens, Draws::noisy}) {
    const bool rts = draws == Draws::random_tokens;
    std::int64_t dropped = 0, dropped_plain = 0;
    const nn::MoEBlocks blocks = rts ? test::rts_blocks() : test::noisy_blocks();
    const auto want = moe_reference(4, accumulation, steps, &dropped, moe_cfg(), blocks, true);
    nn::MoEBlocks plain = blocks;  // the same routing without the draws
    plain.router.random_token_selection = false;
    plain.router.noise = nn::GateNoise::none;
    plain.router.second_expert_sampling = false;
    const auto deterministic =
        moe_reference(4, accumulation, steps, &dropped_plain, moe_cfg(), plain, true);
    CHECK(dropped > 0);
    CHECK(test::max_difference(deterministic, want) > 1e-6);  // the draws changed the routing
    for (Layout l : {Layout{2, 2, 0}, Layout{4, 1, 3}, Layout{2, 2, 3, false, true}}) {
      l.draws = draws;
      const auto ranks = testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
        return test::with_stage(l.stage, [&](auto s) {
          return f64_rank<decltype(s)::value>(world, l, accumulation, steps);
        });
      });
      INFO((rts ? "random token selection" : "noisy gate")
           << ": ep " << l.ep << ", dp " << l.dp << ", stage " << l.stage << ", checkpoint "
           << l.checkpoint);
      CHECK(test::max_difference(test::assemble(ranks), want) <= 1e-10);
    }
  }
}

TEST_CASE("MoE GPT under hybrid sharding: ep 2 x dp 2 in shard groups equals the reference",
          "[unit][moe]") {
  // Shard groups of 2: the dense units split into 2 groups of 2 over the 4 ranks, the experts
  // (over the expert data-parallel group of 2) stay whole; of 1: every unit replicated, the
  // dense over 4 replicas, the experts over 2.
  const int accumulation = 2, steps = 3;
  std::int64_t dropped = 0;
  const auto want = moe_reference(4, accumulation, steps, &dropped);
  for (int shard : {1, 2}) {
    for (int stage = 1; stage <= 3; ++stage) {
      const Layout l{2, 2, stage, false, false, shard};
      const auto ranks = testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
        return test::with_stage(l.stage, [&](auto s) {
          return f64_rank<decltype(s)::value>(world, l, accumulation, steps);
        });
      });
      double copies_differ = 0;
      const auto got = test::assemble(ranks, &copies_differ);
      INFO("stage " << stage << ", shard groups of " << shard);
      CHECK(test::max_difference(got, want) <= 1e-10);
      CHECK(copies_differ == 0.0);
    }
  }
}

TEST_CASE("MoE GPT under hpZ: stage 3 with secondary groups equals the reference", "[unit][moe]") {
  // ep 2 x dp 2, groups of 2: the dense units' backward gathers inside 2 groups of 2 of the 4
  // ranks, the experts' (over the expert data-parallel group of 2, a secondary group already) as
  // before; ep 1 x dp 4: every unit's inside groups of 2; ep 4 x dp 2 (8 ranks), groups of 4: the
  // dense units' inside 2 groups of 4, the experts' over their group of 2, smaller than a
  // secondary group, as without hpZ.
  const int accumulation = 2, steps = 3;
  std::int64_t dropped = 0;
  for (const auto& [ep, dp, hpz] :
       {std::tuple{2, 2, 2}, std::tuple{1, 4, 2}, std::tuple{4, 2, 4}}) {
    const auto want = moe_reference(ep * dp, accumulation, steps, &dropped);
    Layout l{ep, dp, 3};
    l.hpz_size = hpz;
    const auto ranks = testing::per_rank<std::vector<test::HeldParam>>(
        ep * dp, [&](LocalComm& world) { return f64_rank<3>(world, l, accumulation, steps); });
    double copies_differ = 0;
    const auto got = test::assemble(ranks, &copies_differ);
    INFO("ep " << ep << ", dp " << dp << ", hpz " << hpz);
    CHECK(test::max_difference(got, want) <= 1e-10);
    CHECK(copies_differ == 0.0);
  }
}

TEST_CASE(
    "MoE GPT under qgZ: stages 2-3 near the reference, the first step's gradient norm "
    "near the exact reduction's",
    "[unit][moe]") {
  // ep 2 x dp 2: the dense units' gradients exchanged over all 4 ranks, the experts' over their
  // expert data-parallel group of 2 and then scaled by 1/ep; ep 1 x dp 4: every unit's over 4.
  // Under hpZ's secondary groups of 2 the exchanges over 4 ranks take two hops.
  const int accumulation = 2, steps = 3;
  std::int64_t dropped = 0;
  const auto want = moe_reference(4, accumulation, steps, &dropped);
  const auto run = [&](const Layout& l, int n, double* norm) {
    return testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
      double mine = 0;
      auto held = test::with_stage(l.stage, [&](auto s) {
        return f64_rank<decltype(s)::value>(world, l, accumulation, n, &mine);
      });
      if (world.rank() == 0) *norm = mine;
      return held;
    });
  };
  for (const auto& [ep, dp] : {std::pair{2, 2}, std::pair{1, 4}}) {
    for (const auto& [stage, hpz] : {std::pair{2, 0}, std::pair{3, 0}, std::pair{3, 2}}) {
      Layout l{ep, dp, stage};
      l.quantized_gradients = true;
      l.hpz_size = hpz;  // 2: the dense units' exchange in two hops (the experts' group is 2)
      double norm = 0;
      double copies_differ = 0;
      const double worst =
          test::max_difference(test::assemble(run(l, steps, &norm), &copies_differ), want);
      // The first step's norm (every rank's weights still equal the reference's): the mean of
      // the quantized gradients against the exact mean, and against a run whose experts are not
      // averaged over their data-parallel group (the control).
      double quantized = 0, exact = 0, control = 0;
      run(l, 1, &quantized);
      l.quantized_gradients = false;
      run(l, 1, &exact);
      l.drop_expert_reduction = true;
      run(l, 1, &control);
      INFO("ep " << ep << ", dp " << dp << ", stage " << stage << ", hpz " << hpz << ": worst "
                 << worst << "; first norms " << quantized << " quantized, " << exact << " exact, "
                 << control << " without the expert reduction");
      // AdamW (lr 0.01) moves a weight by about lr a step whatever the gradient's size, so a
      // gradient near zero that the rounding flips moves it the other way: up to 2 lr a step.
      CHECK(worst > 1e-8);
      CHECK(worst < 0.06);
      CHECK(copies_differ == 0.0);                         // every rank averaged the same runs
      CHECK(std::fabs(quantized - exact) < 1e-3 * exact);  // 1.2e-4 to 3.2e-4 here
      CHECK(quantized != exact);
      // The experts hold a small part of the norm (the control moves it by 0.6%), but the
      // quantized reduction stays several times closer.
      if (ep > 1) CHECK(std::fabs(quantized - exact) < 0.5 * std::fabs(control - exact));
    }
  }
}

TEST_CASE(
    "MoE layer: the all-to-all volume of a forward and backward equals 8 E bytes of counts plus "
    "2 (R + R_e) C elements of rows",
    "[unit][moe]") {
  struct Volume {
    double counts = 0, rows = 0, want_rows = 0;
    std::int64_t experts_ran = 0, routed = 0;
  };
  const int ep = 2;
  const auto got = testing::per_rank<Volume>(ep, [&](LocalComm& world) {
    auto logger = std::make_shared<parallel::CommLogger>();
    world.set_logger(logger);
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = ep}));
    nn::MoEBlocks moe = moe_blocks(parallel::ExpertParallel(groups.ep()));
    const std::int64_t C = 16, H = 64;
    nn::SequentialModel<double> m;
    m.add_unit().add<nn::TokenEmbedding<double>>("wte", 64, C, "tokens", 0.02);
    m.add_unit().add<nn::MixtureOfExperts<double>>("moe", C, H, moe.router, 0.02, 0.02, moe.ep);
    nn::LocalParameters<nn::SequentialModel<double>> params(m, 7);
    const test::GlobalBatch b(micro_rows * ep, 0, 64);
    Arena<> arena(8 << 20);
    nn::StepContext<double> ctx =
        b.micro(0, groups.ep().rank(), ep).context<double>(arena, true, 0);
    logger->enable(true);
    m.forward_unit(0, ctx);
    m.forward_unit(1, ctx);
    ctx.dy = ctx.x;  // any output gradient
    m.backward_unit(1, ctx);
    logger->enable(false);
    auto& moe_layer = dynamic_cast<nn::MixtureOfExperts<double>&>(m.unit(1).layer(0));
    Volume v;
    v.counts = static_cast<double>(logger->total(parallel::CommOp::all_to_all, "ep").bytes);
    v.rows = static_cast<double>(logger->total(parallel::CommOp::all_to_all_v, "ep").bytes);
    v.routed = moe_layer.last_routed_rows();
    v.experts_ran = moe_layer.last_expert_rows();
    v.want_rows = 2.0 * static_cast<double>(v.routed + v.experts_ran) * C * sizeof(double);
    return v;
  });
  std::int64_t routed = 0, ran = 0;
  for (const auto& v : got) {
    CHECK(v.counts == 4 * 8);  // E = 4 counts of 8 bytes
    CHECK(v.rows == v.want_rows);
    CHECK(v.routed > 0);
    routed += v.routed;
    ran += v.experts_ran;
  }
  CHECK(routed == ran);  // every row sent was run by an expert somewhere
}

TEST_CASE(
    "MoE GPT at stage 3: the experts are dropped after their block's forward and gathered again "
    "for its backward",
    "[unit][moe]") {
  struct Held {
    std::size_t after_forward = 0, unit0 = 0;
  };
  const auto held = testing::per_rank<Held>(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
    nn::GPT<double> model(moe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.ep())));
    engine::Engine<nn::GPT<double>, ZeroStage<3>> eng(model, groups, test::AdamW64{},
                                                      test::tp_options(1));
    const test::GlobalBatch b(micro_rows * 4, 0, moe_cfg().vocab_size);
    const int rank = groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank();
    eng.forward(b.micro(0, rank, 4));
    Held h;
    // Only unit 0 stays gathered: the head (the last unit) reads its table in backward at once.
    h.after_forward = eng.memory_report().whole_param_bytes;
    h.unit0 = static_cast<std::size_t>(eng.partition(0).padded_numel()) * sizeof(double);
    eng.backward();
    eng.step();
    return h;
  });
  for (const Held& h : held) CHECK(h.after_forward == h.unit0);
}

TEST_CASE(
    "MoE GPT: experts that do not split, bad layouts, and experts split over another tp than "
    "their block are refused naming the key",
    "[unit][moe]") {
  const auto messages = testing::per_rank<std::string>(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 4}));
    nn::MoEBlocks moe = moe_blocks(parallel::ExpertParallel(groups.ep()));
    moe.router.num_experts = 6;
    std::string out = testing::thrown_message([&] { nn::GPT<double> m(moe_cfg(), {}, {}, moe); });
    // An ep 4 model under an engine whose groups have no expert axis.
    nn::GPT<double> m(moe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.ep())));
    out += "|" + testing::thrown_message([&] {
             engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(
                 m, world, [](int, std::span<double>, std::span<const double>) {});
           });
    // A tensor-parallel block over experts split over another tp (here none), or without the
    // block's sequence parallelism.
    parallel::ProcessGroups<LocalComm> g(world, parallel::Grid({.tp = 2, .ep = 2}));
    out += "|" + testing::thrown_message([&] {
             nn::ExpertStack<double> rows_whole("transformer.h.1.mlp", 4, 16, 64, 0.02,
                                                parallel::ExpertParallel(g.ep()),
                                                parallel::TensorParallel(g.tp()));
             nn::Sequential<double> block;
             nn::add_gpt_block(block, moe_cfg(), 1, parallel::TensorParallel(g.tp(), true), {},
                               &rows_whole, moe_blocks().router);
           });
    out += "|" + testing::thrown_message([&] {
             nn::ExpertStack<double> whole("transformer.h.1.mlp", 4, 16, 64, 0.02,
                                           parallel::ExpertParallel(g.ep()));
             nn::Sequential<double> block;
             nn::add_gpt_block(block, moe_cfg(), 1, parallel::TensorParallel(g.tp()), {}, &whole,
                               moe_blocks().router);
           });
    return out;
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("moe.num_experts = 6") && Catch::Contains("moe.ep_size = 4") &&
                      Catch::Contains("expert-parallel group of 4 ranks") &&
                      Catch::Contains("the block splits its rows over tp") &&
                      Catch::Contains("split over 2 tensor-parallel ranks") &&
                      Catch::Contains("but its experts over 1"));
  }
}

TEST_CASE("a pipeline stage checks the model's expert group against its grid, as the engine does",
          "[unit][moe][pipeline]") {
  // Experts split over the dp axis of a (dp 2, pp 2) grid, which has no expert axis: the stage
  // model did not pass expert_parallel() on, so the engine averaged rank 0's experts 0-1 with
  // rank 1's experts 2-3 as if they were one tensor.
  const auto messages = testing::per_rank<std::string>(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.dp = 2, .pp = 2}));
    nn::GPT<double> model(moe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.dp())));
    engine::EngineOptions options;
    options.activation_bytes = 16 << 20;
    return testing::thrown_message([&] {
      parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<1>> pipe(
          model, world, groups, test::AdamW64{}, {}, options);
    });
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("experts are split over an expert-parallel group of 2 ranks") &&
                      Catch::Contains("ep = 1"));
  }
}

TEST_CASE("experts split over another group of ep ranks than the engine's ep axis are refused",
          "[unit][moe]") {
  // Experts split over the dp axis of an (ep 2, dp 2) grid: the sizes agree, so the engine
  // sharded and averaged rank 0's experts 0-1 with rank 1's experts 2-3 as one tensor.
  const auto messages = testing::per_rank<std::string>(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
    nn::GPT<double> model(moe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.dp())));
    engine::EngineOptions options;
    options.activation_bytes = 16 << 20;
    return testing::thrown_message([&] {
      engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(model, groups, test::AdamW64{}, options);
    });
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("split over another group than the engine's ep axis"));
  }
}

TEST_CASE("experts split over ep in a unit the model does not mark as an expert unit are refused",
          "[unit][moe]") {
  // A SequentialModel with a split MixtureOfExperts has no unit_is_expert: every unit counted
  // as dense, so stage 0 averaged rank 0's expert 0 with rank 1's expert 2 (the same flat
  // offsets) and stages 1-3 stitched shards of different experts together, silently.
  const auto messages = testing::per_rank<std::string>(2, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2}));
    nn::MoEBlocks moe = moe_blocks(parallel::ExpertParallel(groups.ep()));
    nn::SequentialModel<double> m;
    m.add_unit().add<nn::TokenEmbedding<double>>("wte", 64, 16, "tokens", 0.02);
    m.add_unit().add<nn::MixtureOfExperts<double>>("moe", 16, 64, moe.router, 0.02, 0.02, moe.ep);
    return testing::thrown_message([&] {
      engine::Engine<nn::SequentialModel<double>, ZeroStage<1>> eng(
          m, groups, [](int, std::span<double>, std::span<const double>) {});
    });
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("unit 1's parameter 'moe.") &&
                      Catch::Contains("expert-parallel group of 2 ranks") &&
                      Catch::Contains("unit_is_expert"));
  }
}

namespace {

// HostMover whose every mover reports a device stream of its own, as CudaLocalComm's splits did
// before they shared their parent's: a group split from it runs on another stream than dp's.
class OwnStreamMover : public parallel::HostMover {
 public:
  using HostMover::HostMover;
  void* stream() const { return const_cast<char*>(&token_); }

 private:
  char token_ = 0;
};
using OwnStreamComm = parallel::BasicLocalComm<OwnStreamMover>;

}  // namespace

TEST_CASE("the engine's groups run on the data-parallel group's device stream, or are refused",
          "[unit][engine][moe]") {
  // Splits that share their parent's stream (here none: host communicators) pass.
  LocalComm::run(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
    const engine::EngineGroups eg(groups);
    CHECK_NOTHROW(eg.expect_one_device_stream());
  });
  // Each split on a stream of its own: the expert group's ops would not be ordered after the
  // compute the engine orders dp's stream behind.
  const auto messages = testing::per_rank<std::string, OwnStreamComm>(4, [](OwnStreamComm& world) {
    parallel::ProcessGroups<OwnStreamComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
    const engine::EngineGroups eg(groups);
    return testing::thrown_message([&] { eg.expect_one_device_stream(); });
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("expert data-parallel group") &&
                      Catch::Contains("another device stream"));
  }
}

namespace {

// Each rank's model states at rest, as memory_report() measures them and as memory_estimate()
// figures them, for an f32 MoE GPT at stage S over 4 ranks as ep 2 x dp 2.
template <int S>
std::vector<std::pair<double, double>> measured_and_estimated(int sp = 1, int dp = 2) {
  return testing::per_rank<std::pair<double, double>>(2 * sp * dp, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.cp = sp, .ep = 2, .dp = dp}));
    const parallel::SequenceParallel group =
        sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel();
    nn::GPT<float> model(moe_cfg(), {}, group, moe_blocks(parallel::ExpertParallel(groups.ep())));
    engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(model, groups, test::adamw_config(S, 1, 0));
    const engine::MemoryReport m = eng.memory_report();
    const engine::MemoryEstimate e = eng.memory_estimate();
    return std::pair{static_cast<double>(m.total() - m.scratch_bytes), e.device_at_rest + e.host};
  });
}

}  // namespace

TEST_CASE("MoE GPT: the engine's memory estimate shards expert units over their own group",
          "[unit][moe]") {
  // Dense units are sharded over all 4 ranks, the experts over the 2 that hold the same
  // experts. The estimate a device's free memory is checked against divided every unit by 4,
  // leaving out half of the experts' master, optimizer and gradient shards.
  auto check = [](const std::vector<std::pair<double, double>>& ranks, int stage) {
    for (const auto& [measured, estimated] : ranks) {
      INFO("stage " << stage << ": measured " << measured << " bytes, estimated " << estimated);
      CHECK(estimated == measured);
    }
  };
  check(measured_and_estimated<1>(), 1);
  check(measured_and_estimated<2>(), 2);
  check(measured_and_estimated<3>(), 3);
  // Under Ulysses (ep 2 x sp 2): the experts over dp x sp, the dense units over all 4.
  check(measured_and_estimated<1>(2, 1), 1);
  check(measured_and_estimated<3>(2, 1), 3);
}

TEST_CASE("MoE GPT in a pipeline: the reported loss holds every stage's auxiliary losses",
          "[unit][moe][pipeline]") {
  // The loss layer adds the routers' losses of its own pass to the loss; a stage without the
  // loss holds its MoE blocks' share in its passes, and the pipeline reported the last stage's
  // loss alone. Four blocks, the second and the fourth MoE: one on each of 2 stages.
  nn::GPTConfig cfg = moe_cfg();
  cfg.num_layers = 4;
  const int m = 2;
  const test::GlobalBatch b(micro_rows * m, 0, cfg.vocab_size);
  // One engine without a pipeline: the mean loss of the window's micro-batches, then an
  // evaluation, before any step.
  const auto plain = testing::per_rank<std::pair<double, double>>(1, [&](LocalComm& world) {
    nn::GPT<double> model(cfg, {}, {}, moe_blocks());
    engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(model, world, test::AdamW64{},
                                                      test::tp_options(m));
    double train = 0;
    for (int i = 0; i < m; ++i) {
      train += eng.forward(b.micro(i, 0, 1)) / m;
      eng.backward();
    }
    return std::pair{train, eng.evaluate(b.micro(0, 0, 1))};
  })[0];
  const auto piped = testing::per_rank<std::pair<double, double>>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.pp = 2}));
    nn::GPT<double> model(cfg, {}, {}, moe_blocks());
    parallel::pipeline::PipelineOptions options;
    options.partition_method = "type:TransformerBlock";
    parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<1>> pipe(
        model, world, groups, test::AdamW64{}, options, test::tp_options(m));
    const double eval = pipe.evaluate(b.micro(0, 0, 1));
    std::vector<engine::MicroBatch> batches;
    for (int i = 0; i < m; ++i) batches.push_back(b.micro(i, 0, 1));
    return std::pair{pipe.train_batch(batches).loss, eval};
  });
  for (const auto& [train, eval] : piped) {
    CHECK(train == Approx(plain.first).epsilon(1e-12));
    CHECK(eval == Approx(plain.second).epsilon(1e-12));
  }
}

TEST_CASE("MoE GPT: a pipeline partition keeps each experts unit on its block's stage",
          "[unit][moe][pipeline]") {
  // Units: the embedding, then per MoE block its experts unit just before the block, which reads
  // it, then the head. A cut between the two put the experts on the next stage and a replica of
  // them on the block's (the experts' memory twice); uniform over 4 stages cut unit 6's block
  // from its experts (unit 5).
  nn::GPTConfig cfg = moe_cfg();
  cfg.num_layers = 4;
  nn::GPT<double> model(cfg, {}, {}, moe_blocks());
  REQUIRE(model.num_units() == 8);
  REQUIRE(model.unit_is_expert(2));
  REQUIRE(model.unit_is_expert(5));
  for (const char* method : {"uniform", "parameters", "type:TransformerBlock"}) {
    for (int pp : {2, 3, 4}) {
      INFO(method << " over " << pp << " stages");
      const parallel::pipeline::Partition p =
          parallel::pipeline::partition_model(model, method, pp, 1);
      REQUIRE(static_cast<int>(p.parts.size()) == pp);
      for (std::size_t k = 1; k < p.parts.size(); ++k) {
        CHECK_FALSE(model.unit_is_expert(p.parts[k].first - 1));
      }
      // The only replica is the head's copy of the embedding, on the last stage.
      for (int s = 0; s < pp; ++s) {
        parallel::pipeline::StageModel<nn::GPT<double>> stage(model, p, s, pp);
        int replicas = 0;
        for (int u = 0; u < stage.num_units(); ++u) replicas += stage.unit_is_replica(u) ? 1 : 0;
        CHECK(replicas == (s == pp - 1 ? 1 : 0));
      }
    }
  }
  // Kept together, 8 units are 6 groups: 7 stages are too many.
  CHECK_THROWS_WITH(parallel::pipeline::partition_model(model, "uniform", 7, 1),
                    Catch::Contains("8 units (6 groups") && Catch::Contains("fewer than the 7"));
}

namespace {

struct GridLayout {
  int tp = 1;                // expert tensor parallelism: the blocks and each expert split over tp
  bool megatron_sp = false;  // with Megatron's sequence parallelism (tp > 1)
  bool whole_experts = false;  // tp splits the experts, not their hidden units (etp 1)
  int ep = 2, sp = 1, dp = 1, pp = 1;
  parallel::pipeline::ScheduleKind schedule = parallel::pipeline::ScheduleKind::one_f_one_b;
  int stage = 1;
  bool dropless = false;               // dropless_blocks (Ulysses needs them), else moe_blocks
  bool drop_expert_reduction = false;  // a control (pp 1): expert units reduced over no rank
  bool swap_targets = false;           // a control (pp > 1, sp 1): the last stage reads its ep
                                       // partner's targets
  int ranks() const { return tp * ep * sp * dp * pp; }
  nn::MoEBlocks blocks(parallel::ExpertParallel group = {}) const {
    nn::MoEBlocks b = dropless ? dropless_blocks(std::move(group)) : moe_blocks(std::move(group));
    if (whole_experts) b.expert_tp = nn::ExpertTensorParallel::experts;
    return b;
  }
  std::string describe() const {
    return "tp " + std::to_string(tp) + (megatron_sp ? " with SP" : "") +
           (whole_experts ? " (whole experts)" : "") + ", ep " + std::to_string(ep) + ", sp " +
           std::to_string(sp) + ", dp " + std::to_string(dp) + ", pp " + std::to_string(pp) +
           ", ZeRO " + std::to_string(stage);
  }
};

// One rank of layout l: its groups, its tensor-parallel and Ulysses groups (none at tp 1, sp 1),
// a GPT shaped by cfg with l's MoE blocks over the ep group, and its micro-batches.
template <class T>
struct LayoutRank {
  parallel::ProcessGroups<LocalComm> groups;
  parallel::TensorParallel tp;
  parallel::SequenceParallel sp;
  nn::GPT<T> model;
  int data_ranks, data_rank;  // the ep x dp ranks that read different rows, and this one
  std::vector<parallel::SequenceSlice> slices;

  LayoutRank(LocalComm& world, const GridLayout& l, const nn::GPTConfig& cfg)
      : groups(world, parallel::Grid({.tp = l.tp, .cp = l.sp, .ep = l.ep, .dp = l.dp, .pp = l.pp})),
        tp(l.tp > 1 ? parallel::TensorParallel(groups.tp(), l.megatron_sp)
                    : parallel::TensorParallel()),
        sp(l.sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel()),
        model(cfg, tp, sp, l.blocks(parallel::ExpertParallel(groups.ep()))),
        data_ranks(l.ep * l.dp),
        data_rank(groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank()) {}

  // This rank's m micro-batches of b (valid until the next call).
  std::vector<engine::MicroBatch> batches(const test::GlobalBatch& b, int m) {
    return test::rank_batches(b, data_rank, data_ranks, m, sp, slices);
  }
};

// f64 AdamW with clipping at layout l, m micro-batches a step on each data rank: the engine
// (pp 1) or the pipeline, every stage fed the same micro-batches.
template <int S>
std::vector<test::HeldParam> grid_rank(LocalComm& world, const GridLayout& l, int m, int steps) {
  using parallel::pipeline::ScheduleKind;
  LayoutRank<double> r(world, l, moe_pipe_cfg());
  const std::int64_t rows = micro_rows * m * r.data_ranks;
  if (l.pp == 1) {
    engine::EngineGroups engine_groups(r.groups);
    // A group of one rank (tp's, unless the model is split over it; then pp's, pp being 1).
    if (l.drop_expert_reduction) {
      engine_groups.expert_dp.emplace(l.tp == 1 ? r.groups.tp() : r.groups.pp());
    }
    engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(r.model, std::move(engine_groups),
                                                      test::AdamW64{}, test::tp_options(m));
    for (int step = 0; step < steps; ++step) {
      const test::GlobalBatch b(rows, step, moe_pipe_cfg().vocab_size);
      for (const engine::MicroBatch& mb : r.batches(b, m)) {
        eng.forward(mb);
        eng.backward();
        eng.step();
      }
    }
    return test::held_params(eng);
  }
  if constexpr (S >= 2) {
    throw std::logic_error("grid_rank: a pipeline runs ZeRO stages 0-1 only");
  } else {
    parallel::pipeline::PipelineOptions options;
    options.schedule = l.schedule;
    options.virtual_stages = l.schedule == ScheduleKind::interleaved ? 2 : 1;
    options.partition_method = "uniform";
    parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<S>> pipe(
        r.model, world, r.groups, test::AdamW64{}, options, test::tp_options(m));
    for (int step = 0; step < steps; ++step) {
      const test::GlobalBatch b(rows, step, moe_pipe_cfg().vocab_size);
      std::vector<engine::MicroBatch> batches = r.batches(b, m);
      if (l.swap_targets && pipe.holds_last_unit()) {
        // The ep coordinate varies fastest in the ep x dp group: rank ^ 1 is the ep partner.
        for (int i = 0; i < m; ++i) {
          batches[static_cast<std::size_t>(i)].targets =
              b.micro(i, r.data_rank ^ 1, r.data_ranks).targets;
        }
      }
      (void)pipe.train_batch(batches);
    }
    return test::held_params(pipe.engine());
  }
}

// Layout l's parameters assembled over its ranks against moe_reference (m micro-batches a step on
// each of the ep x dp data ranks, 3 steps); copies_differ gets how far copies of one value (the
// router, the dense parameters, the tied table) disagree.
double grid_error(const GridLayout& l, int m, double* copies_differ) {
  const int steps = 3;
  const auto ranks =
      testing::per_rank<std::vector<test::HeldParam>>(l.ranks(), [&](LocalComm& world) {
        return test::with_stage(
            l.stage, [&](auto s) { return grid_rank<decltype(s)::value>(world, l, m, steps); });
      });
  std::int64_t dropped = 0;
  const auto want = moe_reference(l.ep * l.dp, m, steps, &dropped, moe_pipe_cfg(), l.blocks());
  if (!l.dropless) CHECK(dropped > 0);  // the capacity limit is exercised
  return test::max_difference(test::assemble(ranks, copies_differ), want);
}

// What every rank of layout l routed in one training step of m micro-batches a data rank
// (ZeRO-1; the model's window, reset before it), summed over the ranks, with an evaluation after
// the step, which counts nothing. per_forward: the engine's (pp 1) last_stats after each forward,
// summed the same way, the count the window must equal.
struct WindowCount {
  nn::MoEStats window, per_forward;
};
WindowCount window_over_ranks(const GridLayout& l, int m, bool recompute) {
  nn::GPTConfig cfg = moe_pipe_cfg();
  cfg.checkpoint_activations = recompute;
  const auto ranks = testing::per_rank<WindowCount>(l.ranks(), [&](LocalComm& world) {
    LayoutRank<double> r(world, l, cfg);
    const test::GlobalBatch b(micro_rows * m * r.data_ranks, 0, cfg.vocab_size);
    const std::vector<engine::MicroBatch> batches = r.batches(b, m);
    WindowCount out;
    r.model.reset_moe_window_stats();
    if (l.pp == 1) {
      engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(r.model, engine::EngineGroups(r.groups),
                                                        test::AdamW64{}, test::tp_options(m));
      for (const engine::MicroBatch& mb : batches) {
        eng.forward(mb);
        out.per_forward += r.model.moe_stats();
        eng.backward();
      }
      eng.step();
      (void)eng.evaluate(batches.front());
    } else {
      parallel::pipeline::PipelineOptions options;
      options.partition_method = "uniform";
      parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<1>> pipe(
          r.model, world, r.groups, test::AdamW64{}, options, test::tp_options(m));
      (void)pipe.train_batch(batches);
      (void)pipe.evaluate(batches.front());
    }
    out.window = r.model.moe_window_stats();
    return out;
  });
  WindowCount sum;
  for (const WindowCount& c : ranks) {
    sum.window += c.window;
    sum.per_forward += c.per_forward;
  }
  return sum;
}

void check_grid_layouts(const std::vector<std::pair<GridLayout, int>>& runs) {
  for (const auto& [l, m] : runs) {
    INFO(name_of(l.schedule) << ", " << l.describe() << ", " << m << " micro-batches");
    double copies_differ = 0;
    CHECK(grid_error(l, m, &copies_differ) <= 1e-10);
    CHECK(copies_differ == 0.0);  // the router and dense parameters agree on every rank
  }
}

}  // namespace

TEST_CASE(
    "MoE GPT in a pipeline: every schedule at (ep 2, pp 2), and (ep 2, dp 2, pp 2), (ep 4, pp 2) "
    "and (ep 2, pp 4), equal the single-process reference (f64 AdamW, clipping, tokens dropped), "
    "and not with the last stage fed its ep partner's targets",
    "[unit][moe][pipeline]") {
  using parallel::pipeline::ScheduleKind;
  std::vector<std::pair<GridLayout, int>> runs;  // layout, micro-batches a step
  for (ScheduleKind kind : parallel::pipeline::all_schedule_kinds) {
    runs.push_back({{.ep = 2, .pp = 2, .schedule = kind}, 4});
  }
  for (int stage : {0, 1}) runs.push_back({{.ep = 2, .dp = 2, .pp = 2, .stage = stage}, 2});
  runs.push_back({{.ep = 4, .pp = 2}, 2});
  runs.push_back({{.ep = 2, .pp = 4, .schedule = ScheduleKind::gpipe}, 4});
  check_grid_layouts(runs);
  // The control: the last stage's ep ranks trade targets, so each scores the other's tokens.
  double ignored = 0;
  CHECK(grid_error({.ep = 2, .pp = 2, .swap_targets = true}, 4, &ignored) > 1e-6);
}

TEST_CASE(
    "MoE GPT with Ulysses: (ep 2, sp 2) at stages 0-3, with dp 2, and in a pipeline of 2 stages "
    "equal the single-process reference (f64 AdamW, clipping, dropless routing), and not without "
    "the expert data-parallel reduction over dp x sp",
    "[unit][moe][ulysses]") {
  std::vector<std::pair<GridLayout, int>> runs;
  for (int stage = 0; stage <= 3; ++stage) {
    runs.push_back({{.ep = 2, .sp = 2, .stage = stage, .dropless = true}, 2});
  }
  for (int stage : {1, 3}) {
    runs.push_back({{.ep = 2, .sp = 2, .dp = 2, .stage = stage, .dropless = true}, 2});
  }
  for (int stage : {0, 1}) {
    runs.push_back({{.ep = 2, .sp = 2, .pp = 2, .stage = stage, .dropless = true}, 2});
  }
  check_grid_layouts(runs);
  // The control: each sp rank's experts keep the gradient of their own positions only.
  double ignored = 0;
  CHECK(grid_error({.ep = 2, .sp = 2, .dropless = true, .drop_expert_reduction = true}, 2,
                   &ignored) > 1e-6);
}

TEST_CASE(
    "MoE GPT with expert tensor parallelism: (tp 2) at stages 0-3, (tp 2, ep 2) at stages 1 and "
    "3, (tp 2, dp 2), (tp 4) and (tp 2, ep 2, pp 2), and with Megatron's sequence parallelism, "
    "equal the single-process reference (f64 AdamW, clipping, tokens dropped), and not without "
    "the expert data-parallel reduction",
    "[unit][moe][tp]") {
  std::vector<std::pair<GridLayout, int>> runs;
  for (int stage = 0; stage <= 3; ++stage) runs.push_back({{.tp = 2, .ep = 1, .stage = stage}, 2});
  for (int stage : {1, 3}) runs.push_back({{.tp = 2, .ep = 2, .stage = stage}, 2});
  runs.push_back({{.tp = 2, .ep = 1, .dp = 2, .stage = 2}, 2});
  runs.push_back({{.tp = 4, .ep = 1, .stage = 1}, 2});
  runs.push_back({{.tp = 2, .ep = 2, .pp = 2}, 4});
  // Megatron's sequence parallelism: the MoE layers gather the rows over tp and route them all.
  for (int stage : {1, 3}) {
    runs.push_back({{.tp = 2, .megatron_sp = true, .ep = 2, .stage = stage}, 2});
  }
  runs.push_back({{.tp = 2, .megatron_sp = true, .ep = 1, .dp = 2, .stage = 2}, 2});
  runs.push_back({{.tp = 2, .megatron_sp = true, .ep = 2, .pp = 2}, 4});
  check_grid_layouts(runs);
  // The control: the experts keep each data-parallel rank's own gradient.
  double ignored = 0;
  CHECK(grid_error({.tp = 2, .ep = 1, .dp = 2, .drop_expert_reduction = true}, 2, &ignored) > 1e-6);
}

namespace {

// Checks every rank's four expert specs (specs[r], the first expert unit's) against the stacks'
// logical shapes `whole` and this layout's held shapes `part`: split over ep, over tp where
// over_tp[i] says, and the ranks' parts covering each logical element copies[i] times.
void check_expert_parts(const std::vector<std::vector<nn::ParamSpec>>& specs,
                        const std::vector<Shape>& whole, const std::vector<Shape>& part,
                        const std::vector<bool>& over_tp, const std::vector<int>& copies) {
  for (std::size_t i = 0; i < whole.size(); ++i) {
    std::vector<int> held(static_cast<std::size_t>(whole[i].numel()), 0);
    for (const std::vector<nn::ParamSpec>& rank : specs) {
      REQUIRE(rank.size() == 4);
      const nn::ParamSpec& p = rank[i];
      INFO(p.name);
      CHECK(p.shape == part[i]);
      CHECK(p.logical_shape() == whole[i]);
      CHECK(p.expert_split.is_split());
      CHECK(p.split.is_split() == over_tp[i]);
      p.for_each_run(0, p.numel(), [&](std::int64_t logical, std::int64_t, std::int64_t count) {
        for (std::int64_t k = 0; k < count; ++k) ++held[static_cast<std::size_t>(logical + k)];
      });
    }
    CHECK(std::all_of(held.begin(), held.end(), [&](int c) { return c == copies[i]; }));
  }
}

}  // namespace

TEST_CASE(
    "MoE GPT with expert tensor parallelism: each rank holds its experts' hidden units, and the "
    "ranks' parts tile the logical stacks (c_proj's bias whole on every tp rank)",
    "[unit][moe][tp]") {
  struct Held {
    std::vector<nn::ParamSpec> specs;                       // the first expert unit's
    std::int64_t flops = 0, sp_flops = 0, whole_flops = 0;  // an MoE layer's forward
  };
  const int tp = 2, ep = 2;
  const auto held = testing::per_rank<Held>(tp * ep, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp, .ep = ep}));
    nn::GPT<double> model(moe_cfg(), parallel::TensorParallel(groups.tp()), {},
                          moe_blocks(parallel::ExpertParallel(groups.ep())));
    // An MoE layer's forward FLOPs over 8 rows: this rank's hidden units of the experts; under
    // Megatron's sequence parallelism 4 rows a rank, each layer running all 8.
    const std::int64_t C = moe_cfg().channels, H = 4 * C;
    const auto flops = [&](const parallel::TensorParallel& t, std::int64_t rows) {
      const nn::ExpertStack<double> experts("m", 4, C, H, 0.02, parallel::ExpertParallel(), t);
      const nn::MixtureOfExperts<double> moe("m", moe_blocks().router, experts);
      return moe.forward_flops({Shape{rows, C}, 1, rows})->flops;
    };
    Held h;
    h.flops = flops(parallel::TensorParallel(groups.tp()), 8);
    h.sp_flops = flops(parallel::TensorParallel(groups.tp(), true), 4);
    h.whole_flops = flops({}, 8);
    for (int u = 0; u < model.num_units(); ++u) {
      if (model.unit_is_expert(u)) {
        h.specs = model.unit_params(u);
        break;
      }
    }
    return h;
  });
  for (const Held& h : held) {
    const std::int64_t C = moe_cfg().channels, router = 2 * 8 * C * 4;
    CHECK(h.whole_flops - router == 2 * (h.flops - router));  // the experts' half of H
    CHECK(h.sp_flops == h.flops);
  }
  const std::int64_t E = 4, C = 16, H = 64;
  std::vector<std::vector<nn::ParamSpec>> specs;
  for (const Held& h : held) specs.push_back(h.specs);
  // c_proj.bias: whole over tp, as a row-parallel bias, so held by every tp rank.
  check_expert_parts(specs, {{E, H, C}, {E, H}, {E, C, H}, {E, C}},
                     {{E / ep, H / tp, C}, {E / ep, H / tp}, {E / ep, C, H / tp}, {E / ep, C}},
                     {true, true, true, false}, {1, 1, 1, tp});
}

TEST_CASE(
    "MoE GPT with whole experts over tp (expert_tensor_parallel_size 1): (tp 2) at stages 0-3, "
    "(tp 2, ep 2) at stages 1 and 3, (tp 2, dp 2), (tp 4) and (tp 2, ep 2, pp 2), and with "
    "Megatron's sequence parallelism, equal the single-process reference (f64 AdamW, clipping, "
    "tokens dropped), and not without the expert data-parallel reduction",
    "[unit][moe][tp]") {
  std::vector<std::pair<GridLayout, int>> runs;
  for (int stage = 0; stage <= 3; ++stage) {
    runs.push_back({{.tp = 2, .whole_experts = true, .ep = 1, .stage = stage}, 2});
  }
  for (int stage : {1, 3}) {
    runs.push_back({{.tp = 2, .whole_experts = true, .ep = 2, .stage = stage}, 2});
  }
  runs.push_back({{.tp = 2, .whole_experts = true, .ep = 1, .dp = 2, .stage = 2}, 2});
  runs.push_back({{.tp = 4, .whole_experts = true, .ep = 1, .stage = 1}, 2});
  runs.push_back({{.tp = 2, .whole_experts = true, .ep = 2, .pp = 2}, 4});
  // Sequence parallelism: the outputs reduce-scattered to each rank's rows.
  for (int stage : {1, 3}) {
    runs.push_back(
        {{.tp = 2, .megatron_sp = true, .whole_experts = true, .ep = 2, .stage = stage}, 2});
  }
  runs.push_back(
      {{.tp = 2, .megatron_sp = true, .whole_experts = true, .ep = 1, .dp = 2, .stage = 2}, 2});
  runs.push_back({{.tp = 2, .megatron_sp = true, .whole_experts = true, .ep = 2, .pp = 2}, 4});
  check_grid_layouts(runs);
  double ignored = 0;
  CHECK(
      grid_error({.tp = 2, .whole_experts = true, .ep = 1, .dp = 2, .drop_expert_reduction = true},
                 2, &ignored) > 1e-6);
}

TEST_CASE(
    "MoE GPT with whole experts over tp: each rank holds whole experts of its own, the ranks' "
    "parts tile the logical stacks once, and a layer counts the FLOPs of its 1/tp of the choices",
    "[unit][moe][tp]") {
  struct Held {
    std::vector<nn::ParamSpec> specs;            // the first expert unit's
    std::vector<int> exchanged;                  // exchange_index of every expert
    std::int64_t whole = 0, hidden = 0, sp = 0;  // an MoE layer's forward FLOPs
    int tp_rank = 0, ep_rank = 0, local = 0, first = 0, first_at = 0;
    std::int64_t local_hidden = 0;
  };
  const int tp = 2, ep = 2, E = 4;
  const auto held = testing::per_rank<Held>(tp * ep, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp, .ep = ep}));
    nn::MoEBlocks blocks = moe_blocks(parallel::ExpertParallel(groups.ep()));
    blocks.expert_tp = nn::ExpertTensorParallel::experts;
    nn::GPT<double> model(moe_cfg(), parallel::TensorParallel(groups.tp()), {}, blocks);
    const std::int64_t C = moe_cfg().channels, H = 4 * C;
    const auto flops = [&](const parallel::TensorParallel& t, nn::ExpertTensorParallel split,
                           std::int64_t rows) {
      const nn::ExpertStack<double> experts("m", E, C, H, 0.02, parallel::ExpertParallel(), t,
                                            split);
      const nn::MixtureOfExperts<double> moe("m", moe_blocks().router, experts);
      return moe.forward_flops({Shape{rows, C}, 1, rows})->flops;
    };
    Held h;
    const parallel::TensorParallel t(groups.tp()), t_sp(groups.tp(), true);
    h.whole = flops(t, nn::ExpertTensorParallel::experts, 8);
    h.hidden = flops(t, nn::ExpertTensorParallel::hidden, 8);
    h.sp = flops(t_sp, nn::ExpertTensorParallel::experts, 4);
    for (int u = 0; u < model.num_units(); ++u) {
      if (model.unit_is_expert(u)) {
        h.specs = model.unit_params(u);
        break;
      }
    }
    const nn::ExpertStack<double> stack("m", E, C, H, 0.02, parallel::ExpertParallel(groups.ep()),
                                        t, nn::ExpertTensorParallel::experts);
    for (int e = 0; e < E; ++e) h.exchanged.push_back(stack.exchange_index(e));
    h.tp_rank = groups.tp().rank();
    h.ep_rank = groups.ep().rank();
    h.local = stack.local_experts();
    h.local_hidden = stack.local_hidden();
    h.first = stack.first_expert();
    h.first_at = stack.exchange_index(h.first);
    return h;
  });
  const std::int64_t C = moe_cfg().channels, H = 4 * C;
  for (const Held& h : held) {
    INFO("tp rank " << h.tp_rank << ", ep rank " << h.ep_rank);
    CHECK(h.whole == h.hidden);  // half the choices through whole experts, or all through halves
    CHECK(h.sp == h.whole);
    CHECK(h.local == E / (ep * tp));
    CHECK(h.local_hidden == H);
    // Expert e is held by ep rank e / 2, tp rank e % 2: tp rank t exchanges experts t and 2 + t,
    // in ep-rank order, its own at its ep rank's place.
    CHECK(h.first == h.ep_rank * E / ep + h.tp_rank);
    CHECK(h.first_at == h.ep_rank);
    for (int e = 0; e < E; ++e) {
      INFO("expert " << e);
      CHECK(h.exchanged[static_cast<std::size_t>(e)] == (e % tp == h.tp_rank ? e / tp : -1));
    }
  }
  std::vector<std::vector<nn::ParamSpec>> specs;
  for (const Held& h : held) specs.push_back(h.specs);
  // E / (ep tp) = 1 expert a rank; every tensor split over tp, c_proj's bias too: the tp ranks'
  // experts differ.
  check_expert_parts(specs, {{E, H, C}, {E, H}, {E, C, H}, {E, C}},
                     {{1, H, C}, {1, H}, {1, C, H}, {1, C}}, {true, true, true, true},
                     {1, 1, 1, 1});
}

TEST_CASE(
    "whole experts over tp: an expert tensor-parallel size other than 1 or tp, and experts that "
    "do not split over ep x tp, are refused naming the keys",
    "[unit][moe][tp]") {
  using nn::ExpertTensorParallel;
  CHECK(nn::expert_tensor_parallel_of(0, 2) == ExpertTensorParallel::hidden);
  CHECK(nn::expert_tensor_parallel_of(2, 2) == ExpertTensorParallel::hidden);
  CHECK(nn::expert_tensor_parallel_of(1, 2) == ExpertTensorParallel::experts);
  CHECK(nn::expert_tensor_parallel_of(1, 1) == ExpertTensorParallel::hidden);  // nothing to split
  CHECK_THROWS_AS(nn::expert_tensor_parallel_of(2, 4), ConfigError);
  CHECK_THROWS_WITH(nn::expert_tensor_parallel_of(3, 4),
                    Catch::Contains("moe.expert_tensor_parallel_size = 3") &&
                        Catch::Contains("tensor_parallel.tp_size = 4"));
  config::MoEConfig c;
  c.num_experts = 4;
  c.expert_tensor_parallel_size = 3;
  CHECK_THROWS_WITH(nn::MoEBlocks::from_config(c, {}, 2),
                    Catch::Contains("moe.expert_tensor_parallel_size = 3"));
  c.expert_tensor_parallel_size = 1;
  CHECK(nn::MoEBlocks::from_config(c, {}, 2).expert_tp == ExpertTensorParallel::experts);
  CHECK_THROWS_WITH(
      Config::from_json({{"moe", {{"num_experts", 4}, {"expert_tensor_parallel_size", 0}}}}),
      Catch::Contains("expert_tensor_parallel_size = 0"));
  CHECK(Config::from_json({{"moe", {{"num_experts", 4}, {"expert_tensor_parallel_size", 1}}}})
            .moe.expert_tensor_parallel_size == 1);
  // 4 experts over ep 2 x tp 4 ranks: not a whole number each.
  const auto refused = testing::per_rank<std::string>(8, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 4, .ep = 2}));
    try {
      nn::ExpertStack<double>("m", 4, 16, 64, 0.02, parallel::ExpertParallel(groups.ep()),
                              parallel::TensorParallel(groups.tp()), ExpertTensorParallel::experts);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("built");
  });
  for (const std::string& why : refused) {
    CHECK_THAT(why, Catch::Contains("moe.num_experts = 4") &&
                        Catch::Contains("moe.ep_size x tensor_parallel.tp_size = 2 x 4"));
  }
}

namespace {

// f32 AdamW (or LAMB, lr 0.01) from a config at layout l (pp 1: the plain engine at l.stage; a
// pipeline: ZeRO-1), 4 micro-batches a step whatever the layout: optionally loads `load`, trains
// `steps` steps from first_step, optionally saves.
std::vector<test::HeldParam> f32_moe_rank(LocalComm& world, const GridLayout& l, int first_step,
                                          int steps, const std::filesystem::path& load,
                                          const std::filesystem::path& save, bool lamb = false) {
  LayoutRank<float> r(world, l, moe_cfg());
  const int accumulation = 4 / r.data_ranks;
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  const auto config_at = [&](int stage) {
    Config config = test::adamw_config(stage, accumulation, 1.0);
    if (lamb) {
      config.optimizer->type = "LAMB";
      config.optimizer->params["lr"] = {0.01};
    }
    return config;
  };
  if (l.pp == 1) {
    return test::with_stage(l.stage, [&](auto stage) {
      constexpr int S = decltype(stage)::value;
      engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(r.model, r.groups, config_at(S), options);
      if (!load.empty()) eng.load_checkpoint(load);
      for (int step = first_step; step < first_step + steps; ++step) {
        const test::GlobalBatch b(micro_rows * 4, step, moe_cfg().vocab_size);
        for (const engine::MicroBatch& mb : r.batches(b, accumulation)) {
          eng.forward(mb);
          eng.backward();
          eng.step();
        }
      }
      if (!save.empty()) eng.save_checkpoint(save, "step2");
      return test::held_params(eng);
    });
  }
  REQUIRE(l.stage <= 1);
  const Config config = config_at(1);
  parallel::pipeline::PipelineOptions po;
  po.partition_method = "uniform";
  parallel::pipeline::PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(r.model, world, r.groups,
                                                                        config, po, options);
  if (!load.empty()) pipe.engine().load_checkpoint(load);
  for (int step = first_step; step < first_step + steps; ++step) {
    const test::GlobalBatch b(micro_rows * 4, step, moe_cfg().vocab_size);
    (void)pipe.train_batch(r.batches(b, accumulation));
  }
  if (!save.empty()) pipe.engine().save_checkpoint(save, "step2");
  return test::held_params(pipe.engine());
}

// Saves at `from` after 2 steps, resumes at each of `to` for 2 more (test::check_resumes).
void check_moe_resumes(const GridLayout& from, const std::vector<GridLayout>& to,
                       const std::string& name) {
  test::check_resumes(
      name, from, to,
      [](const GridLayout& l, int first, int steps, const std::filesystem::path& load,
         const std::filesystem::path& save) {
        return test::assemble(testing::per_rank<std::vector<test::HeldParam>>(
            l.ranks(), [&](LocalComm& w) { return f32_moe_rank(w, l, first, steps, load, save); }));
      },
      [](const GridLayout& l) { return l.describe(); });
}

}  // namespace

TEST_CASE(
    "MoE checkpoints: (ep 2, dp 2, stage 3) resumes at (ep 4, dp 1, stage 1) and (ep 1, dp 4, "
    "stage 2) equal to the uninterrupted run",
    "[unit][moe]") {
  check_moe_resumes({.ep = 2, .dp = 2, .stage = 3},
                    {{.ep = 4, .stage = 1}, {.ep = 1, .dp = 4, .stage = 2}}, "zero-moe-ckpt");
}

TEST_CASE(
    "MoE pipeline checkpoints: (ep 2, pp 2) resumes at (ep 1, dp 2, pp 2), (ep 2, pp 4) and "
    "(ep 2, dp 2) without a pipeline, equal to the uninterrupted run",
    "[unit][moe][pipeline]") {
  check_moe_resumes({.ep = 2, .pp = 2},
                    {{.ep = 1, .dp = 2, .pp = 2}, {.ep = 2, .pp = 4}, {.ep = 2, .dp = 2}},
                    "zero-moe-pp-ckpt");
}

TEST_CASE(
    "MoE Ulysses checkpoints: (ep 2, sp 2) resumes at (ep 2) without Ulysses, (ep 1, sp 2, dp 2) "
    "and (ep 2, sp 2, pp 2), equal to the uninterrupted run",
    "[unit][moe][ulysses]") {
  // Dropless: with a capacity, a rank holding T/sp positions routes other tokens than one
  // holding whole sequences.
  check_moe_resumes({.ep = 2, .sp = 2, .dropless = true},
                    {{.ep = 2, .dropless = true},
                     {.ep = 1, .sp = 2, .dp = 2, .dropless = true},
                     {.ep = 2, .sp = 2, .pp = 2, .dropless = true}},
                    "zero-moe-sp-ckpt");
}

TEST_CASE(
    "MoE expert tensor-parallel checkpoints: (tp 2, ep 2, stage 3) resumes at (ep 2, dp 2, stage "
    "1), (tp 4, stage 2) and (tp 2 with SP, ep 2, stage 1), equal to the uninterrupted run",
    "[unit][moe][tp]") {
  check_moe_resumes({.tp = 2, .ep = 2, .stage = 3},
                    {{.ep = 2, .dp = 2, .stage = 1},
                     {.tp = 4, .ep = 1, .stage = 2},
                     {.tp = 2, .megatron_sp = true, .ep = 2, .stage = 1}},
                    "zero-moe-tp-ckpt");
}

TEST_CASE(
    "MoE checkpoints with whole experts over tp: (tp 2, ep 2, stage 3) resumes at (tp 2, ep 2) "
    "with each expert split over tp (stage 1), (ep 4, stage 2) and (tp 2 with SP, dp 2, stage 1) "
    "with whole experts, equal to the uninterrupted run",
    "[unit][moe][tp]") {
  check_moe_resumes(
      {.tp = 2, .whole_experts = true, .ep = 2, .stage = 3},
      {{.tp = 2, .ep = 2, .stage = 1},
       {.ep = 4, .stage = 2},
       {.tp = 2, .megatron_sp = true, .whole_experts = true, .ep = 1, .dp = 2, .stage = 1}},
      "zero-moe-etp-ckpt");
}

TEST_CASE(
    "MoE GPT: LAMB takes each expert stack's trust ratio from the whole stack's norms, so (ep 2), "
    "(ep 2, dp 2, stage 1), (ep 4, stage 2) and (tp 2, ep 2, stage 3), each expert split over tp "
    "or whole, equal one rank",
    "[unit][moe]") {
  // Each ep rank holds other experts of the same stacked tensors: their p^2 and u^2 sums are
  // summed over the ep ranks (from one copy of each ep part) as a tensor-parallel weight's are
  // over tp.
  const auto run = [](const GridLayout& l) {
    double copies_differ = 0;
    const auto got = test::assemble(
        testing::per_rank<std::vector<test::HeldParam>>(
            l.ranks(),
            [&](LocalComm& world) { return f32_moe_rank(world, l, 0, 3, {}, {}, true); }),
        &copies_differ);
    CHECK(copies_differ == 0.0);
    return got;
  };
  const auto want = run({.ep = 1, .stage = 0});
  for (const GridLayout& l :
       std::vector<GridLayout>{{.ep = 2, .stage = 0},
                               {.ep = 2, .dp = 2, .stage = 1},
                               {.ep = 4, .stage = 2},
                               {.tp = 2, .ep = 2, .stage = 3},
                               {.tp = 2, .whole_experts = true, .ep = 2, .stage = 3}}) {
    const double worst = test::max_difference(run(l), want);
    INFO(l.describe() << ": worst difference " << worst);
    CHECK(worst <= 2e-6);
  }
}

TEST_CASE(
    "MoE GPT: the window statistics count each trained micro-batch once: the engine's equal its "
    "forwards' with and without recomputation, and pipeline stages of 2 and 4 sum to them",
    "[unit][moe][pipeline]") {
  const int m = 4;
  const WindowCount plain = window_over_ranks({.ep = 2}, m, false);
  // 2 data ranks x m micro-batches of micro_rows x seq tokens, k = 2 choices in each of the 2
  // MoE blocks (every second of 4 layers).
  const std::int64_t choices = 2 * m * micro_rows * test::seq * 2 * 2;
  REQUIRE(plain.per_forward.choices == choices);
  CHECK(plain.per_forward.dropped > 0);  // the capacity limit drops some
  const auto check_equal = [&](const nn::MoEStats& got) {
    CHECK(got.choices == choices);
    CHECK(got.dropped == plain.per_forward.dropped);
    CHECK(got.capacity == plain.per_forward.capacity);
    CHECK(got.aux_loss == Approx(plain.per_forward.aux_loss).epsilon(1e-12));
    CHECK(got.z_loss == Approx(plain.per_forward.z_loss).epsilon(1e-12));
  };
  check_equal(plain.window);
  for (bool recompute : {false, true}) {
    INFO((recompute ? "recomputing the checkpointed blocks" : "kept activations"));
    if (recompute) check_equal(window_over_ranks({.ep = 2}, m, true).window);
    for (int pp : {2, 4}) {
      INFO("pp " << pp);
      check_equal(window_over_ranks({.ep = 2, .pp = pp}, m, recompute).window);
    }
  }
}
