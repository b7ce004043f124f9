// The mixture-of-experts GPT over MpiComm (mpiexec at 2 and 4 ranks): every ep that divides the
// world, at stages 0-3, equals the single-process reference (f64 AdamW with clipping, tokens
// dropped), and so do ep 2 in a pipeline of world/2 stages (1F1B, ZeRO-1) and ep 2 with Ulysses
// sp 2 from 4 ranks on, the rest data parallel (dropless routing); with random token selection
// and DeepSpeed's noisy gate at stage 3 too; with tp 2 (each expert split over it, or whole
// experts over it) and the rest expert parallel at stages 1 and 3; each rank checks its own parts
// of the whole tensors.
#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>

#include "engine_mpi_util.hpp"
#include "moe_test_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

// blocks: the MoE blocks over an ep group (moe_blocks by default); placed: the micro-batches
// say where their rows sit (the routers' random draws follow the rows).
template <int S>
double moe_error(int ep, const LogicalValues& want, int accumulation, int steps,
                 nn::MoEBlocks (*blocks)(parallel::ExpertParallel) = moe_blocks,
                 bool placed = false) {
  const int dp = world().size() / ep;
  parallel::ProcessGroups<parallel::MpiComm> groups(world(), parallel::Grid({.ep = ep, .dp = dp}));
  nn::GPT<double> model(moe_cfg(), {}, {}, blocks(parallel::ExpertParallel(groups.ep())));
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, AdamW64{},
                                                    tp_options(accumulation));
  train(eng, groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank(), world().size(),
        accumulation, steps, moe_cfg().vocab_size, 0, placed);
  return max_part_difference(held_params(eng), want);
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("MpiComm: the mixture-of-experts GPT equals the single-process reference",
                       "[mpi][engine][moe]", ((int S), S), 0, 1, 2, 3) {
  const int accumulation = 2, steps = 2;
  std::int64_t dropped = 0;
  const auto want = moe_reference(world().size(), accumulation, steps, &dropped);
  CHECK(dropped > 0);
  for (int ep : {1, 2, 4}) {
    if (world().size() % ep != 0) continue;
    INFO("stage " << S << " ep " << ep << " dp " << world().size() / ep);
    CHECK(worst(moe_error<S>(ep, want, accumulation, steps)) <= 1e-10);
  }
}

TEST_CASE(
    "MpiComm: the mixture-of-experts GPT with random draws (random token selection, the noisy "
    "gate) equals the reference",
    "[mpi][engine][moe]") {
  // Each process draws from the tokens' rows in the global batch, as the one process does.
  const int accumulation = 2, steps = 2;
  for (auto* blocks : {&rts_blocks, &noisy_blocks}) {
    std::int64_t dropped = 0;
    const auto want =
        moe_reference(world().size(), accumulation, steps, &dropped, moe_cfg(), blocks({}), true);
    CHECK(dropped > 0);
    for (int ep : {1, 2}) {
      if (world().size() % ep != 0) continue;
      INFO((blocks == &rts_blocks ? "random token selection" : "noisy gate") << ", ep " << ep);
      CHECK(worst(moe_error<3>(ep, want, accumulation, steps, blocks, true)) <= 1e-10);
    }
  }
}

TEST_CASE("MpiComm: the mixture-of-experts GPT in a pipeline (ep 2) equals the reference",
          "[mpi][engine][moe][pipeline]") {
  const int ep = 2, pp = world().size() / ep, m = 2, steps = 2;
  std::int64_t dropped = 0;
  const auto want = moe_reference(ep, m, steps, &dropped, moe_pipe_cfg());
  CHECK(dropped > 0);
  parallel::ProcessGroups<parallel::MpiComm> groups(world(), parallel::Grid({.ep = ep, .pp = pp}));
  nn::GPT<double> model(moe_pipe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.ep())));
  parallel::pipeline::PipelineOptions options;
  options.partition_method = "uniform";
  parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<1>> pipe(
      model, world(), groups, AdamW64{}, options, tp_options(m));
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(micro_rows * m * ep, step, moe_pipe_cfg().vocab_size);
    std::vector<engine::MicroBatch> batches;
    for (int i = 0; i < m; ++i) batches.push_back(b.micro(i, groups.ep().rank(), ep));
    (void)pipe.train_batch(batches);
  }
  INFO("ep " << ep << " pp " << pp);
  CHECK(worst(max_part_difference(held_params(pipe.engine()), want)) <= 1e-10);
}

