// Host forward + backward step of nn::GPT in f32 and in bf16 (bf16 storage, f32 compute),
// beside the raw GEMMs of the step's dominant shapes measured in the same run (so the fraction
// of GEMM speed reached is printed): for f32 rows the faster of OpenBLAS's own threaded sgemm and
// one oneDNN f32 matmul on the OpenMP threads (when zero::dnnl is linked); for bf16 rows
// the library of zero's bf16 path (ops/cpu/gemm.hpp: one oneDNN matmul on the OpenMP threads,
// or OpenBLAS's threaded cblas_sbgemm), otherwise the fallback zero uses (widen A and B to float,
// sgemm, round C to bf16), timed with the library's own threading; the rows name the path
// ("gemm"). Per-shape rows ("bench": "gemm") time those raw GEMMs and zero's own gemm<T> (the
// fixed tiles of gemm_tiles, one single-threaded library call per tile) on each shape.
//
// FLOPs per token: 6N + 6LCT (N parameters including the tied LM head's V*C; the attention term
// is PaLM's 12LCT halved for the causal mask). One JSON object per line.
//
//   ./gpt_step [--model gpt2|small-test|...] [--batch B] [--seq T] [--threads 1,2] [--steps 3]
//              [--dtype f32,bf16] [--gemm-shapes 1|0]
//              [--layers L --heads H --channels C --vocab V]  (override the preset's sizes)
//              [--peer PYTHON|none] [--logits-chunk-mib M]  (the LM head's logits bound; 0: none)
// After each (dtype, threads) row, a "gpt_step_ops" row gives one more step's time per layer kind.
//
// PyTorch peer: after zero's rows for a dtype, gpt_step runs benchmarks/nn/torch_peer.py (its
// source path is compiled in as ZERO_TORCH_PEER_SCRIPT) under --peer PYTHON (default: the
// environment's ZERO_PEER_PYTHON, else python3) with the same shape, dtype, thread counts and step
// count, one run after the other, never concurrently. The script is a plain nn.Module GPT-2 of the
// same shape and parameter count on the CPU, timed as here (one warm-up, best of --steps, gradients
// zeroed in place outside the timer). Its "gpt_step_peer" rows (fwd+bwd tokens/s, and ms with an
// AdamW step) are passed through, then one "gpt_step_vs_peer" row per (dtype, threads) gives
// zero_ms / peer_ms of fwd+bwd (unit "ratio", lower is better) and, as with_adamw_ratio, of
// fwd+bwd plus the AdamW step (both sides time forward, backward and AdamW together per step and
// take the best whole step). In bf16 the two AdamWs differ: zero updates an fp32 master and
// writes the rounded bf16 parameters back, PyTorch's updates the bf16 parameters (and bf16
// states) directly. When PYTHON cannot import torch the peer is skipped with one line on stderr;
// --peer none turns it off.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <nlohmann/json.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#endif

#include <optim/adam.hpp>
#include <optim/fused_io.hpp>
#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/gemm.hpp>

#include "../bench_flags.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using zero::bf16;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  (void)threads;
}

