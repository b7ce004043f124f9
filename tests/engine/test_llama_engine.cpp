// The engine with nn::LayerLlama (grouped-query attention, rotary embedding, SwiGLU, an untied
// head): layouts of ZeRO stage, data, tensor (with and without Megatron's sequence parallelism)
// and Ulysses sequence parallelism equal one process on the global batch over
// several f64 AdamW steps with clipping (1e-10; a rank's rotary embedding turning its positions
// as if they started at 0 fails it by 0.057), with every rank's copies of a replicated parameter
// equal; so do pipelines of 2 stages (alone, with dp, tp or Ulysses sp); a checkpoint saved at
// (tp 2, dp 2, stage 3) resumes at (tp 1, dp 2 x sp 2, stage 1) equal to the uninterrupted run.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/layer_llama.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "sequence_batches.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::SequenceParallel;
using parallel::TensorParallel;

namespace {

constexpr int accumulation = 2, steps = 3;

// 4 query heads over 2 key/value heads: tp 2 holds one group a rank.
nn::LlamaConfig tiny() {
  nn::LlamaConfig c = nn::LlamaConfig::preset("tiny");
  c.rope_theta = 100.0;  // angles that differ visibly between the positions of 8
  return c;
}

// One process on the whole global batch; sgd: a stateless SGD step in place of AdamW64, whose
// moments (the callback's own) a checkpoint does not hold.
test::LogicalValues reference(std::int64_t global_rows, int num_steps = steps, bool sgd = false) {
  nn::LayerLlama<double> model(tiny());
  auto update = [sgd, adam = test::AdamW64{}](int u, std::span<double> p,
                                              std::span<const double> g) mutable {
    if (sgd) {
      test::sgd(0.1, p, g);
    } else {
      adam(u, p, g);
    }
  };
  return test::sequence_reference(model, test::tp_options(accumulation).seed, global_rows,
                                  num_steps, tiny().vocab_size, false, update);
}

struct Layout {
  int tp, sp, dp, stage;
  bool megatron_sp = false;  // with tp: the norms hold split rows
  bool checkpoint = false;   // activation checkpointing of every block
  bool sgd = false;          // reference's sgd
};

struct Steps {
  int first = 0, last = steps;
  std::filesystem::path load, save;
};

template <int S>
std::vector<test::HeldParam> llama_rank(LocalComm& world, const Layout& l, const Steps& when) {
  parallel::ProcessGroups<LocalComm> groups(world,
                                            parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp}));
  nn::LlamaConfig cfg = tiny();
  cfg.checkpoint_activations = l.checkpoint;
  nn::LayerLlama<double> model(
      cfg, l.tp > 1 ? TensorParallel(groups.tp(), l.megatron_sp) : TensorParallel(),
      l.sp > 1 ? SequenceParallel(groups.cp()) : SequenceParallel());
  using Engine = engine::Engine<nn::LayerLlama<double>, ZeroStage<S>>;
  const auto sgd = [](int, std::span<double> p, std::span<const double> g) {
    test::sgd(0.1, p, g);
  };
  Engine eng(model, groups,
             l.sgd ? typename Engine::UpdateFn(sgd) : typename Engine::UpdateFn(test::AdamW64{}),
             test::tp_options(accumulation));
  if (!when.load.empty()) (void)eng.load_checkpoint(when.load);
  test::train_sequences(eng, {groups.dp().rank(), l.dp, groups.cp().rank(), l.sp}, when.first,
                        when.last, accumulation, cfg.vocab_size);
  if (!when.save.empty()) eng.save_checkpoint(when.save, "step" + std::to_string(when.last));
  return test::held_params(eng);
}

using Run = test::LayoutRun;

Run run(const Layout& l, const Steps& when = {}) {
  return test::run_layout(l.tp * l.sp * l.dp, l.stage, [&](LocalComm& world, auto s) {
    return llama_rank<decltype(s)::value>(world, l, when);
  });
}