TEST_CASE("MpiComm: the mixture-of-experts GPT with Ulysses (ep 2) equals the reference",
          "[mpi][engine][moe][ulysses]") {
  // sp 2 (GlobalBatch's seq 6 splits in 2 or 3) from 4 ranks on, the rest data parallel.
  const int ep = 2, sp = world().size() >= 4 ? 2 : 1, dp = world().size() / (ep * sp);
  const int m = 2, steps = 2, data_ranks = ep * dp;
  std::int64_t dropped = 0;
  const auto want = moe_reference(data_ranks, m, steps, &dropped, moe_cfg(), dropless_blocks());
  parallel::ProcessGroups<parallel::MpiComm> groups(world(),
                                                    parallel::Grid({.cp = sp, .ep = ep, .dp = dp}));
  const parallel::SequenceParallel group =
      sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel();
  nn::GPT<double> model(moe_cfg(), {}, group,
                        dropless_blocks(parallel::ExpertParallel(groups.ep())));
  engine::Engine<nn::GPT<double>, ZeroStage<3>> eng(model, groups, AdamW64{}, tp_options(m));
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(micro_rows * m * data_ranks, step, moe_cfg().vocab_size);
    const int data_rank = groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank();
    for (int i = 0; i < m; ++i) {
      const engine::MicroBatch whole = b.micro(i, data_rank, data_ranks);
      const parallel::SequenceSlice mine(whole.tokens, whole.targets, whole.batch, whole.seq_len,
                                         group);
      eng.forward({mine.tokens.data(), mine.targets.data(), mine.batch, mine.seq_len});
      eng.backward();
      eng.step();
    }
  }
  INFO("ep " << ep << " sp " << sp << " dp " << dp << ", ZeRO-3");
  CHECK(worst(max_part_difference(held_params(eng), want)) <= 1e-10);
}

TEMPLATE_TEST_CASE_SIG(
    "MpiComm: the mixture-of-experts GPT with expert tensor parallelism (tp 2), each expert split "
    "over tp or whole experts over it, equals the reference",
    "[mpi][engine][moe][tp]", ((int S), S), 1, 3) {
  // tp 2, the rest expert parallel: (tp 2) at 2 ranks, (tp 2, ep 2) at 4.
  const int tp = 2, ep = world().size() / tp, accumulation = 2, steps = 2;
  std::int64_t dropped = 0;
  const auto want = moe_reference(ep, accumulation, steps, &dropped);
  CHECK(dropped > 0);
  for (const nn::ExpertTensorParallel split :
       {nn::ExpertTensorParallel::hidden, nn::ExpertTensorParallel::experts}) {
    parallel::ProcessGroups<parallel::MpiComm> groups(world(),
                                                      parallel::Grid({.tp = tp, .ep = ep}));
    nn::MoEBlocks blocks = moe_blocks(parallel::ExpertParallel(groups.ep()));
    blocks.expert_tp = split;
    nn::GPT<double> model(moe_cfg(), parallel::TensorParallel(groups.tp()), {}, blocks);
    engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, AdamW64{},
                                                      tp_options(accumulation));
    train(eng, groups.ep().rank(), ep, accumulation, steps, moe_cfg().vocab_size);
    INFO("tp " << tp << " ep " << ep << ", ZeRO-" << S << ", tp splits the "
               << (split == nn::ExpertTensorParallel::experts ? "experts"
                                                              : "experts' hidden units"));
    CHECK(worst(max_part_difference(held_params(eng), want)) <= 1e-10);
  }
}