std::vector<std::string> split_list(const std::string& value) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= value.size()) {
    const std::size_t comma = std::min(value.find(',', start), value.size());
    if (comma > start) out.push_back(value.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// A forward shape of one step: out[m, n] = in[m, k] @ W[n, k]^T, as the model's Linear layers.
struct Mm {
  const char* name;
  std::int64_t m, n, k;
};

std::vector<Mm> step_shapes(std::int64_t tokens, std::int64_t C, std::int64_t V) {
  return {{"c_attn", tokens, 3 * C, C},
          {"attn.c_proj", tokens, C, C},
          {"c_fc", tokens, 4 * C, C},
          {"mlp.c_proj", tokens, C, 4 * C},
          {"lm_head", tokens, V, C}};
}

// Parallel bf16 <-> float conversion for the raw fallback baseline.
void widen_to(std::vector<float>& out, const std::vector<bf16>& in) {
  zero::ops::cpu::parallel_for(static_cast<std::int64_t>(in.size()), [&](std::int64_t i) {
    out[static_cast<std::size_t>(i)] = static_cast<float>(in[static_cast<std::size_t>(i)]);
  });
}
void round_to(std::vector<bf16>& out, const std::vector<float>& in) {
  zero::ops::cpu::parallel_for(static_cast<std::int64_t>(in.size()), [&](std::int64_t i) {
    out[static_cast<std::size_t>(i)] = bf16(in[static_cast<std::size_t>(i)]);
  });
}

// Seconds of one raw GEMM of shape s at the library's own threading (best of 3): sgemm for f32
// (or with onednn set, one oneDNN f32 matmul); for bf16 the library zero's path uses (one oneDNN
// matmul, or cblas_sbgemm, then rounding), else widen+sgemm+round as zero's fallback does.
template <class T>
double raw_gemm_seconds(const Mm& s, int threads, bool onednn = false) {
#if defined(ZERO_WITH_BLAS)
  std::vector<T> a(static_cast<std::size_t>(s.m * s.k), zero::convert<T>(0.5f));
  std::vector<T> b(static_cast<std::size_t>(s.n * s.k), zero::convert<T>(0.25f));
  std::vector<T> c(static_cast<std::size_t>(s.m * s.n));
  const int m = static_cast<int>(s.m), n = static_cast<int>(s.n), k = static_cast<int>(s.k);
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    openblas_set_num_threads(threads);
    const auto t0 = Clock::now();
    if constexpr (std::is_same_v<T, float>) {
      if (onednn) {  // one call outside an OpenMP region: oneDNN uses the OpenMP threads
#if defined(ZERO_WITH_DNNL)
        zero::ops::cpu::onednn_gemm<float>(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k,
                                           0.0f, c.data(), n, /*threaded=*/true);
#endif
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(),
                    k, 0.0f, c.data(), n);
      }
    } else if (zero::ops::cpu::onednn_gemm_usable<bf16>()) {  // one oneDNN call, OpenMP threads
#if defined(ZERO_WITH_DNNL)
      std::vector<float> c32(c.size());
      zero::ops::cpu::onednn_gemm<bf16>(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f,
                                        c32.data(), n, /*threaded=*/true);
      round_to(c, c32);
#endif
    } else if (const auto sbgemm = zero::ops::cpu::usable_sbgemm(); sbgemm != nullptr) {
      std::vector<float> c32(c.size());
      sbgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f,
             reinterpret_cast<const bfloat16*>(a.data()), k,
             reinterpret_cast<const bfloat16*>(b.data()), k, 0.0f, c32.data(), n);
      round_to(c, c32);
    } else {  // the conversions run on the OpenMP threads, the sgemm on OpenBLAS's
      std::vector<float> a32(a.size()), b32(b.size()), c32(c.size());
      widen_to(a32, a);
      widen_to(b32, b);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a32.data(), k, b32.data(),
                  k, 0.0f, c32.data(), n);
      round_to(c, c32);
    }
    best = std::min(best, seconds_since(t0));
  }
  openblas_set_num_threads(1);  // zero's gemm runs single-threaded BLAS per block
  return best;
#else
  (void)s, (void)threads, (void)onednn;
  return 0;
#endif
}

