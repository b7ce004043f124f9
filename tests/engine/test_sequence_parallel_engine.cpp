// The engine with a Ulysses sequence-parallel GPT: every (sp, dp, stage) layout, each rank fed
// its T/sp positions of its dp rank's rows, equals one process on the global batch over several
// f64 AdamW steps with gradient clipping (1e-10), and the copies of the parameters on the dp x sp
// ranks stay bit-identical. ZeRO shards over the sequence-data-parallel group (dp x sp): each
// rank's loss is its mean over its own positions weighted by its share of the sp group's counted
// targets, so the engine's average over dp x sp is the global token mean, also with targets
// ignored unevenly over the positions; a checkpoint saved at (sp 2, dp 2, stage 3) resumes at
// other sp sizes and stages as the uninterrupted run. Negative controls: a rank fed another rank's
// positions must differ, and a model without Ulysses (local attention, positions from 0) on the cp
// grid is refused. With dropout, micro-batches that say where their rows sit draw the reference's
// masks at any sp: each rank its positions' part of the residual masks and its heads' part of
// the attention's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "../support/worse.hpp"
#include "engine_test_util.hpp"
#include "sequence_batches.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::SequenceParallel;
using parallel::TensorParallel;

namespace {

constexpr int accumulation = 2, steps = 3;

// One process on the whole global batch: `steps` AdamW steps with clipping; the whole tensors.
// Dropout, where cfg has it, draws the masks of the engines' placed rows (optimizer step s, the
// engines' seed).
test::LogicalValues reference(const nn::GPTConfig& cfg, std::int64_t global_rows,
                              bool padded = false) {
  nn::GPT<double> model(cfg);
  return test::sequence_reference(model, test::tp_options(accumulation).seed, global_rows, steps,
                                  cfg.vocab_size, padded, test::AdamW64{});
}

// How a run deviates from the right one (negative controls).
enum class Fault {
  none,
  wrong_slice,  // sp rank r is fed the positions of sp rank r+1
  no_ulysses,   // the model is built without the sp group: local attention, positions from 0
};

struct Layout {
  int sp, dp, stage;
  Fault fault = Fault::none;
  bool checkpoint = false;  // activation checkpointing: the blocks' forward (and its
                            // all-to-alls) run again before their backward
  bool padded = false;      // each row's last `padding` targets ignored
  bool sgd = false;         // a stateless f64 SGD update in place of AdamW64, whose moments (the
                            // callback's own) a checkpoint does not hold
  bool dropout = false;     // residual, embedding and attention dropout
  bool placed = true;       // with dropout: the micro-batches say where their rows sit
  int tp = 1;               // tensor parallelism too: each tp rank's heads split over sp
};

// The dropout of the layouts with dropout (and of their reference).
nn::GPTConfig with_dropout(nn::GPTConfig cfg) {
  cfg.dropout = 0.2;
  cfg.attn_dropout = 0.3;
  return cfg;
}

// Which steps a run takes: [first, last), after loading `load` and saving to `save` at the end
// (empty: neither).
struct Steps {
  int first = 0, last = steps;
  std::filesystem::path load, save;
};

template <int S>
std::vector<test::HeldParam> sp_rank(LocalComm& world, const Layout& l, const Steps& when) {
  parallel::ProcessGroups<LocalComm> groups(world,
                                            parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp}));
  nn::GPTConfig cfg = l.dropout ? with_dropout(test::tp_tiny()) : test::tp_tiny();
  cfg.checkpoint_activations = l.checkpoint;
  const SequenceParallel sp =
      l.fault == Fault::no_ulysses ? SequenceParallel() : SequenceParallel(groups.cp());
  nn::GPT<double> model(cfg, l.tp > 1 ? TensorParallel(groups.tp()) : TensorParallel(), sp);
  using Engine = engine::Engine<nn::GPT<double>, ZeroStage<S>>;
  const auto sgd = [](int, std::span<double> p, std::span<const double> g) {
    test::sgd(0.1, p, g);
  };
  Engine eng(model, groups,
             l.sgd ? typename Engine::UpdateFn(sgd) : typename Engine::UpdateFn(test::AdamW64{}),
             test::tp_options(accumulation));
  const int dp_rank = groups.dp().rank(), sp_rank = groups.cp().rank();
  const int fed_rank = l.fault == Fault::wrong_slice ? (sp_rank + 1) % l.sp : sp_rank;
  if (!when.load.empty()) (void)eng.load_checkpoint(when.load);
  test::train_sequences(eng, {dp_rank, l.dp, fed_rank, l.sp, l.padded, l.dropout && l.placed},
                        when.first, when.last, accumulation, cfg.vocab_size);
  if (!when.save.empty()) eng.save_checkpoint(when.save, "step" + std::to_string(when.last));
  return test::held_params(eng);
}

