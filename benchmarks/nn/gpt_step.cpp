// Host forward + backward step of nn::GPT, beside plain sgemm of the step's dominant shapes
// measured in the same run (so the fraction of GEMM speed reached is printed).
//
// FLOPs per token: 6N + 6LCT (N parameters including the tied LM head's V*C; the attention term
// is PaLM's 12LCT halved for the causal mask). One JSON object per line.
//
//   ./gpt_step [--model gpt2|small-test|...] [--batch B] [--seq T] [--threads 1,2] [--steps 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#endif

#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  (void)threads;
}

// GFLOP/s of OpenBLAS's own threaded sgemm on the forward shapes of one step (tokens x C times
// C x 3C, C x C, C x 4C, 4C x C, C x V), as out = in @ W^T like the model's Linear layers.
double sgemm_gflops(std::int64_t tokens, std::int64_t C, std::int64_t V, int threads) {
#if defined(ZERO_WITH_BLAS)
  struct Mm {
    std::int64_t m, n, k;
  };
  const std::vector<Mm> shapes = {{tokens, 3 * C, C}, {tokens, C, C}, {tokens, 4 * C, C},
                                  {tokens, C, 4 * C}, {tokens, V, C}};
  double flops = 0, best_total = 0;
  for (const Mm& s : shapes) flops += 2.0 * s.m * s.n * s.k;
  std::vector<float> a, b, c;
  for (int rep = 0; rep < 3; ++rep) {
    double total = 0;
    for (const Mm& s : shapes) {
      a.assign(static_cast<std::size_t>(s.m * s.k), 0.5f);
      b.assign(static_cast<std::size_t>(s.n * s.k), 0.25f);
      c.assign(static_cast<std::size_t>(s.m * s.n), 0.0f);
      openblas_set_num_threads(threads);
      const auto t0 = Clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(s.m),
                  static_cast<int>(s.n), static_cast<int>(s.k), 1.0f, a.data(),
                  static_cast<int>(s.k), b.data(), static_cast<int>(s.k), 0.0f, c.data(),
                  static_cast<int>(s.n));
      total += seconds_since(t0);
    }
    best_total = rep == 0 ? total : std::min(best_total, total);
  }
  return flops / best_total / 1e9;
#else
  (void)tokens, (void)C, (void)V, (void)threads;
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "gpt2";
  std::int64_t B = 4, T = 64;
  int steps = 3;
  std::vector<int> thread_counts = {1, 2};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") model_name = value;
    else if (flag == "--batch") B = std::atoll(value.c_str());
    else if (flag == "--seq") T = std::atoll(value.c_str());
    else if (flag == "--steps") steps = std::atoi(value.c_str());
    else if (flag == "--threads") {
      thread_counts.clear();
      for (const char* p = value.c_str(); *p;) {
        thread_counts.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }

  zero::nn::GPTConfig cfg = zero::nn::GPTConfig::preset(model_name);
  zero::nn::GPT<float> model(cfg);
  zero::nn::LocalParameters<zero::nn::GPT<float>> params(model, 1234);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * T)), targets(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 2654435761u) % static_cast<std::size_t>(cfg.vocab_size));
    targets[i] = static_cast<std::int32_t>((i * 40503u + 7) % static_cast<std::size_t>(cfg.vocab_size));
  }
  // Activations of one step: per block ~ (16C + 2*NH*T) floats per token, plus logits twice.
  const std::size_t arena_bytes = static_cast<std::size_t>(B * T) * sizeof(float) *
      static_cast<std::size_t>(cfg.num_layers * (24 * cfg.channels + 2 * cfg.num_heads * T) +
                               3 * cfg.vocab_size + 16 * cfg.channels) + (64 << 20);
  zero::Arena<> arena(arena_bytes, "activations");

  const double n_params = static_cast<double>(params.num_parameters());
  const double flops_per_token = 6.0 * n_params + 6.0 * static_cast<double>(cfg.num_layers) *
                                     static_cast<double>(cfg.channels) * static_cast<double>(T);
  for (int threads : thread_counts) {
    set_threads(threads);
    double best = 1e30;
    float loss = 0;
    for (int s = 0; s < steps + 1; ++s) {  // the first step warms up
      params.zero_grads();
      zero::nn::StepContext<float> ctx;
      ctx.arena = &arena;
      ctx.tokens = tokens.data();
      ctx.targets = targets.data();
      ctx.batch = B;
      ctx.seq_len = T;
      const auto t0 = Clock::now();
      loss = model.forward(ctx);
      model.backward(ctx);
      const double t = seconds_since(t0);
      if (s > 0) best = std::min(best, t);
    }
    const double tokens_per_s = static_cast<double>(B * T) / best;
    const double gflops = flops_per_token * tokens_per_s / 1e9;
    const double gemm = sgemm_gflops(B * T, cfg.channels, cfg.vocab_size, threads);
    std::printf("{\"bench\": \"gpt_step\", \"config\": {\"model\": \"%s\", \"params\": %.0f, "
                "\"B\": %lld, \"T\": %lld, \"threads\": %d, \"blas\": %s}, \"value\": %.1f, "
                "\"unit\": \"tokens/s\", \"ms_per_step\": %.1f, \"gflops\": %.1f, "
                "\"sgemm_gflops\": %.1f, \"fraction_of_sgemm\": %.3f, \"loss\": %.4f}\n",
                model_name.c_str(), n_params, static_cast<long long>(B), static_cast<long long>(T),
                threads, zero::ops::cpu::gemm_uses_blas() ? "true" : "false", tokens_per_s,
                best * 1e3, gflops, gemm, gemm > 0 ? gflops / gemm : 0.0, static_cast<double>(loss));
    std::fflush(stdout);
  }
  return 0;
}