// Seconds of zero's gemm<T> on shape s at the current OpenMP thread count (best of 3).
template <class T>
double zero_gemm_seconds(const Mm& s) {
  using A = zero::compute_type_t<T>;
  std::vector<T> a(static_cast<std::size_t>(s.m * s.k), zero::convert<T>(0.5f));
  std::vector<T> b(static_cast<std::size_t>(s.n * s.k), zero::convert<T>(0.25f));
  std::vector<T> c(static_cast<std::size_t>(s.m * s.n));
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    zero::ops::cpu::gemm<T>(zero::ops::cpu::Trans::no, zero::ops::cpu::Trans::yes, s.m, s.n, s.k,
                            A(1), a.data(), s.k, b.data(), s.k, A(0), c.data(), s.n);
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

template <class T>
const char* dtype_name() {
  return std::is_same_v<T, float> ? "f32" : "bf16";
}

// The GEMM behind T's rows: the f32 path ("onednn", "sgemm" or "loop"), or the bf16 path.
template <class T>
const char* gemm_path() {
  if constexpr (std::is_same_v<T, float>) {
    return zero::ops::cpu::float_gemm_path();
  } else {
    return zero::ops::cpu::half_gemm_path<T>();
  }
}

// One JSON row per (dtype, threads): tokens/s of a training step beside the raw GEMM GFLOP/s of
// the step's forward shapes; per-shape rows when gemm_rows is set.
// The per-op breakdown of one more step: ms per layer kind (profile/op_times.hpp) and each
// kind's fraction of the step's summed op time.
template <class T>
void print_op_breakdown(zero::nn::GPT<T>& model, zero::nn::StepContext<T> ctx,
                        const std::string& model_name, int threads) {
  zero::profile::OpTimes times;
  ctx.op_times = &times;
  (void)model.forward(ctx);
  model.backward(ctx);
  const double total = times.total();
  std::string ms, fraction;
  for (const auto& [kind, s] : times.seconds()) {
    char item[160];
    std::snprintf(item, sizeof item, "%s\"%s\": %.2f", ms.empty() ? "" : ", ", kind.c_str(),
                  s * 1e3);
    ms += item;
    std::snprintf(item, sizeof item, "%s\"%s\": %.3f", fraction.empty() ? "" : ", ", kind.c_str(),
                  s / total);
    fraction += item;
  }
  std::printf(
      "{\"bench\": \"gpt_step_ops\", \"config\": {\"model\": \"%s\", \"B\": %lld, \"T\": "
      "%lld, \"dtype\": \"%s\", \"threads\": %d}, \"value\": %.2f, \"unit\": \"ms\", "
      "\"ms\": {%s}, \"fraction\": {%s}}\n",
      model_name.c_str(), static_cast<long long>(ctx.batch), static_cast<long long>(ctx.seq_len),
      dtype_name<T>(), threads, total * 1e3, ms.c_str(), fraction.c_str());
}

// One AdamW step over every unit with zero's fused driver (optim::AdamW), as a single-process
// trainer runs it after the backward: f32 parameters are their own master; bf16 keeps an fp32
// master per unit and writes the rounded bf16 parameters back in the same pass. The learning
// rate is 0 (the pass does the same work), so every row of a run steps the same weights and
// reports the same loss.
template <class T>
class AdamWStep {
 public:
  static zero::optim::AdamHyper hyper() {
    zero::optim::AdamHyper h = zero::optim::AdamW::default_hyper();
    h.lr = 0.0;
    h.weight_decay = 0.1;
    return h;
  }
  explicit AdamWStep(zero::nn::LocalParameters<zero::nn::GPT<T>>& params, int units)
      : params_(params), units_(units) {
    for (int u = 0; u < units; ++u) {
      const zero::Tensor<T> values = params.unit_values(u);
      optimizers_.emplace_back(static_cast<std::size_t>(values.numel()), hyper());
      if constexpr (!std::is_same_v<T, float>) {
        std::vector<float> master(static_cast<std::size_t>(values.numel()));
        for (std::size_t i = 0; i < master.size(); ++i) {
          master[i] = zero::convert<float>(values.data()[i]);
        }
        masters_.push_back(std::move(master));
      }
    }
  }
  void run() {
    for (int u = 0; u < units_; ++u) {
      const zero::Tensor<T> values = params_.unit_values(u), grads = params_.unit_grads(u);
      const auto n = static_cast<std::size_t>(values.numel());
      const std::span<const T> grad(grads.data(), n);
      auto& opt = optimizers_[static_cast<std::size_t>(u)];
      if constexpr (std::is_same_v<T, float>) {
        opt.step(zero::optim::FusedIo::over(std::span<float>(values.data(), n), grad));
      } else {
        std::vector<float>& master = masters_[static_cast<std::size_t>(u)];
        opt.step(zero::optim::FusedIo::over(std::span<float>(master), grad)
                     .write_back(std::span<T>(values.data(), n)));
      }
    }
  }

 private:
  zero::nn::LocalParameters<zero::nn::GPT<T>>& params_;
  int units_;
  std::vector<zero::optim::AdamW> optimizers_;
  std::vector<std::vector<float>> masters_;
};

// zero's best times of one configuration, for the peer comparison.
struct StepTimes {
  double fwd_bwd_ms = 0;     ///< forward + backward
  double with_adamw_ms = 0;  ///< forward + backward + the AdamW step, timed as one
};

// Returns zero's best times per thread count, for the peer comparison.
template <class T>
std::map<int, StepTimes> bench_model(const std::string& model_name, const zero::nn::GPTConfig& cfg,
                                     std::int64_t B, std::int64_t T_len, int steps,
                                     const std::vector<int>& thread_counts, bool gemm_rows) {
  zero::nn::GPT<T> model(cfg);
  zero::nn::LocalParameters<zero::nn::GPT<T>> params(model, 1234);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * T_len)), targets(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] =
        static_cast<std::int32_t>((i * 2654435761u) % static_cast<std::size_t>(cfg.vocab_size));
    targets[i] =
        static_cast<std::int32_t>((i * 40503u + 7) % static_cast<std::size_t>(cfg.vocab_size));
  }
  // Activations of one step: per block ~ (16C + 2*NH*T) values per token, plus logits twice.
  const std::size_t arena_bytes =
      static_cast<std::size_t>(B * T_len) * sizeof(T) *
          static_cast<std::size_t>(cfg.num_layers *
                                       (24 * cfg.channels + 2 * cfg.num_heads * T_len) +
                                   3 * cfg.vocab_size + 16 * cfg.channels) +
      (64 << 20);
  zero::Arena<> arena(arena_bytes, "activations");

  const double n_params = static_cast<double>(params.num_parameters());
  const double flops_per_token = 6.0 * n_params + 6.0 * static_cast<double>(cfg.num_layers) *
                                                      static_cast<double>(cfg.channels) *
                                                      static_cast<double>(T_len);
  const std::vector<Mm> shapes = step_shapes(B * T_len, cfg.channels, cfg.vocab_size);
  std::map<int, StepTimes> best_ms;
  AdamWStep<T> adamw(params, model.num_units());
  for (int threads : thread_counts) {
    set_threads(threads);
    double best = 1e30;
    float loss = 0;
    zero::nn::StepContext<T> ctx;
    ctx.arena = &arena;
    ctx.tokens = tokens.data();
    ctx.targets = targets.data();
    ctx.batch = B;
    ctx.seq_len = T_len;
    for (int s = 0; s < steps + 1; ++s) {  // the first step warms up
      params.zero_grads();
      const auto t0 = Clock::now();
      loss = zero::convert<float>(model.forward(ctx));
      model.backward(ctx);
      const double t = seconds_since(t0);
      if (s > 0) best = std::min(best, t);
    }
    // Forward, backward and AdamW timed together, best of whole steps, as the peer times its
    // step with AdamW: the best forward+backward plus the best AdamW of two loops would pair two
    // lucky runs that never happened in one step. The learning rate is 0, so the loss above holds.
    double best_with_adamw = 1e30;
    for (int s = 0; s < steps + 1; ++s) {
      params.zero_grads();
      const auto t0 = Clock::now();
      (void)model.forward(ctx);
      model.backward(ctx);
      adamw.run();
      if (s > 0) best_with_adamw = std::min(best_with_adamw, seconds_since(t0));
    }
    print_op_breakdown(model, ctx, model_name, threads);
    double gemm_flops = 0, raw_seconds = 0, sgemm_seconds = 0, onednn_seconds = 0;
    for (const Mm& s : shapes) {
      const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
      double raw = raw_gemm_seconds<T>(s, threads);
      if constexpr (std::is_same_v<T, float>) {  // the faster library is the baseline
        if (zero::ops::cpu::onednn_gemm_usable<float>()) {
          const double sgemm = raw;
          const double onednn = raw_gemm_seconds<T>(s, threads, /*onednn=*/true);
          raw = std::min(sgemm, onednn);
          sgemm_seconds += sgemm;
          onednn_seconds += onednn;
        }
      }
      gemm_flops += flops;
      raw_seconds += raw;
      if (gemm_rows) {
        const double own = zero_gemm_seconds<T>(s);
        std::printf(
            "{\"bench\": \"gemm\", \"config\": {\"model\": \"%s\", \"shape\": \"%s\", "
            "\"m\": %lld, \"n\": %lld, \"k\": %lld, \"dtype\": \"%s\", \"threads\": %d, "
            "\"path\": \"%s\"}, \"value\": %.1f, \"unit\": \"GFLOP/s\", "
            "\"raw_blas_gflops\": %.1f}\n",
            model_name.c_str(), s.name, static_cast<long long>(s.m), static_cast<long long>(s.n),
            static_cast<long long>(s.k), dtype_name<T>(), threads, gemm_path<T>(),
            flops / own / 1e9, raw > 0 ? flops / raw / 1e9 : 0.0);
      }
    }
    const double tokens_per_s = static_cast<double>(B * T_len) / best;
    const double gflops = flops_per_token * tokens_per_s / 1e9;
    const double gemm = raw_seconds > 0 ? gemm_flops / raw_seconds / 1e9 : 0.0;
    // f32 with oneDNN: "sgemm_gflops" is the faster library per shape; both are given.
    std::string raw_split;
    if (sgemm_seconds > 0 && onednn_seconds > 0) {
      char text[128];
      std::snprintf(text, sizeof text,
                    ", \"openblas_sgemm_gflops\": %.1f, \"onednn_sgemm_gflops\": %.1f",
                    gemm_flops / sgemm_seconds / 1e9, gemm_flops / onednn_seconds / 1e9);
      raw_split = text;
    }
    std::printf(
        "{\"bench\": \"gpt_step\", \"config\": {\"model\": \"%s\", \"params\": %.0f, "
        "\"B\": %lld, \"T\": %lld, \"dtype\": \"%s\", \"threads\": %d, \"blas\": %s, "
        "\"gemm\": \"%s\"}, \"value\": %.1f, \"unit\": \"tokens/s\", "
        "\"ms_per_step\": %.1f, \"ms_per_step_with_adamw\": %.1f, \"gflops\": %.1f, "
        "\"%s_gflops\": %.1f, \"fraction_of_%s\": %.3f, \"loss\": %.4f, "
        "\"activation_peak_mib\": %.1f, \"logits_chunk_mib\": %.0f%s}\n",
        model_name.c_str(), n_params, static_cast<long long>(B), static_cast<long long>(T_len),
        dtype_name<T>(), threads, zero::ops::cpu::gemm_uses_blas() ? "true" : "false",
        gemm_path<T>(), tokens_per_s, best * 1e3, best_with_adamw * 1e3, gflops,
        std::is_same_v<T, float> ? "sgemm" : "bf16_gemm", gemm,
        std::is_same_v<T, float> ? "sgemm" : "bf16_gemm", gemm > 0 ? gflops / gemm : 0.0,
        static_cast<double>(loss), static_cast<double>(arena.peak_bytes()) / (1 << 20),
        static_cast<double>(cfg.logits_chunk_bytes) / (1 << 20), raw_split.c_str());
    std::fflush(stdout);
    best_ms[threads] = {best * 1e3, best_with_adamw * 1e3};
  }
  return best_ms;
}