using Run = test::LayoutRun;

Run run(const Layout& l, const Steps& when = {}) {
  return test::run_layout(l.tp * l.sp * l.dp, l.stage, [&](LocalComm& world, auto s) {
    return sp_rank<decltype(s)::value>(world, l, when);
  });
}

}  // namespace

TEST_CASE(
    "Ulysses GPT: every (sp, dp, stage) layout equals the single-process reference on the "
    "global batch (f64 AdamW, clipping)",
    "[unit][ulysses]") {
  for (int dp : {1, 2}) {
    const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * dp);
    for (int sp : {1, 2, 4}) {
      for (int stage = 0; stage <= 3; ++stage) {
        const Run got = run({sp, dp, stage});
        const double error = test::max_difference(got.values, want);
        INFO("sp " << sp << ", dp " << dp << ", stage " << stage << ": worst difference " << error);
        CHECK(error <= 1e-10);
        CHECK(got.copies_differ == 0.0);  // every dp x sp rank holds the same parameters
      }
    }
  }
}

TEST_CASE(
    "Ulysses GPT with dropout: placed micro-batches draw one process's masks at sp 2 and 4 "
    "(each rank its positions' and its heads' part)",
    "[unit][ulysses]") {
  const int dp = 2;
  const auto want = reference(with_dropout(test::tp_tiny()), test::micro_rows * accumulation * dp);
  const auto plain = reference(test::tp_tiny(), test::micro_rows * accumulation * dp);
  CHECK(test::max_difference(plain, want) > 1e-6);  // the masks drop something
  for (int sp : {2, 4}) {
    for (int stage : {0, 3}) {
      Layout l{sp, dp, stage};
      l.dropout = true;
      l.checkpoint = stage == 3;  // the recomputed forward draws the same masks
      const Run got = run(l);
      const double error = test::max_difference(got.values, want);
      INFO("sp " << sp << ", stage " << stage << ": worst difference " << error);
      CHECK(error <= 1e-10);
      CHECK(got.copies_differ == 0.0);
    }
    // Negative control: micro-batches that do not say where their rows sit draw other masks.
    Layout unplaced{sp, dp, 1};
    unplaced.dropout = true;
    unplaced.placed = false;
    CHECK(test::max_difference(run(unplaced).values, want) > 1e-6);
  }
}

TEST_CASE(
    "Ulysses GPT with activation checkpointing (the all-to-alls run again in backward) equals "
    "the reference",
    "[unit][ulysses]") {
  const int dp = 2;
  const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * dp);
  for (int sp : {2, 4}) {
    for (int stage : {1, 3}) {
      const Run got = run({sp, dp, stage, Fault::none, /*checkpoint=*/true});
      const double error = test::max_difference(got.values, want);
      INFO("sp " << sp << ", stage " << stage << ", checkpointed: worst difference " << error);
      CHECK(error <= 1e-10);
      CHECK(got.copies_differ == 0.0);
    }
  }
}

TEST_CASE(
    "Ulysses GPT: targets ignored unevenly over the positions count per token, as one process "
    "counts them",
    "[unit][ulysses]") {
  // Every row ignores its last 3 of 8 targets: at sp 2 rank 0 counts 4 a row and rank 1 one, at
  // sp 4 the ranks count 2, 2, 1 and 0 (a rank with nothing to count). Every micro-batch of
  // every dp rank counts as many, so only the weights of the sp ranks' means are under test.
  const int dp = 2;
  const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * dp, true);
  for (int sp : {2, 4}) {
    for (int stage : {0, 3}) {
      const Run got = run({sp, dp, stage, Fault::none, /*checkpoint=*/false, /*padded=*/true});
      const double error = test::max_difference(got.values, want);
      INFO("sp " << sp << ", stage " << stage << ", padded: worst difference " << error);
      CHECK(error <= 1e-10);
      CHECK(got.copies_differ == 0.0);
    }
  }
}

