// The engine with a tensor-parallel GPT: every (tp, dp, stage) layout, with and without sequence
// parallelism, equals one process on the global batch over several AdamW steps with gradient
// clipping (f64 1e-10: a missing or doubled reduction, or a replicated parameter counted tp times
// in the clipping norm, is an O(1) error); f32 AdamW from a DeepSpeed config within 2e-5; a
// checkpoint saved at (tp 2, dp 2, stage 3) resumes at (tp 4, dp 1, stage 1) and
// (tp 1, dp 4, stage 2) equal to the uninterrupted run; GPT-2 weights exported from tp 2 are the
// whole tensors and import into tp 4; bad layouts are refused naming the key. With dropout,
// placed micro-batches equal the reference drawing the same masks (each rank its heads' and,
// under SP, its rows' part).
#include <catch2/catch.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"
#include "resume_check.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::TensorParallel;

namespace {

using test::clip;
using test::train;

struct Layout {
  int tp, dp, stage;
  bool sp;
};

template <int S>
std::vector<test::HeldParam> f64_rank(LocalComm& world, const Layout& l, int accumulation,
                                      int steps) {
  parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = l.tp, .dp = l.dp}));
  nn::GPT<double> model(test::tp_tiny(), TensorParallel(groups.tp(), l.sp));
  const engine::EngineOptions options = test::tp_options(accumulation);
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, test::AdamW64{}, options);
  train(eng, groups.dp().rank(), l.dp, accumulation, steps, test::tp_tiny().vocab_size);
  return test::held_params(eng);
}

}  // namespace

TEST_CASE(
    "Tensor-parallel GPT: every (tp, dp, stage) layout, with and without SP, equals the "
    "single-process reference (f64 AdamW, clipping)",
    "[unit][tp]") {
  const int accumulation = 2, steps = 3;
  for (int dp : {1, 2}) {
    const auto want =
        test::reference<double>(test::tp_tiny(), test::micro_rows * accumulation * dp, steps);
    for (int tp : {1, 2, 4}) {
      for (int stage = 0; stage <= 3; ++stage) {
        for (bool sp : {false, true}) {
          if (sp && tp == 1) continue;
          const Layout l{tp, dp, stage, sp};
          const auto ranks =
              testing::per_rank<std::vector<test::HeldParam>>(tp * dp, [&](LocalComm& world) {
                return test::with_stage(l.stage, [&](auto s) {
                  return f64_rank<decltype(s)::value>(world, l, accumulation, steps);
                });
              });
          double copies_differ = 0;
          const auto got = test::assemble(ranks, &copies_differ);
          INFO("tp " << tp << ", dp " << dp << ", stage " << stage << (sp ? ", SP" : ""));
          CHECK(test::max_difference(got, want) <= 1e-10);
          CHECK(copies_differ == 0.0);  // replicated parameters stay equal on every tp rank
        }
      }
    }
  }
}

TEST_CASE(
    "Tensor-parallel GPT with dropout: placed micro-batches equal the single-process reference "
    "at tp 2 and 4, with and without SP",
    "[unit][tp]") {
  // Residual, embedding and attention dropout: every tp rank draws its heads' part of the
  // attention's masks, and under SP its block of rows' part of the others (nn::DropoutShard), so
  // the run equals one process on the global batch, not only in distribution as Megatron's.
  const int accumulation = 2, steps = 2;
  nn::GPTConfig cfg = test::tp_tiny();
  cfg.dropout = 0.2;
  cfg.attn_dropout = 0.3;
  engine::EngineOptions options = test::tp_options(accumulation);
  options.seed = engine::EngineOptions{}.seed;  // the reference's masks
  auto run = [&](int tp, int dp, bool sp, bool placed) {
    return test::assemble(
        testing::per_rank<std::vector<test::HeldParam>>(tp * dp, [&](LocalComm& w) {
          parallel::ProcessGroups<LocalComm> groups(w, parallel::Grid({.tp = tp, .dp = dp}));
          nn::GPT<double> model(cfg, TensorParallel(groups.tp(), sp));
          engine::Engine<nn::GPT<double>, ZeroStage<3>> eng(model, groups, test::AdamW64{},
                                                            options);
          train(eng, groups.dp().rank(), dp, accumulation, steps, cfg.vocab_size, 0, placed);
          return test::held_params(eng);
        }));
  };
  for (const std::pair<int, int>& layout : {std::pair{2, 2}, std::pair{4, 1}}) {
    const int tp = layout.first, dp = layout.second;
    const auto want = test::reference<double>(cfg, test::micro_rows * accumulation * dp, steps);
    for (bool sp : {false, true}) {
      INFO("tp " << tp << ", dp " << dp << (sp ? ", SP" : ""));
      CHECK(test::max_difference(run(tp, dp, sp, true), want) <= 1e-10);
    }
    // Negative control: micro-batches that do not say where their rows sit draw other masks.
    CHECK(test::max_difference(run(tp, dp, true, false), want) > 1e-6);
  }
}