// `text` quoted for /bin/sh, so a path with spaces or quotes reaches popen's shell intact.
std::string shell_quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `command` under /bin/sh and returns its exit status (-1 when it did not exit normally),
// handing each line of its stdout to on_line.
template <class OnLine>
int run_lines(const std::string& command, OnLine on_line) {
  std::fflush(stdout);  // keep our rows ahead of anything the child prints
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string line;
  char chunk[4096];
  while (std::fgets(chunk, sizeof chunk, pipe) != nullptr) {
    line += chunk;
    if (line.back() != '\n') continue;  // a line longer than the chunk
    line.pop_back();
    on_line(line);
    line.clear();
  }
  if (!line.empty()) on_line(line);
  const int status = pclose(pipe);
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Empty when `python` can import torch, else why not (the last line it printed, or a status).
std::string peer_unavailable_reason(const std::string& python) {
  std::string last;
  const int status =
      run_lines(shell_quoted(python) + " -c 'import torch' 2>&1", [&](const std::string& line) {
        if (!line.empty()) last = line;
      });
  if (status == 0) return {};
  return last.empty() ? std::string("exit status ").append(std::to_string(status)) : last;
}

// Runs torch_peer.py for one dtype with the same shape, passes its rows through, and prints one
// "gpt_step_vs_peer" row per thread count that both sides measured.
void run_peer(const std::string& python, const std::string& model_name,
              const zero::nn::GPTConfig& cfg, std::int64_t B, std::int64_t T_len, int steps,
              const std::string& dtype, const std::vector<int>& thread_counts,
              const std::map<int, StepTimes>& zero_ms) {
  std::string threads;
  for (int t : thread_counts) {
    if (!threads.empty()) threads += ',';
    threads += std::to_string(t);
  }
  const std::string command =
      shell_quoted(python) + " " + shell_quoted(ZERO_TORCH_PEER_SCRIPT) + " --model " +
      shell_quoted(model_name) + " --layers " + std::to_string(cfg.num_layers) + " --heads " +
      std::to_string(cfg.num_heads) + " --channels " + std::to_string(cfg.channels) + " --vocab " +
      std::to_string(cfg.vocab_size) + " --positions " + std::to_string(cfg.max_seq_len) +
      " --batch " + std::to_string(B) + " --seq " + std::to_string(T_len) + " --dtype " + dtype +
      " --threads " + threads + " --steps " + std::to_string(steps);
  std::vector<std::string> vs_rows;
  const int status = run_lines(command, [&](const std::string& line) {
    std::printf("%s\n", line.c_str());
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!row.is_object() || row.value("bench", "") != "gpt_step_peer") return;
    const nlohmann::json& config = row.at("config");
    const auto params = config.at("params").get<std::int64_t>();
    if (params != cfg.num_parameters())
      std::fprintf(stderr, "gpt_step: the PyTorch peer has %lld parameters, zero's model %lld\n",
                   static_cast<long long>(params), static_cast<long long>(cfg.num_parameters()));
    const int t = config.at("threads").get<int>();
    const auto zero_it = zero_ms.find(t);
    if (zero_it == zero_ms.end()) return;
    const double peer_ms = row.at("ms_per_step").get<double>();
    const double peer_adamw_ms = row.value("ms_per_step_with_adamw", 0.0);
    const StepTimes& own = zero_it->second;
    char vs[640];
    std::snprintf(vs, sizeof vs,
                  "{\"bench\": \"gpt_step_vs_peer\", \"config\": {\"model\": \"%s\", \"B\": %lld, "
                  "\"T\": %lld, \"dtype\": \"%s\", \"threads\": %d, \"peer\": \"torch %s\"}, "
                  "\"value\": %.3f, \"unit\": \"ratio\", \"zero_ms_per_step\": %.1f, "
                  "\"peer_ms_per_step\": %.1f, \"with_adamw_ratio\": %.3f, "
                  "\"zero_ms_per_step_with_adamw\": %.1f, \"peer_ms_per_step_with_adamw\": %.1f}",
                  model_name.c_str(), static_cast<long long>(B), static_cast<long long>(T_len),
                  dtype.c_str(), t, config.value("torch", "?").c_str(), own.fwd_bwd_ms / peer_ms,
                  own.fwd_bwd_ms, peer_ms,
                  peer_adamw_ms > 0 ? own.with_adamw_ms / peer_adamw_ms : 0.0, own.with_adamw_ms,
                  peer_adamw_ms);
    vs_rows.emplace_back(vs);
  });
  for (const std::string& vs : vs_rows) std::printf("%s\n", vs.c_str());
  if (status != 0)
    std::fprintf(stderr, "gpt_step: the PyTorch peer (%s) exited with status %d\n", command.c_str(),
                 status);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "gpt2";
  std::int64_t B = 4, T = 64;
  int steps = 3;
  bool gemm_rows = true;
  std::vector<int> thread_counts = {1, 2};
  std::vector<std::string> dtypes = {"f32", "bf16"};
  std::int64_t layers = 0, heads = 0, channels = 0, vocab = 0;  // 0: the preset's
  double logits_chunk_mib = -1;                                 // < 0: GPTConfig's default
  const char* peer_env = std::getenv("ZERO_PEER_PYTHON");
  std::string peer_python = peer_env != nullptr && *peer_env != '\0' ? peer_env : "python3";
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i], value = zero::bench::value_arg("gpt_step", argc, argv, i);
    if (flag == "--model")
      model_name = value;
    else if (flag == "--layers")
      layers = zero::bench::integer_arg("gpt_step", flag, value.c_str(), 0);
    else if (flag == "--heads")
      heads = zero::bench::integer_arg("gpt_step", flag, value.c_str(), 0);
    else if (flag == "--channels")
      channels = zero::bench::integer_arg("gpt_step", flag, value.c_str(), 0);
    else if (flag == "--vocab")
      vocab = zero::bench::integer_arg("gpt_step", flag, value.c_str(), 0);
    else if (flag == "--batch")
      B = zero::bench::integer_arg("gpt_step", flag, value.c_str());
    else if (flag == "--seq")
      T = zero::bench::integer_arg("gpt_step", flag, value.c_str());
    else if (flag == "--steps")
      steps =
          static_cast<int>(zero::bench::integer_arg("gpt_step", flag, value.c_str(), 1, 1 << 20));
    else if (flag == "--peer")
      peer_python = value;
    else if (flag == "--gemm-shapes")
      gemm_rows = zero::bench::choice_arg("gpt_step", flag, value, {"0", "1"}) == 1;
    else if (flag == "--logits-chunk-mib")
      logits_chunk_mib = zero::bench::real_arg("gpt_step", flag, value.c_str());
    else if (flag == "--dtype")
      dtypes = split_list(value);
    else if (flag == "--threads") {
      thread_counts.clear();
      for (const std::string& t : split_list(value))
        thread_counts.push_back(
            static_cast<int>(zero::bench::integer_arg("gpt_step", flag, t.c_str(), 1, 1024)));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  zero::nn::GPTConfig cfg = zero::nn::GPTConfig::preset(model_name);
  if (layers > 0) cfg.num_layers = layers;
  if (heads > 0) cfg.num_heads = heads;
  if (channels > 0) cfg.channels = channels;
  if (vocab > 0) cfg.vocab_size = vocab;
  cfg.max_seq_len = std::max(cfg.max_seq_len, T);
  if (logits_chunk_mib >= 0) {
    cfg.logits_chunk_bytes = static_cast<std::int64_t>(logits_chunk_mib * (1 << 20));
  }
  if (layers > 0 || heads > 0 || channels > 0 || vocab > 0) {
    model_name = "custom-" + std::to_string(cfg.num_layers) + "L-" + std::to_string(cfg.channels) +
                 "C-" + std::to_string(cfg.num_heads) + "H-" + std::to_string(cfg.vocab_size) + "V";
  }
  cfg.validate();
  bool peer = peer_python != "none";
  if (peer) {
    const std::string reason = peer_unavailable_reason(peer_python);
    if (!reason.empty()) {
      std::fprintf(stderr, "gpt_step: PyTorch peer skipped: %s cannot import torch (%s)\n",
                   peer_python.c_str(), reason.c_str());
      peer = false;
    }
  }
  for (const std::string& dtype : dtypes) {
    std::map<int, StepTimes> zero_ms;
    if (dtype == "f32") {
      zero_ms = bench_model<float>(model_name, cfg, B, T, steps, thread_counts, gemm_rows);
    } else if (dtype == "bf16") {
      zero_ms = bench_model<bf16>(model_name, cfg, B, T, steps, thread_counts, gemm_rows);
    } else {
      std::fprintf(stderr, "unknown dtype %s (expected f32 or bf16)\n", dtype.c_str());
      return 2;
    }
    if (peer) run_peer(peer_python, model_name, cfg, B, T, steps, dtype, thread_counts, zero_ms);
  }
  return 0;
}