TEST_CASE(
    "Ulysses GPT: a checkpoint saved at (sp 2, dp 2, stage 3) resumes at other sp sizes and "
    "stages as the uninterrupted run",
    "[unit][ulysses]") {
  // A stateless update: an update callback's own state is the program's, not the checkpoint's.
  const int dp = 2;
  const Layout saved{2, dp, 3, Fault::none, false, false, /*sgd=*/true};
  const auto want = run(saved).values;
  testing::TempDir dir("ulysses-resume");
  (void)run(saved, {0, steps - 1, {}, dir.path()});
  for (const auto& [sp, stage] : {std::pair{4, 1}, std::pair{1, 0}, std::pair{2, 2}}) {
    const Layout resumed{sp, dp, stage, Fault::none, false, false, true};
    const Run got = run(resumed, {steps - 1, steps, dir.path(), {}});
    const double error = test::max_difference(got.values, want);
    INFO("resumed at sp " << sp << ", stage " << stage << ": worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
  // The negative control: the last step without the load starts from the initial weights.
  const double fresh = test::max_difference(run(saved, {steps - 1, steps, {}, {}}).values, want);
  INFO("the last step alone: " << fresh);
  CHECK(fresh > 1e-4);
}

TEST_CASE(
    "Ulysses GPT negative controls: a rank fed another rank's positions differs from the "
    "reference, a model without Ulysses on a cp grid is refused",
    "[unit][ulysses]") {
  const int dp = 2;
  const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * dp);
  for (int sp : {2, 4}) {
    const Run got = run({sp, dp, 3, Fault::wrong_slice});
    const double error = test::max_difference(got.values, want);
    INFO("sp " << sp << ", wrong slice: worst difference " << error);
    CHECK(error > 1e-4);
    // A model without Ulysses on a cp grid attends locally: the engine refuses it.
    CHECK_THROWS_WITH(run({sp, dp, 3, Fault::no_ulysses}),
                      Catch::Contains("sequence-parallel group of 1 ranks") &&
                          Catch::Contains("cp = " + std::to_string(sp)));
  }
}

TEST_CASE(
    "Ulysses GPT with tensor parallelism: tp 2 x sp 2 layouts equal the single-process "
    "reference (f64 AdamW with clipping, dropout, uneven targets, a checkpoint across layouts)",
    "[unit][ulysses][tp]") {
  // DeepSpeed-Ulysses over Megatron's tensor parallelism: each tp rank holds half of tp_tiny's 4
  // heads and splits them over its sp pair (one head a rank), the vocabulary-parallel loss
  // weighs its positions' share, ZeRO shards over dp x sp, and the checkpoints' group is
  // tp x dp x sp.
  for (int dp : {1, 2}) {
    const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * dp);
    for (int stage : {0, 1, 3}) {
      Layout l{2, dp, stage};
      l.tp = 2;
      const Run got = run(l);
      const double error = test::max_difference(got.values, want);
      INFO("tp 2, sp 2, dp " << dp << ", stage " << stage << ": worst difference " << error);
      CHECK(error <= 1e-10);
      CHECK(got.copies_differ == 0.0);  // replicated over tp, whole over sp: equal everywhere
    }
  }
  // Dropout: each rank draws its tp part's sp part of the attention masks, and its positions'
  // part of the residual masks, so placed micro-batches draw the reference's.
  {
    Layout l{2, 2, 3};
    l.tp = 2;
    l.dropout = true;
    l.checkpoint = true;
    const auto want = reference(with_dropout(test::tp_tiny()), test::micro_rows * accumulation * 2);
    const Run got = run(l);
    const double error = test::max_difference(got.values, want);
    INFO("with dropout: worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
  // Targets ignored unevenly over the positions: the tp ranks' loss weighs its sp share.
  {
    Layout l{2, 2, 2, Fault::none, false, /*padded=*/true};
    l.tp = 2;
    const auto want = reference(test::tp_tiny(), test::micro_rows * accumulation * 2, true);
    const double error = test::max_difference(run(l).values, want);
    INFO("padded: worst difference " << error);
    CHECK(error <= 1e-10);
  }
  // A checkpoint saved at (tp 2, sp 2, dp 2, stage 3) resumes at (tp 1, sp 4, stage 1) and at
  // (tp 2, sp 1, stage 2) as the uninterrupted run.
  {
    Layout saved{2, 2, 3, Fault::none, false, false, /*sgd=*/true};
    saved.tp = 2;
    const auto want = run(saved).values;
    testing::TempDir dir("ulysses-tp-resume");
    (void)run(saved, {0, steps - 1, {}, dir.path()});
    for (const auto& [tp, sp, stage] : {std::tuple{1, 4, 1}, std::tuple{2, 1, 2}}) {
      Layout resumed{sp, 2, stage, Fault::none, false, false, true};
      resumed.tp = tp;
      const Run got = run(resumed, {steps - 1, steps, dir.path(), {}});
      const double error = test::max_difference(got.values, want);
      INFO("resumed at tp " << tp << ", sp " << sp << ", stage " << stage << ": " << error);
      CHECK(error <= 1e-10);
      CHECK(got.copies_differ == 0.0);
    }
  }
  // Negative control: a rank fed its sp neighbour's positions.
  Layout wrong{2, 1, 3, Fault::wrong_slice};
  wrong.tp = 2;
  CHECK(test::max_difference(run(wrong).values,
                             reference(test::tp_tiny(), test::micro_rows * accumulation)) > 1e-4);
  // Ulysses with Megatron's sequence parallelism, and heads that do not split over tp * sp, are
  // refused naming the keys.
  const auto refusals = testing::per_rank<std::string>(4, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .cp = 2}));
    std::string out = testing::thrown_message([&] {
      nn::GPT<double> model(test::tp_tiny(), TensorParallel(groups.tp(), true),
                            SequenceParallel(groups.cp()));
    });
    nn::GPTConfig six = test::tp_tiny();
    six.num_heads = 2;  // 2 heads over tp 2 x sp 2
    out += " | " + testing::thrown_message([&] {
             nn::GPT<double> model(six, TensorParallel(groups.tp()), SequenceParallel(groups.cp()));
           });
    return out;
  });
  for (const std::string& r : refusals) {
    CHECK_THAT(r, Catch::Contains("with tensor_parallel.sequence_parallel is not supported") &&
                      Catch::Contains("n_head (num_heads) = 2 is not divisible by "
                                      "tensor_parallel.tp_size * sp = 2 * 2"));
  }
}