TEST_CASE(
    "Tensor-parallel GPT with its token table padded past the vocabulary: the real rows equal the "
    "unpadded single-process reference (f64 AdamW, clipping)",
    "[unit][tp]") {
  // 45 tokens in 64 rows: at tp 2 rank 1 holds tokens 32..44 and 19 padding rows, at tp 4 rank 3
  // holds only padding. Were the padding in the softmax (or its gradient not zero, or counted in
  // the clipping norm), every tensor would move off the 45-token model's by O(1e-3).
  const int accumulation = 2, steps = 3;
  nn::GPTConfig real = test::tp_tiny();
  real.vocab_size = 45;
  nn::GPTConfig padded = real;
  padded.padded_vocab_size = 64;
  const std::string wte = "transformer.wte.weight";
  for (const std::pair<int, int>& layout : {std::pair{1, 2}, std::pair{2, 2}, std::pair{4, 1}}) {
    const int tp = layout.first, dp = layout.second;
    const auto want = test::reference<double>(real, test::micro_rows * accumulation * dp, steps);
    auto got =
        test::assemble(testing::per_rank<std::vector<test::HeldParam>>(tp * dp, [&](LocalComm& w) {
          parallel::ProcessGroups<LocalComm> groups(w, parallel::Grid({.tp = tp, .dp = dp}));
          nn::GPT<double> model(padded, TensorParallel(groups.tp(), tp > 1));
          engine::Engine<nn::GPT<double>, ZeroStage<3>> eng(model, groups, test::AdamW64{},
                                                            test::tp_options(accumulation));
          train(eng, groups.dp().rank(), dp, accumulation, steps, real.vocab_size);
          return test::held_params(eng);
        }));
    INFO("tp " << tp << ", dp " << dp);
    REQUIRE(got.at(wte).size() == 64 * 16);
    got.at(wte).resize(45 * 16);  // the real rows
    CHECK(test::max_difference(got, want) <= 1e-10);
  }
}

TEST_CASE("Tensor-parallel GPT: f32 AdamW from a DeepSpeed config within 2e-5 of the reference",
          "[unit][tp]") {
  // tiny() has 2 heads: tp 2, dp 2, stage 3 with SP, against the f32 reference of the other
  // engine tests (DeepSpeed's no-decay groups).
  const int accumulation = 2, steps = 3, dp = 2;
  const auto want_units =
      test::reference_adamw(test::micro_rows * accumulation * dp, steps, test::adamw_hyper(), 1.0);
  const auto ranks = testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .dp = dp}));
    nn::GPT<float> model(test::tiny(), TensorParallel(groups.tp(), true));
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(
        model, groups, test::adamw_config(3, accumulation, 1.0), options);
    train(eng, groups.dp().rank(), dp, accumulation, steps, test::tiny().vocab_size);
    return test::held_params(eng);
  });
  nn::GPT<float> whole(test::tiny());
  test::LogicalValues want;
  for (int u = 0; u < whole.num_units(); ++u) {
    std::size_t offset = 0;
    for (const nn::ParamSpec& p : whole.unit_params(u)) {
      const auto& unit = want_units[static_cast<std::size_t>(u)];
      want[p.name].assign(unit.begin() + offset, unit.begin() + offset + p.numel());
      offset += static_cast<std::size_t>(p.numel());
    }
  }
  CHECK(test::max_difference(test::assemble(ranks), want) <= 2e-5);
}