// The same layout cut into pp pipeline stages (uniform: the tiny model's 4 units, 2 a stage),
// each step one train_batch of the accumulation's micro-batches (1F1B).
template <int S>
std::vector<test::HeldParam> llama_pipeline_rank(LocalComm& world, const Layout& l, int pp) {
  parallel::ProcessGroups<LocalComm> groups(
      world, parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp, .pp = pp}));
  nn::LayerLlama<double> model(
      tiny(), l.tp > 1 ? TensorParallel(groups.tp(), l.megatron_sp) : TensorParallel(),
      l.sp > 1 ? SequenceParallel(groups.cp()) : SequenceParallel());
  parallel::pipeline::PipelineOptions options;
  options.partition_method = "uniform";
  parallel::pipeline::PipelineEngine<nn::LayerLlama<double>, ZeroStage<S>> pipe(
      model, world, groups, test::AdamW64{}, options, test::tp_options(accumulation));
  for (int step = 0; step < steps; ++step) {
    const test::SequenceMicroBatches micro({groups.dp().rank(), l.dp, groups.cp().rank(), l.sp},
                                           step, accumulation, tiny().vocab_size);
    (void)pipe.train_batch(micro.batches);
  }
  return test::held_params(pipe.engine());
}

}  // namespace

TEST_CASE(
    "LayerLlama under the engine: (tp, sp, dp, stage) layouts equal the single-process reference "
    "(f64 AdamW, clipping)",
    "[unit][engine][llama]") {
  const std::vector<Layout> layouts{
      {1, 1, 1, 0},       {1, 1, 2, 1}, {1, 1, 2, 3}, {2, 1, 1, 2}, {2, 1, 2, 3},
      {2, 1, 2, 1, true}, {1, 2, 1, 2}, {1, 2, 2, 3}, {2, 2, 1, 3}, {1, 1, 2, 3, false, true},
  };
  for (const Layout& l : layouts) {
    const auto want = reference(test::micro_rows * accumulation * l.dp);
    const Run got = run(l);
    const double error = test::max_difference(got.values, want);
    INFO("tp " << l.tp << (l.megatron_sp ? " (SP)" : "") << ", sp " << l.sp << ", dp " << l.dp
               << ", stage " << l.stage << (l.checkpoint ? ", checkpointed" : "")
               << ": worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
  // Negative control: the reference after one step more.
  CHECK(test::max_difference(run({2, 2, 1, 3}).values,
                             reference(test::micro_rows * accumulation, steps + 1)) > 1e-6);
}

TEST_CASE(
    "LayerLlama: a checkpoint saved at tp 2 x dp 2 resumes at sp 2 x dp 2 as if uninterrupted",
    "[unit][engine][llama]") {
  const testing::TempDir dir("llama_resume");
  const auto want = reference(test::micro_rows * accumulation * 2, steps, true);
  (void)run({2, 1, 2, 3, false, false, true}, {0, 1, {}, dir.path()});
  const Run resumed = run({1, 2, 2, 1, false, false, true}, {1, steps, dir.path(), {}});
  CHECK(test::max_difference(resumed.values, want) <= 1e-10);
  CHECK(resumed.copies_differ == 0.0);
}

TEST_CASE(
    "LayerLlama in a pipeline: pp 2, alone and with dp, tp or Ulysses sp, equals the reference",
    "[unit][engine][llama][pipeline]") {
  const int pp = 2;
  for (const Layout& l :
       std::vector<Layout>{{1, 1, 1, 0}, {1, 1, 2, 1}, {2, 1, 1, 1}, {1, 2, 1, 1}}) {
    const auto want = reference(test::micro_rows * accumulation * l.dp);
    const Run got = test::run_layout(pp * l.tp * l.sp * l.dp, l.stage, [&](LocalComm& w, auto s) {
      if constexpr (decltype(s)::value <= 1) {
        return llama_pipeline_rank<decltype(s)::value>(w, l, pp);
      } else {
        return std::vector<test::HeldParam>{};  // a pipeline trains at ZeRO 0-1
      }
    });
    const double error = test::max_difference(got.values, want);
    INFO("pp 2 x tp " << l.tp << " x sp " << l.sp << " x dp " << l.dp << ", stage " << l.stage
                      << ": worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
}