TEST_CASE("Ulysses GPT: f32 AdamW from a DeepSpeed config within 2e-5 of the reference",
          "[unit][ulysses]") {
  // tiny() (2 heads, the other engine tests' T = 6) at sp 2 x dp 2, stage 3, against the f32
  // reference of the other engine tests (DeepSpeed's no-decay groups).
  const int dp = 2, sp = 2, acc = 2, f32_steps = 3;
  const auto want =
      test::reference_adamw(test::micro_rows * acc * dp, f32_steps, test::adamw_hyper(), 1.0);
  const auto errors = testing::per_rank<double>(sp * dp, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.cp = sp, .dp = dp}));
    const SequenceParallel group(groups.cp());
    nn::GPT<float> model(test::tiny(), {}, group);
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, groups, test::adamw_config(3, acc, 1.0),
                                                     options);
    for (int step = 0; step < f32_steps; ++step) {
      const test::GlobalBatch b(test::micro_rows * acc * dp, step, test::tiny().vocab_size);
      for (int m = 0; m < acc; ++m) {
        const engine::MicroBatch whole = b.micro(m, groups.dp().rank(), dp);
        const parallel::SequenceSlice mine(whole.tokens, whole.targets, whole.batch, whole.seq_len,
                                           group);
        eng.forward({mine.tokens.data(), mine.targets.data(), mine.batch, mine.seq_len});
        eng.backward();
        eng.step();
      }
    }
    double w = 0;
    for (int u = 0; u < eng.num_units(); ++u) {
      const auto got = eng.gather_unit_values(u);
      const auto& ref = want[static_cast<std::size_t>(u)];
      if (got.size() != ref.size()) return static_cast<double>(INFINITY);
      for (std::size_t i = 0; i < got.size(); ++i) {
        w = zero::testing::worse(
            w, std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i])));
      }
    }
    return w;
  });
  for (double e : errors) {
    INFO("worst difference " << e);
    CHECK(e <= 2e-5);
  }
}

TEST_CASE("a sequence past max_seq_len over the Ulysses ranks is refused on every rank",
          "[unit][engine]") {
  // Each rank holds T/sp positions: only the last ranks' positions ran past the table, so they
  // threw while the first went on into the all-to-all without them.
  const auto errors = testing::per_rank<std::string>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.cp = 2, .dp = 1}));
    nn::GPT<double> model(test::tp_tiny(), {}, SequenceParallel(groups.cp()));
    engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(model, groups, test::AdamW64{},
                                                      test::tp_options(1));
    const std::int64_t local = 12;  // 24 positions in all; tp_tiny has 16
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(test::micro_rows * local), 1);
    return testing::thrown_message([&] {
      eng.forward({tokens.data(), tokens.data(), test::micro_rows, local});
    });
  });
  for (const auto& e : errors) {
    CHECK_THAT(e, Catch::Contains("sequence length 24") && Catch::Contains("max_positions 16"));
  }
}