TEST_CASE(
    "Tensor-parallel GPT: LAMB from a DeepSpeed config equals one rank, each trust ratio from "
    "its whole tensor's norms",
    "[unit][tp]") {
  // A weight split over tp ranks sums its parts' norms over the tp group, one whole on every tp
  // rank takes them once (tp rank 0's), and a ZeRO shard's parts sum over dp: each layout
  // trains as the one-rank engine on the same rows, and the replicated copies stay equal.
  const int accumulation = 2, steps = 3;
  const auto run = [&](int tp, int dp, int stage, bool sp) {
    double copies_differ = 0;
    const auto got =
        test::assemble(testing::per_rank<std::vector<test::HeldParam>>(
                           tp * dp,
                           [&](LocalComm& world) {
                             parallel::ProcessGroups<LocalComm> groups(
                                 world, parallel::Grid({.tp = tp, .dp = dp}));
                             nn::GPT<float> model(test::tp_tiny(), TensorParallel(groups.tp(), sp));
                             Config config = test::adamw_config(stage, accumulation * 2 / dp, 0.5);
                             config.optimizer->type = "LAMB";
                             config.optimizer->params["lr"] = {0.01};
                             engine::EngineOptions options;
                             options.activation_bytes = 32 << 20;
                             return test::with_stage(stage, [&](auto s) {
                               engine::Engine<nn::GPT<float>, ZeroStage<decltype(s)::value>> eng(
                                   model, groups, config, options);
                               train(eng, groups.dp().rank(), dp, accumulation * 2 / dp, steps,
                                     test::tp_tiny().vocab_size);
                               return test::held_params(eng);
                             });
                           }),
                       &copies_differ);
    CHECK(copies_differ == 0.0);
    return got;
  };
  const auto want = run(1, 1, 0, false);
  struct Layout {
    int tp, dp, stage;
    bool sp;
  };
  for (const Layout& l : {Layout{2, 1, 0, false}, Layout{4, 1, 1, true}, Layout{2, 2, 3, true},
                          Layout{2, 2, 2, false}}) {
    INFO("tp " << l.tp << ", dp " << l.dp << ", stage " << l.stage << (l.sp ? ", SP" : ""));
    const double worst = test::max_difference(run(l.tp, l.dp, l.stage, l.sp), want);
    INFO("worst difference " << worst);
    CHECK(worst <= 2e-6);  // f32 summation order: 2.8e-7 to 5.7e-7 measured
  }
}

namespace {

// tp_tiny with a vocabulary of `vocab` tokens (0: its own), its table padded to a multiple of tp
// as train_gpt pads it.
nn::GPTConfig tiny_with_vocab(std::int64_t vocab, int tp) {
  nn::GPTConfig cfg = test::tp_tiny();
  if (vocab == 0) return cfg;
  cfg.vocab_size = vocab;
  if (vocab % tp != 0) cfg.padded_vocab_size = (vocab + tp - 1) / tp * tp;
  return cfg;
}

// f32 AdamW from a config at (tp, dp, stage S): optionally loads `load` first, trains `steps`
// boundaries starting at first_step (a global batch of 8 rows whatever dp), optionally saves;
// tiny_with_vocab(vocab, tp)'s model.
template <int S>
std::vector<test::HeldParam> f32_rank(LocalComm& world, int tp, int dp, int first_step, int steps,
                                      const std::filesystem::path& load,
                                      const std::filesystem::path& save, std::int64_t vocab = 0) {
  parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp, .dp = dp}));
  const nn::GPTConfig cfg = tiny_with_vocab(vocab, tp);
  nn::GPT<float> model(cfg, TensorParallel(groups.tp(), tp > 1));
  const int accumulation = 4 / dp;
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(
      model, groups, test::adamw_config(S, accumulation, 1.0), options);
  if (!load.empty()) eng.load_checkpoint(load);
  train(eng, groups.dp().rank(), dp, accumulation, steps, cfg.vocab_size, first_step);
  if (!save.empty()) eng.save_checkpoint(save, "step2");
  return test::held_params(eng);
}

}  // namespace

