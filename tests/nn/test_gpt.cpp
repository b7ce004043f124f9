// The GPT model end to end: parameter counts of the published sizes, a finite-difference check
// of every parameter's gradient of a tiny model in f64 (with and without dropout), activation
// checkpointing giving the same gradients, and results independent of the thread count.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#endif

#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/hand_written_gpt.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/worse.hpp"

using namespace zero;
using namespace zero::nn;

namespace {

struct TinyBatch {
  std::int64_t B = 2, T = 5;
  std::vector<std::int32_t> tokens, targets;
  TinyBatch(std::int64_t vocab, std::uint64_t seed) {
    for (std::int64_t i = 0; i < B * T; ++i) {
      tokens.push_back(static_cast<std::int32_t>((i * 7 + seed) % vocab));
      targets.push_back(static_cast<std::int32_t>((i * 5 + 3 + seed) % vocab));
    }
    targets[3] = -1;  // an ignored position
  }
};

template <class T>
StepContext<T> context(Arena<>& arena, const TinyBatch& b) {
  StepContext<T> ctx;
  ctx.arena = &arena;
  ctx.tokens = b.tokens.data();
  ctx.targets = b.targets.data();
  ctx.batch = b.B;
  ctx.seq_len = b.T;
  return ctx;
}

// Checks the gradient of every stride-th parameter (every one for stride 1) against central
// differences of the loss.
double whole_model_gradient_error(GPTConfig cfg, std::int64_t stride) {
  GPT<double> model(cfg);
  LocalParameters<GPT<double>> params(model, 42);
  Arena<> arena(16 << 20);
  const TinyBatch batch(cfg.vocab_size, 1);
  auto ctx = context<double>(arena, batch);
  model.forward(ctx);
  model.backward(ctx);
  REQUIRE(arena.used_bytes() == 0);  // every unit released what it took
  double worst = 0;
  for (int u = 0; u < model.num_units(); ++u) {
    auto values = params.unit_values(u);
    auto grads = params.unit_grads(u);
    for (std::int64_t i = u % stride; i < values.numel(); i += stride) {
      const double saved = values.at(i), eps = 1e-5;
      values.at(i) = saved + eps;
      auto c1 = context<double>(arena, batch);
      const double up = model.forward(c1);
      arena.reset();
      values.at(i) = saved - eps;
      auto c2 = context<double>(arena, batch);
      const double down = model.forward(c2);
      arena.reset();
      values.at(i) = saved;
      const double numeric = (up - down) / (2 * eps);
      const double scale = std::max({std::fabs(numeric), std::fabs(grads.at(i)), 1e-4});
      worst = zero::testing::worse(worst, std::fabs(numeric - grads.at(i)) / scale);
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("GPT-2 presets have the published parameter counts", "[unit][gpt]") {
  CHECK(GPTConfig::preset("gpt2").num_parameters() == 124439808);
  CHECK(GPTConfig::preset("gpt2-medium").num_parameters() == 354823168);
  CHECK(GPTConfig::preset("gpt2-large").num_parameters() == 774030080);
  CHECK(GPTConfig::preset("gpt2-xl").num_parameters() == 1557611200);
  CHECK_THROWS_AS(GPTConfig::preset("gpt5"), ConfigError);
  GPTConfig bad = GPTConfig::preset("tiny");
  bad.num_heads = 3;
  CHECK_THROWS_WITH(GPT<float>(bad), Catch::Contains("multiple of num_heads"));
  GPT<float> model(GPTConfig::preset("small-test"));
  LocalParameters<GPT<float>> params(model, 1);
  CHECK(params.num_parameters() == GPTConfig::preset("small-test").num_parameters());
  CHECK(model.unit_uses(model.head_unit()) == std::vector<int>{0});
  CHECK(model.unit_params(1)[2].name == "transformer.h.0.attn.c_attn.weight");
}

TEST_CASE("GPT gradients equal finite differences for every parameter (f64)", "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.num_heads = 4;  // head size 4
  CHECK(whole_model_gradient_error(cfg, 1) < 1e-5);
}

TEST_CASE("GPT gradients with dropout equal finite differences for every parameter (f64)",
          "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.dropout = 0.2;
  CHECK(whole_model_gradient_error(cfg, 1) < 1e-5);
}

TEST_CASE("GPT gradients with attention dropout equal finite differences for every parameter (f64)",
          "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.attn_dropout = 0.2;
  CHECK(whole_model_gradient_error(cfg, 1) < 1e-5);
  cfg.dropout = 0.1;  // both kinds together
  CHECK(whole_model_gradient_error(cfg, 1) < 1e-5);
}

TEST_CASE("attention dropout: off by default and when not training, same masks when recomputed",
          "[unit][gpt]") {
  const GPTConfig base = GPTConfig::preset("tiny");
  CHECK(base.attn_dropout == 0.0);
  GPTConfig bad = base;
  bad.attn_dropout = 1.0;
  CHECK_THROWS_WITH(GPT<double>(bad), Catch::Contains("attn_dropout"));
  const TinyBatch batch(base.vocab_size, 5);
  // loss(attn_dropout, training, checkpointing) and the gradients when training.
  auto run = [&](double p, bool training, bool ckpt, std::vector<double>* grads) {
    GPTConfig cfg = base;
    cfg.attn_dropout = p;
    cfg.checkpoint_activations = ckpt;
    GPT<double> model(cfg);
    LocalParameters<GPT<double>> params(model, 9);
    Arena<> arena(16 << 20);
    auto ctx = context<double>(arena, batch);
    ctx.training = training;
    const double loss = model.forward(ctx);
    if (grads != nullptr) {
      model.backward(ctx);
      for (int u = 0; u < model.num_units(); ++u) {
        auto g = params.unit_grads(u);
        grads->insert(grads->end(), g.begin(), g.end());
      }
    }
    return loss;
  };
  const double plain = run(0.0, true, false, nullptr);
  CHECK(run(0.3, false, false, nullptr) == plain);  // evaluation: no dropout
  std::vector<double> g_stored, g_recomputed;
  const double dropped = run(0.3, true, false, &g_stored);
  CHECK(dropped != plain);
  CHECK(run(0.3, true, true, &g_recomputed) == dropped);
  CHECK(g_stored == g_recomputed);  // checkpointing redraws the forward's masks
}

TEST_CASE("a backward after a forward with training off applies no dropout mask", "[unit][gpt]") {
  // The forward drops nothing outside training; the embedding's and blocks' backwards applied
  // the mask anyway, so gradients through an evaluation-mode pass were those of a dropped-out
  // model that never ran.
  const TinyBatch batch(GPTConfig::preset("tiny").vocab_size, 3);
  auto grads_of = [&]<class Model>(Model*, double p) {
    GPTConfig cfg = GPTConfig::preset("tiny");
    cfg.dropout = p;
    cfg.attn_dropout = p;
    Model model(cfg);
    LocalParameters<Model> params(model, 4);
    Arena<> arena(16 << 20);
    auto ctx = context<double>(arena, batch);
    ctx.training = false;
    model.forward(ctx);
    model.backward(ctx);
    std::vector<double> grads;
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u);
      grads.insert(grads.end(), g.begin(), g.end());
    }
    return grads;
  };
  CHECK(grads_of(static_cast<GPT<double>*>(nullptr), 0.3) ==
        grads_of(static_cast<GPT<double>*>(nullptr), 0.0));
  CHECK(grads_of(static_cast<HandWrittenGPT<double>*>(nullptr), 0.3) ==
        grads_of(static_cast<HandWrittenGPT<double>*>(nullptr), 0.0));
}

TEST_CASE("activation checkpointing gives the same loss and gradients", "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("tiny");
  const TinyBatch batch(cfg.vocab_size, 2);
  std::vector<std::vector<double>> grads[2];
  double losses[2];
  std::size_t peaks[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    cfg.checkpoint_activations = ckpt == 1;
    cfg.dropout = 0.1;  // the recomputed forward must draw the same masks
    GPT<double> model(cfg);
    LocalParameters<GPT<double>> params(model, 7);
    Arena<> arena(16 << 20);
    auto ctx = context<double>(arena, batch);
    losses[ckpt] = model.forward(ctx);
    peaks[ckpt] = arena.used_bytes();
    model.backward(ctx);
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u);
      grads[ckpt].emplace_back(g.begin(), g.end());
    }
  }
  CHECK(losses[0] == losses[1]);
  CHECK(grads[0] == grads[1]);
  CHECK(peaks[1] < peaks[0]);  // checkpointing keeps less after the forward pass
}