TEST_CASE(
    "Tensor-parallel checkpoints: (tp 2, dp 2, stage 3) resumes at (tp 4, dp 1, stage 1) "
    "and (tp 1, dp 4, stage 2) equal to the uninterrupted run",
    "[unit][tp]") {
  struct Layout {
    int tp, dp, stage;
  };
  test::check_resumes(
      "zero-tp-ckpt", Layout{2, 2, 3}, {{4, 1, 1}, {1, 4, 2}},
      [](const Layout& l, int first, int steps, const std::filesystem::path& load,
         const std::filesystem::path& save) {
        return test::assemble(testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& w) {
          return test::with_stage(l.stage, [&](auto s) {
            return f32_rank<decltype(s)::value>(w, l.tp, l.dp, first, steps, load, save);
          });
        }));
      },
      [](const Layout& l) {
        return "tp " + std::to_string(l.tp) + ", dp " + std::to_string(l.dp) + ", ZeRO " +
               std::to_string(l.stage);
      });
}

TEST_CASE(
    "Tensor-parallel checkpoints of a table padded per tp: saved at tp 2 (46 rows) resume at tp 4 "
    "(48 rows) and tp 1 (45, unpadded) equal to the uninterrupted run",
    "[unit][tp]") {
  // train_gpt pads its vocabulary to a multiple of tp, so its table's shape depends on tp. The
  // rows in use are the vocabulary's: a checkpoint with another padding fills them, and the rows
  // past the stored ones start at zero.
  constexpr std::int64_t vocab = 45, C = 16;
  const std::string wte = "transformer.wte.weight";
  const auto dir = std::filesystem::temp_directory_path() /
                   ("zero-tp-padded-ckpt-" + std::to_string(static_cast<long>(::getpid())));
  std::filesystem::remove_all(dir);
  const auto run = [&](int tp, int dp, int stage, int first_step, int steps,
                       const std::filesystem::path& load, const std::filesystem::path& save) {
    return test::assemble(
        testing::per_rank<std::vector<test::HeldParam>>(tp * dp, [&](LocalComm& w) {
          return test::with_stage(stage, [&](auto s) {
            return f32_rank<decltype(s)::value>(w, tp, dp, first_step, steps, load, save, vocab);
          });
        }));
  };
  const auto saved = run(2, 2, 3, 0, 2, {}, dir);
  const auto continued = run(2, 2, 3, 2, 2, dir, {});
  const auto at_tp4 = run(4, 1, 1, 2, 2, dir, {});
  const auto at_tp1 = run(1, 4, 2, 2, 2, dir, {});
  REQUIRE(continued.at(wte).size() == 46 * C);
  REQUIRE(at_tp4.at(wte).size() == 48 * C);
  REQUIRE(at_tp1.at(wte).size() == vocab * C);
  const auto real_rows = [&](test::LogicalValues v) {
    v.at(wte).resize(vocab * C);
    return v;
  };
  CHECK(test::max_difference(real_rows(at_tp4), real_rows(continued)) <= 2e-5);
  CHECK(test::max_difference(at_tp1, real_rows(continued)) <= 2e-5);
  CHECK(test::max_difference(continued, saved) > 1e-4);  // the resumed steps did train
  // tp 4's two rows past the stored 46 started at zero and, never a token, stayed there (no
  // gradient, and decay keeps a zero at zero).
  for (std::int64_t i = 46 * C; i < 48 * C; ++i) CHECK(at_tp4.at(wte)[i] == 0.0);
  // A vocabulary of 47 tokens is another model: the checkpoint recorded 45 rows in use, so it is
  // refused (on every rank) though 48 rows could hold the 46 stored.
  const auto refused = testing::per_rank<std::string>(2, [&](LocalComm& w) {
    parallel::ProcessGroups<LocalComm> groups(w, parallel::Grid({.tp = 2}));
    nn::GPT<float> model(tiny_with_vocab(47, 2), TensorParallel(groups.tp()));
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, groups, test::adamw_config(1, 1, 1.0),
                                                     engine::EngineOptions{});
    return testing::thrown_message([&] { eng.load_checkpoint(dir); });
  });
  for (const std::string& m : refused) {
    CHECK_THAT(m, Catch::Contains("tensor 'transformer.wte.weight' comes from a table with 45 rows "
                                  "in use (its vocabulary) but the model's has 47"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("Tensor-parallel GPT-2 weights: exported whole from tp 2, imported at tp 4",
          "[unit][tp]") {
  const auto file =
      std::filesystem::temp_directory_path() /
      ("zero-tp-weights-" + std::to_string(static_cast<long>(::getpid())) + ".safetensors");
  auto run = [&](int tp, int dp, bool load) {
    return test::assemble(
        testing::per_rank<std::vector<test::HeldParam>>(tp * dp, [&](LocalComm& world) {
          parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp, .dp = dp}));
          nn::GPT<float> model(test::tp_tiny(), TensorParallel(groups.tp()));
          engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(
              model, groups, test::adamw_config(3, 1, 1.0), engine::EngineOptions{});
          if (load) {
            engine::load_gpt2_weights(eng, file);
          } else {
            train(eng, groups.dp().rank(), dp, 1, 1, test::tp_tiny().vocab_size);
            engine::save_gpt2_weights(eng, file);
          }
          return test::held_params(eng);
        }));
  };
  const auto saved = run(2, 2, false);
  const auto loaded = run(4, 1, true);
  CHECK(test::max_difference(saved, loaded) == 0.0);
  const io::SafetensorsReader reader(file);
  CHECK(reader.info("transformer.h.0.attn.c_attn.weight").shape ==
        std::vector<std::int64_t>{16, 48});  // whole, Conv1D [in, out]
  std::filesystem::remove(file);
}

TEST_CASE(
    "Tensor-parallel GPT-2 weights with a padded vocabulary: the file holds the real tokens' rows",
    "[unit][tp]") {
  // A vocabulary of 63 tokens is padded to 64 rows at tp 2 (Megatron's padding, so each rank
  // holds 32). GPT-2 files were refused at such a tp: the import needs the padding rows zero and
  // the export only the real rows.
  const auto stem = std::filesystem::temp_directory_path() /
                    ("zero-tp-vocab-" + std::to_string(static_cast<long>(::getpid())));
  const auto original = stem.string() + "-63.safetensors",
             again = stem.string() + "-again.safetensors";
  const std::string wte = "transformer.wte.weight";
  // tp 1, 63 tokens: one step, then the file.
  testing::per_rank<int>(2, [&](LocalComm& world) {
    nn::GPTConfig cfg = test::tp_tiny();
    cfg.vocab_size = 63;
    nn::GPT<float> model(cfg);
    engine::Engine<nn::GPT<float>, ZeroStage<2>> eng(model, world, test::adamw_config(2, 1, 1.0),
                                                     engine::EngineOptions{});
    train(eng, world.rank(), 2, 1, 1, 63);
    engine::save_gpt2_weights(eng, original);
    return 0;
  });
  // tp 2, 64 rows: imported and exported again, the table's rows in use (63) saying which rows
  // the file holds.
  const auto padded =
      test::assemble(testing::per_rank<std::vector<test::HeldParam>>(4, [&](LocalComm& world) {
        parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .dp = 2}));
        nn::GPTConfig cfg = test::tp_tiny();
        cfg.vocab_size = 63;
        cfg.padded_vocab_size = 64;
        nn::GPT<float> model(cfg, TensorParallel(groups.tp()));
        engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(
            model, groups, test::adamw_config(3, 1, 1.0), engine::EngineOptions{});
        engine::load_gpt2_weights(eng, original);
        engine::save_gpt2_weights(eng, again, DType::f32);
        return test::held_params(eng);
      }));
  const io::SafetensorsReader a(original), b(again);
  CHECK(b.info(wte).shape == std::vector<std::int64_t>{63, 16});
  REQUIRE(a.tensors().size() == b.tensors().size());
  for (const auto& t : a.tensors()) {
    INFO(t.name);
    CHECK(a.read_vector<float>(t.name) == b.read_vector<float>(t.name));  // bit for bit, f32
  }
  const auto& rows = padded.at(wte);
  REQUIRE(rows.size() == 64 * 16);
  const std::vector<float> from_file = a.read_vector<float>(wte);
  for (std::size_t i = 0; i < from_file.size(); ++i) CHECK(rows[i] == from_file[i]);
  for (std::size_t i = from_file.size(); i < rows.size(); ++i) CHECK(rows[i] == 0.0);  // padding
  // More tokens than rows is refused on every rank.
  const auto refused = testing::per_rank<std::string>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2}));
    nn::GPT<float> model(test::tp_tiny(), TensorParallel(groups.tp()));
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, groups, test::adamw_config(1, 1, 1.0),
                                                     engine::EngineOptions{});
    return testing::thrown_message([&] { engine::save_gpt2_weights(eng, again, DType::f32, 65); });
  });
  for (const auto& m : refused) {
    CHECK_THAT(m, Catch::Contains("vocab_size 65 is more than the 64 rows"));
  }
  std::filesystem::remove(original);
  std::filesystem::remove(again);
}