TEST_CASE("GPT results do not depend on the thread count (f32)", "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("small-test");
  TinyBatch batch(cfg.vocab_size, 3);
  batch.B = 2;
  batch.T = 32;
  batch.tokens.resize(64);
  batch.targets.resize(64);
  for (int i = 0; i < 64; ++i) {
    batch.tokens[static_cast<std::size_t>(i)] = (i * 13) % 512;
    batch.targets[static_cast<std::size_t>(i)] = (i * 17 + 1) % 512;
  }
  std::vector<float> results[2];
  for (int threads : {1, 2}) {
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
#if defined(ZERO_WITH_BLAS)
    openblas_set_num_threads(threads);
#endif
    GPT<float> model(cfg);
    LocalParameters<GPT<float>> params(model, 11);
    Arena<> arena(64 << 20);
    auto ctx = context<float>(arena, batch);
    auto& r = results[threads - 1];
    r.push_back(model.forward(ctx));
    model.backward(ctx);
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u);
      r.insert(r.end(), g.begin(), g.end());
    }
  }
  REQUIRE(results[0].size() == results[1].size());
  CHECK(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)) == 0);
}

TEST_CASE("a few SGD steps on a repeated batch lower the loss", "[unit][gpt]") {
  GPTConfig cfg = GPTConfig::preset("tiny");
  GPT<float> model(cfg);
  LocalParameters<GPT<float>> params(model, 5);
  const TinyBatch batch(cfg.vocab_size, 4);
  Arena<> arena(16 << 20);
  float first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    params.zero_grads();
    auto ctx = context<float>(arena, batch);
    const float loss = model.forward(ctx);
    model.backward(ctx);
    for (int u = 0; u < model.num_units(); ++u) {
      auto v = params.unit_values(u);
      auto g = params.unit_grads(u);
      for (std::int64_t i = 0; i < v.numel(); ++i) v.at(i) -= 0.5f * g.at(i);
    }
    if (step == 0) first = loss;
    last = loss;
  }
  CHECK(std::fabs(first - std::log(64.0f)) < 0.2f);  // starts near uniform over 64 tokens
  CHECK(last < 0.5f * first);
}