TEST_CASE(
    "Tensor-parallel GPT with SP: the replicated parameters' gradients are all-reduced over tp "
    "once per accumulation window, in its last backward, at every stage",
    "[unit][tp]") {
  // Under SP a backward's other tp collectives gather and reduce-scatter rows: its all-reduces
  // on the tp group are the sums of the gradients computed on row shards, ln_1, ln_2 and the two
  // row-parallel biases of each block, and ln_f. As Megatron's finalize_model_grads, they run
  // once per step: the window's last backward holds them all, the others none. (The layouts'
  // equality to the reference with accumulation is the first test's.)
  const int tp = 2, dp = 2, accumulation = 3, steps = 2;
  const nn::GPTConfig cfg = test::tp_tiny();
  const auto sums = static_cast<std::uint64_t>(4 * cfg.num_layers + 1);
  std::vector<std::uint64_t> want;
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < accumulation; ++m) want.push_back(m + 1 == accumulation ? sums : 0);
  }
  for (int stage = 0; stage <= 3; ++stage) {
    const auto seen = testing::per_rank<std::vector<std::uint64_t>>(tp * dp, [&](LocalComm& world) {
      parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp, .dp = dp}));
      nn::GPT<double> model(cfg, TensorParallel(groups.tp(), true));
      return test::with_stage(stage, [&](auto s) {
        engine::Engine<nn::GPT<double>, ZeroStage<decltype(s)::value>> eng(
            model, groups, test::AdamW64{}, test::tp_options(accumulation));
        std::vector<std::uint64_t> per_backward;
        for (int step = 0; step < steps; ++step) {
          const test::GlobalBatch b(test::micro_rows * accumulation * dp, step, cfg.vocab_size);
          for (int m = 0; m < accumulation; ++m) {
            eng.forward(b.micro(m, groups.dp().rank(), dp));
            auto logger = std::make_shared<parallel::CommLogger>();
            groups.tp().set_logger(logger);
            eng.backward();
            groups.tp().set_logger(nullptr);
            per_backward.push_back(logger->total(parallel::CommOp::all_reduce).count);
            eng.step();
          }
        }
        return per_backward;
      });
    });
    INFO("stage " << stage);
    for (const auto& r : seen) CHECK(r == want);
  }
}

TEST_CASE("Tensor-parallel GPT: sizes that do not split are refused naming the key", "[unit][tp]") {
  const auto messages = testing::per_rank<std::string>(4, [](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 4}));
    nn::GPTConfig cfg = test::tp_tiny();
    cfg.num_heads = 2;
    std::string out =
        testing::thrown_message([&] { nn::GPT<double> m(cfg, TensorParallel(groups.tp())); });
    cfg = test::tp_tiny();
    cfg.vocab_size = 66;
    out +=
        "|" + testing::thrown_message([&] { nn::GPT<double> m(cfg, TensorParallel(groups.tp())); });
    // A tp model under an engine whose groups have no tensor-parallel axis.
    nn::GPT<double> m(test::tp_tiny(), TensorParallel(groups.tp()));
    out += "|" + testing::thrown_message([&] {
             engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(
                 m, world, [](int, std::span<double>, std::span<const double>) {});
           });
    // A block built alone (a user's model) is checked as LayerGPT's are: 6 heads over 4 ranks
    // ran 1.5 heads per rank as one head, without a word.
    nn::GPTConfig six = test::tp_tiny();
    six.num_heads = 6;
    six.channels = 24;
    nn::Sequential<double> unit;
    out += "|" + testing::thrown_message(
                     [&] { nn::add_gpt_block(unit, six, 0, TensorParallel(groups.tp())); });
    return out;
  });
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("tensor_parallel.tp_size = 4") && Catch::Contains("n_head") &&
                      Catch::Contains("vocab_size (66)") &&
                      Catch::Contains("tensor-parallel group of 4 ranks") &&
                      Catch::Contains("n_head (num_heads) (6)"));
  }
}
