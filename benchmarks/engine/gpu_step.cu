// gpu_step: the engine's whole training step (forward, backward, reductions, AdamW) on one GPU:
// GPT-2 124M in bf16 (B=8, T=1024 by default) through Engine<GPT<bf16>, ZeroStage<S>,
// Precision<bf16>, Compute<Cuda>> over a one-rank CudaLocalComm, at stages 0, 2 and 3 with the
// optimizer on the device, and at stage 2 with Offload<CPU> (the host optimizer over pinned
// states): its host update run in step() (the default), deferred to the next forward
// (overlap_offload_update), and delayed by one step on a thread of its own while the device runs
// the next window (delayed_param_update, ZeRO-Offload's DPU). Each line reports tokens/s and the
// model FLOP utilisation: 6N + 6LCT FLOPs per token (N parameters, L layers, C channels, T
// positions) against a 4096^3 bf16 cuBLASLt GEMM measured in the same run (mfu_vs_gemm) and against
// the card's datasheet dense bf16 peak where the card is known (mfu_vs_peak); then stage 3 and
// Offload<CPU> as ratios of their baselines in the same run. Each run's line also has
// host_phase_ms: the engine's host-side phase timers per step (forward and backward include their
// waits; step includes the host optimizer, the deferred updates that the next forward applies too,
// so they count in both) and fenced_ms: one more step with the device synchronized after its
// forward, backward and step, the device time of each (the optimizer's and the reductions' share of
// the step). The LM head computes its loss in chunks of rows whose logits fit
// GPTConfig::logits_chunk_bytes (--logits-chunk-mib, the library's 256 MiB by default: 4 chunks at
// B=8, T=1024, their gradients computed in the training forward); one more run at stage 0 holds the
// whole batch's logits (0: no chunks, two logits-sized buffers), and
// gpu_step_whole_logits_vs_chunked is its step time over stage 0's; one more holds every GEMM
// shape's algorithm to the fastest of cuBLASLt's candidates (ZERO_GEMM_TUNING=measured), and
// gpu_step_gemm_measured_vs_heuristic is its step time over stage 0's; one more takes the attention
// backward's dq in its dk/dv kernel (ZERO_ATTENTION_BACKWARD=fused_dq), and
// gpu_step_attention_fused_dq_vs_two_kernels is its step time over stage 0's. Five more runs take
// --accumulation micro-batches a step (4 by default: 32768 tokens at B=8, T=1024; GPT-2's own
// batch was 0.5M): stage 2 on the device, and Offload<CPU> updating in step() and delayed, each
// with every micro-step's shards folded into the pinned shards (the default) and with the
// window's shards summed on the device (accumulate_grads_on_device): the host update's cost
// spread over as many micro-batches as a step commonly has (gpu_step_offload_vs_device_accumulated,
// gpu_step_offload_on_device_vs_device_accumulated,
// gpu_step_offload_delayed_vs_device_accumulated,
// gpu_step_offload_delayed_on_device_vs_device_accumulated). One more Offload<CPU> run at one
// micro-batch keeps the last units' states on the device (EngineOptions::offload_ratio,
// --offload-ratio, 0.3 by default: ZeRO-Offload++'s Twin-Flow), so the host updates that share
// while the device updates the rest (gpu_step_offload_twin_flow_vs_device), and one more does so
// with the host's share delayed a step beside the next window (delayed_param_update: the kept
// units update in step(), on time; --offload-ratio-delayed, 0.5 by default: the host's share then
// has the whole next window to hide behind; gpu_step_offload_twin_flow_delayed_vs_device).
// --runs runs only the named runs (run_names below; a profiler's shorter run) and the ratios whose
// two runs ran. Prints one JSON object per line. Without a GPU it says so and exits 0.
//   gpu_step [--batch B] [--seq T] [--steps N] [--warmup W] [--model gpt2|gpt2-medium|...]
//            [--activation-gib G] [--logits-chunk-mib M] [--accumulation A]
//            [--offload-ratio R] [--offload-ratio-delayed R] [--runs stage0,offload_delayed,...]
#include <zero/engine/cuda_backend.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <parallel/comm/cuda_local_comm.cuh>
#include <zero/config/config.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/ops/cuda/gemm.cuh>
#include <zero/profile/mfu.hpp>
#include <zero/profile/step_timers.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

// Inside zero::bench rather than `using namespace zero`: a using-directive at global scope makes
// `cuda` ambiguous (zero::cuda, CCCL's ::cuda) in the stubs nvcc generates for CUB's kernels.
namespace zero::bench {
namespace {

struct Shape {
  std::int64_t batch = 8, seq = 1024;
  int steps = 10, warmup = 2;
  std::string model = "gpt2";
  double activation_gib = 24.0;
  double logits_chunk_mib = -1;        // GPTConfig::logits_chunk_bytes in MiB; < 0: the library's
  std::string runs;                    // --runs: a comma-separated subset of run_names; empty: all
  int accumulation = 4;                // micro-batches a step of the *_accumulated runs
  double offload_ratio = 0.3;          // the offload_twin_flow run's EngineOptions::offload_ratio
  double offload_ratio_delayed = 0.5;  // ... and the offload_twin_flow_delayed run's
};

/// The runs, in the order they run (--runs picks some: a profiler's shorter run).
inline constexpr const char* run_names[] = {"stage0",
                                            "stage0_whole_logits",
                                            "stage0_gemm_measured",
                                            "stage0_attention_fused_dq",
                                            "stage2",
                                            "stage3",
                                            "offload",
                                            "offload_deferred",
                                            "offload_delayed",
                                            "offload_twin_flow",
                                            "offload_twin_flow_delayed",
                                            "stage2_accumulated",
                                            "offload_accumulated",
                                            "offload_on_device_accumulated",
                                            "offload_delayed_accumulated",
                                            "offload_delayed_on_device_accumulated"};

/// v as JSON text with %g's digits ("0.3", not std::to_string's "0.300000").
std::string json_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

/// Whether --runs (a comma-separated list) names run, or is empty.
bool wanted(const Shape& s, const std::string& run) {
  if (s.runs.empty()) return true;
  return ("," + s.runs + ",").find("," + run + ",") != std::string::npos;
}

/// The bf16 rate of a 4096^3 cuBLASLt GEMM in TFLOP/s (mean of repeats after a warm-up).
double gemm_tflops(int repeats) {
  const std::int64_t G = 4096;
  bf16 *a = nullptr, *b = nullptr, *c = nullptr;
  const std::size_t bytes = static_cast<std::size_t>(G * G) * sizeof(bf16);
  ZERO_CUDA_CHECK(cudaMalloc(&a, bytes));
  ZERO_CUDA_CHECK(cudaMalloc(&b, bytes));
  ZERO_CUDA_CHECK(cudaMalloc(&c, bytes));
  ZERO_CUDA_CHECK(cudaMemset(a, 0x3c, bytes));  // small finite bf16 values
  ZERO_CUDA_CHECK(cudaMemset(b, 0x3c, bytes));
  ops::cuda::GemmContext ctx(nullptr);
  const auto run = [&] {
    ops::cuda::gemm<bf16>(ctx, ops::cuda::Trans::no, ops::cuda::Trans::no, G, G, G, 1.0f, a, G, b,
                          G, 0.0f, c, G, nullptr);
  };
  run();
  ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r) run();
  ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * G * G * G * repeats / s / 1e12;
}

/// The DeepSpeed config of one run: AdamW, clipping 1.0, bf16, the stage, optionally the
/// optimizer offloaded to the cpu, accumulation micro-batches a step.
Config step_config(const Shape& s, int stage, bool offload, int accumulation = 1) {
  std::string json = R"({"train_micro_batch_size_per_gpu": )" + std::to_string(s.batch) +
                     R"(, "gradient_accumulation_steps": )" + std::to_string(accumulation) +
                     R"(, "gradient_clipping": 1.0,
      "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                    "eps": 1e-8, "weight_decay": 0.1}},
      "zero_optimization": {"stage": )" +
                     std::to_string(stage);
  if (offload) json += R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})";
  return Config::from_json_string(json + "}}");
}

struct Result {
  int accumulation = 1;          // micro-batches a step
  bool grads_on_device = false;  // Offload<CPU>: EngineOptions::accumulate_grads_on_device
  double offload_ratio = 1.0;    // Offload<CPU>: EngineOptions::offload_ratio
  double tokens_per_s = 0, step_ms = 0, device_gib = 0, host_gib = 0;
  double loss = 0;
  // The engine's host-side phase timers per timed step (profile::StepTimers): where the host
  // spent the step (launching, waiting, the host optimizer under Offload<CPU>), not GPU time.
  double host_ms[profile::phase_count] = {};
  // One more step with the device synchronized after each call (forward, backward, step): the
  // device time of each (forward and backward summed over the step's micro-batches), which the
  // unfenced steps overlap with the host's launches.
  double fenced_forward_ms = 0, fenced_backward_ms = 0, fenced_step_ms = 0;
};

/// Where an Offload<CPU> engine runs its host update: in step() (the default), with the next
/// forward (EngineOptions::overlap_offload_update), or one step late beside the next window
/// (EngineOptions::delayed_param_update).
enum class HostUpdate { in_step, with_next_forward, delayed };

const char* host_update_name(HostUpdate h) {
  switch (h) {
    case HostUpdate::in_step:
      return "in step";
    case HostUpdate::with_next_forward:
      return "with the next forward";
    case HostUpdate::delayed:
      return "one step late, beside the next window";
  }
  return "?";
}

/// Trains warmup + steps steps of Eng on one rank and times the last steps (how: where an
/// Offload<CPU> engine runs its host update; grads_on_device: whether it sums a window's
/// gradient shards on the device; offload_ratio: the share of its states it offloads).
template <class Eng>
Result time_engine(const Shape& s, const nn::GPTConfig& gc, const Config& config,
                   HostUpdate how = HostUpdate::in_step, bool grads_on_device = false,
                   double offload_ratio = 1.0) {
  Result out;
  out.grads_on_device = grads_on_device;
  out.offload_ratio = offload_ratio;
  parallel::CudaLocalComm::run(1, [&](parallel::CudaLocalComm& comm) {
    nn::GPT<bf16> model(gc);
    engine::EngineOptions options;
    options.activation_bytes = static_cast<std::size_t>(s.activation_gib * (1 << 30));
    options.overlap_offload_update = how == HostUpdate::with_next_forward;
    options.delayed_param_update = how == HostUpdate::delayed;
    options.accumulate_grads_on_device = grads_on_device;
    options.offload_ratio = offload_ratio;
    Eng eng(model, comm, config, options);
    const int accumulation = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
    out.accumulation = accumulation;
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.batch * s.seq + 1));
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] =
          static_cast<std::int32_t>((i * 7919 + 13) % static_cast<std::size_t>(gc.vocab_size));
    }
    engine::MicroBatch batch;
    batch.tokens = tokens.data();
    batch.targets = tokens.data() + 1;
    batch.batch = s.batch;
    batch.seq_len = s.seq;
    const auto step = [&] {
      for (int a = 0; a < accumulation; ++a) {
        out.loss = static_cast<double>(static_cast<float>(eng.forward(batch)));
        eng.backward();
      }
      eng.step();
    };
    for (int w = 0; w < s.warmup; ++w) step();
    eng.synchronize();
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
    eng.timers().reset();
    eng.timers().enable();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < s.steps; ++i) step();
    eng.synchronize();
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
    eng.timers().enable(false);
    for (std::size_t p = 0; p < profile::phase_count; ++p) {
      out.host_ms[p] = eng.timers().seconds(static_cast<profile::Phase>(p)) * 1e3 / s.steps;
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.step_ms = secs * 1e3 / s.steps;
    out.tokens_per_s = static_cast<double>(s.batch * s.seq) * accumulation * s.steps / secs;
    const auto fence = [] {
      ZERO_CUDA_CHECK(cudaDeviceSynchronize());
      return std::chrono::steady_clock::now();
    };
    const auto ms_between = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    for (int a = 0; a < accumulation; ++a) {
      const auto f0 = fence();
      eng.forward(batch);
      const auto f1 = fence();
      eng.backward();
      const auto f2 = fence();
      out.fenced_forward_ms += ms_between(f0, f1);
      out.fenced_backward_ms += ms_between(f1, f2);
    }
    const auto f2 = fence();
    eng.step();
    eng.synchronize();
    out.fenced_step_ms = ms_between(f2, fence());
    const engine::MemoryReport r = eng.memory_report();
    out.device_gib = static_cast<double>(r.device_bytes()) / (1 << 30);
    out.host_gib = static_cast<double>(r.host_bytes) / (1 << 30);
  });
  return out;
}

template <int S, class Where>
using StepEngine =
    engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Offload<Where>, Compute<Cuda>>;

int run(const Shape& s) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu_step: no CUDA device visible; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  nn::GPTConfig gc = nn::GPTConfig::preset(s.model);
  if (s.seq > gc.max_seq_len) gc.max_seq_len = s.seq;
  if (s.logits_chunk_mib >= 0) {
    gc.logits_chunk_bytes = static_cast<std::int64_t>(s.logits_chunk_mib * (1 << 20));
  }
  nn::GPTConfig whole_logits = gc;
  whole_logits.logits_chunk_bytes = 0;
  // Every run but the tuned one takes cuBLASLt's heuristic, and every run but the fused one the
  // attention backward's two kernels, whatever the caller's environment.
  ::unsetenv("ZERO_GEMM_TUNING");
  ::unsetenv("ZERO_ATTENTION_BACKWARD");
  const std::string gpu = "\"gpu\": \"" + std::string(prop.name) + "\"";
  const double gemm = gemm_tflops(20);
  line("cublaslt_gemm_4096", gpu + ", \"dtype\": \"bf16\"", gemm, "TFLOP/s");
  const double peak = profile::datasheet_bf16_tflops(prop.name);

  std::int64_t params = 0;
  {
    nn::GPT<bf16> shape_only(gc);
    for (int u = 0; u < shape_only.num_units(); ++u) {
      for (const auto& p : shape_only.unit_params(u)) params += p.numel();
    }
  }
  const double per_token = profile::gpt_flops_per_token(params, gc.num_layers, gc.channels, s.seq);
  const auto report = [&](int stage, bool offload, const Result& r,
                          HostUpdate how = HostUpdate::in_step, const nn::GPTConfig* g = nullptr,
                          const char* gemm_tuning = "heuristic",
                          const char* attention_backward = "two_kernels") {
    const double tflops = per_token * r.tokens_per_s / 1e12;
    const std::int64_t chunk = (g != nullptr ? *g : gc).logits_chunk_bytes;
    const std::string chunk_mib = json_number(static_cast<double>(chunk) / (1 << 20));
    const std::string config =
        gpu + ", \"model\": \"" + s.model + "\", \"params\": " + std::to_string(params) +
        ", \"dtype\": \"bf16\", \"stage\": " + std::to_string(stage) + ", \"offload\": \"" +
        (offload ? "cpu" : "none") + "\"" +
        (offload ? std::string(", \"host_update\": \"") + host_update_name(how) +
                       "\", \"grad_accumulation\": \"" +
                       (r.grads_on_device ? "device" : "pinned shards") +
                       "\", \"offload_ratio\": " + json_number(r.offload_ratio)
                 : std::string()) +
        ", \"B\": " + std::to_string(s.batch) + ", \"T\": " + std::to_string(s.seq) +
        ", \"accumulation\": " + std::to_string(r.accumulation) +
        ", \"logits_chunk_mib\": " + chunk_mib +  // 0: the whole batch
        ", \"gemm_tuning\": \"" + gemm_tuning + "\", \"attention_backward\": \"" +
        attention_backward + "\"";
    using profile::Phase;
    const auto ms = [&](Phase p) { return r.host_ms[static_cast<std::size_t>(p)]; };
    // A NaN loss (a broken step) prints as null: JSON has no NaN.
    char loss[32] = "null";
    if (std::isfinite(r.loss)) std::snprintf(loss, sizeof loss, "%.4f", r.loss);
    char extra[1024];
    std::snprintf(extra, sizeof extra,
                  ", \"step_ms\": %.2f, \"model_tflops\": %.1f, \"mfu_vs_gemm\": %.3f, "
                  "\"mfu_vs_peak\": %s, \"peak_tflops\": %.1f, \"device_gib\": %.2f, "
                  "\"host_gib\": %.2f, \"loss\": %s, \"flops_per_token\": \"6N + 6LCT\", "
                  "\"host_phase_ms\": {\"forward\": %.2f, \"backward\": %.2f, \"step\": %.2f, "
                  "\"gather_wait\": %.2f, \"reduction_wait\": %.2f}, "
                  "\"fenced_ms\": {\"forward\": %.2f, \"backward\": %.2f, \"step\": %.2f}",
                  r.step_ms, tflops, tflops / gemm,
                  peak > 0 ? std::to_string(tflops / peak).c_str() : "null", peak, r.device_gib,
                  r.host_gib, loss, ms(Phase::forward), ms(Phase::backward), ms(Phase::step),
                  ms(Phase::gather_wait), ms(Phase::reduction_wait), r.fenced_forward_ms,
                  r.fenced_backward_ms, r.fenced_step_ms);
    line("gpu_step", config, r.tokens_per_s, "tokens/s", extra);
  };
  // Each run that --runs names (all by default); a ratio's line where both of its runs ran.
  std::optional<Result> s0, s0_whole, s0_tuned, s0_fused_dq, s2, s3, off, off_deferred, off_delayed,
      off_twin_flow, off_twin_flow_delayed, s2_acc, off_acc, off_on_device_acc, off_delayed_acc,
      off_delayed_on_device_acc;
  if (wanted(s, "stage0")) {
    s0 = time_engine<StepEngine<0, None>>(s, gc, step_config(s, 0, false));
    report(0, false, *s0);
  }
  if (wanted(s, "stage0_whole_logits")) {
    s0_whole = time_engine<StepEngine<0, None>>(s, whole_logits, step_config(s, 0, false));
    report(0, false, *s0_whole, HostUpdate::in_step, &whole_logits);
  }
  // Stage 0 with a variable of the environment set for the run alone.
  const auto stage0_with = [&](const char* variable, const char* value) {
    ::setenv(variable, value, 1);
    const Result r = time_engine<StepEngine<0, None>>(s, gc, step_config(s, 0, false));
    ::unsetenv(variable);
    return r;
  };
  // Every GEMM shape's algorithm measured (the layers' GemmContext reads ZERO_GEMM_TUNING when
  // the engine makes its kernels).
  if (wanted(s, "stage0_gemm_measured")) {
    s0_tuned = stage0_with("ZERO_GEMM_TUNING", "measured");
    report(0, false, *s0_tuned, HostUpdate::in_step, nullptr, "measured");
  }
  // The attention backward's dq fused into its dk/dv kernel (float atomics: dq's last bits vary
  // run to run; ZERO_ATTENTION_BACKWARD, read at each backward).
  if (wanted(s, "stage0_attention_fused_dq")) {
    s0_fused_dq = stage0_with("ZERO_ATTENTION_BACKWARD", "fused_dq");
    report(0, false, *s0_fused_dq, HostUpdate::in_step, nullptr, "heuristic", "fused_dq");
  }
  if (wanted(s, "stage2")) {
    s2 = time_engine<StepEngine<2, None>>(s, gc, step_config(s, 2, false));
    report(2, false, *s2);
  }
  if (wanted(s, "stage3")) {
    s3 = time_engine<StepEngine<3, None>>(s, gc, step_config(s, 3, false));
    report(3, false, *s3);
  }
  // Offload<CPU> as configured by default (every unit updated in step()), then with the host
  // updates deferred to the next forward, then delayed by one step, in the same run.
  if (wanted(s, "offload")) {
    off = time_engine<StepEngine<2, CPU>>(s, gc, step_config(s, 2, true));
    report(2, true, *off);
  }
  if (wanted(s, "offload_deferred")) {
    off_deferred = time_engine<StepEngine<2, CPU>>(s, gc, step_config(s, 2, true),
                                                   HostUpdate::with_next_forward);
    report(2, true, *off_deferred, HostUpdate::with_next_forward);
  }
  if (wanted(s, "offload_delayed")) {
    off_delayed =
        time_engine<StepEngine<2, CPU>>(s, gc, step_config(s, 2, true), HostUpdate::delayed);
    report(2, true, *off_delayed, HostUpdate::delayed);
  }
  // The last units' states kept on the device (Twin-Flow), updating in step().
  if (wanted(s, "offload_twin_flow")) {
    off_twin_flow = time_engine<StepEngine<2, CPU>>(s, gc, step_config(s, 2, true),
                                                    HostUpdate::in_step, false, s.offload_ratio);
    report(2, true, *off_twin_flow);
  }
  // ... with the offloaded units' update delayed a step (the kept units' in step()).
  if (wanted(s, "offload_twin_flow_delayed")) {
    off_twin_flow_delayed = time_engine<StepEngine<2, CPU>>(
        s, gc, step_config(s, 2, true), HostUpdate::delayed, false, s.offload_ratio_delayed);
    report(2, true, *off_twin_flow_delayed, HostUpdate::delayed);
  }
  // At --accumulation micro-batches a step, with every micro-step's shards folded into the
  // pinned shards or the window's summed on the device.
  if (wanted(s, "stage2_accumulated")) {
    s2_acc = time_engine<StepEngine<2, None>>(s, gc, step_config(s, 2, false, s.accumulation));
    report(2, false, *s2_acc);
  }
  if (wanted(s, "offload_accumulated")) {
    off_acc = time_engine<StepEngine<2, CPU>>(s, gc, step_config(s, 2, true, s.accumulation));
    report(2, true, *off_acc);
  }
  if (wanted(s, "offload_on_device_accumulated")) {
    off_on_device_acc = time_engine<StepEngine<2, CPU>>(
        s, gc, step_config(s, 2, true, s.accumulation), HostUpdate::in_step, true);
    report(2, true, *off_on_device_acc);
  }
  if (wanted(s, "offload_delayed_accumulated")) {
    off_delayed_acc = time_engine<StepEngine<2, CPU>>(
        s, gc, step_config(s, 2, true, s.accumulation), HostUpdate::delayed);
    report(2, true, *off_delayed_acc, HostUpdate::delayed);
  }
  if (wanted(s, "offload_delayed_on_device_accumulated")) {
    off_delayed_on_device_acc = time_engine<StepEngine<2, CPU>>(
        s, gc, step_config(s, 2, true, s.accumulation), HostUpdate::delayed, true);
    report(2, true, *off_delayed_on_device_acc, HostUpdate::delayed);
  }
  const std::string base = gpu + ", \"model\": \"" + s.model + "\"";
  const auto ratio = [&](const char* name, const std::string& config,
                         const std::optional<Result>& over, const std::optional<Result>& under,
                         const char* extra) {
    if (over && under) line(name, config, over->step_ms / under->step_ms, "x", extra);
  };
  ratio("gpu_step_stage3_vs_stage0", base, s3, s0,
        ", \"target\": \"<= 1.10 (stage 3 within 10% of stage 0 on one GPU)\"");
  ratio("gpu_step_whole_logits_vs_chunked", base + ", \"stage\": 0", s0_whole, s0,
        ", \"meaning\": \"stage 0 with the whole batch's logits held (logits_chunk_bytes 0) over "
        "stage 0 with the configured chunks\"");
  ratio("gpu_step_gemm_measured_vs_heuristic", base + ", \"stage\": 0", s0_tuned, s0,
        ", \"meaning\": \"stage 0 with each GEMM shape's algorithm measured (ZERO_GEMM_TUNING="
        "measured) over stage 0 with cuBLASLt's first heuristic answer (< 1: tuning is faster)\"");
  ratio("gpu_step_attention_fused_dq_vs_two_kernels", base + ", \"stage\": 0", s0_fused_dq, s0,
        ", \"meaning\": \"stage 0 with the attention backward's dq fused into its dk/dv kernel "
        "(ZERO_ATTENTION_BACKWARD=fused_dq) over stage 0 with its two kernels (< 1: fusing is "
        "faster)\"");
  // The Offload<CPU> step over the same step without offload, against the issue's target.
  const auto offload_ratio = [&](const char* name, const std::string& config,
                                 const std::optional<Result>& over,
                                 const std::optional<Result>& under, const char* meaning) {
    const std::string extra =
        std::string(", \"target\": \"<= 1.5 (Offload<CPU> step within 1.5x of no offload)\"") +
        (meaning != nullptr ? std::string(", \"meaning\": \"") + meaning + "\"" : std::string());
    ratio(name, config, over, under, extra.c_str());
  };
  offload_ratio("gpu_step_offload_vs_device", base + ", \"stage\": 2", off, s2, nullptr);
  ratio("gpu_step_offload_overlap_vs_in_step", base + ", \"stage\": 2", off_deferred, off,
        ", \"meaning\": \"Offload<CPU> step with the host update deferred to the next forward "
        "over the same step updating in step()\"");
  offload_ratio("gpu_step_offload_delayed_vs_device", base + ", \"stage\": 2", off_delayed, s2,
                "Offload<CPU> with delayed_param_update (the update of step t beside window t + 1, "
                "one step stale) over stage 2 without offload");
  offload_ratio("gpu_step_offload_twin_flow_vs_device",
                base + ", \"stage\": 2, \"offload_ratio\": " + json_number(s.offload_ratio),
                off_twin_flow, s2,
                "Offload<CPU> keeping the last units' states on the device (offload_ratio, "
                "Twin-Flow), updating in step(), over stage 2 without offload");
  offload_ratio("gpu_step_offload_twin_flow_delayed_vs_device",
                base + ", \"stage\": 2, \"offload_ratio\": " + json_number(s.offload_ratio_delayed),
                off_twin_flow_delayed, s2,
                "Offload<CPU> keeping the last units' states on the device (offload_ratio), the "
                "others' update delayed a step (delayed_param_update), over stage 2 without "
                "offload");
  const std::string accumulated =
      base + ", \"stage\": 2, \"accumulation\": " + std::to_string(s.accumulation);
  offload_ratio("gpu_step_offload_vs_device_accumulated", accumulated, off_acc, s2_acc,
                "Offload<CPU> folding every micro-step's gradient shards into the pinned shards "
                "over stage 2 without offload");
  offload_ratio("gpu_step_offload_on_device_vs_device_accumulated", accumulated, off_on_device_acc,
                s2_acc,
                "Offload<CPU> summing the window's gradient shards on the device "
                "(accumulate_grads_on_device) over stage 2 without offload");
  offload_ratio("gpu_step_offload_delayed_vs_device_accumulated", accumulated, off_delayed_acc,
                s2_acc,
                "Offload<CPU> with delayed_param_update, folding into the pinned shards, over "
                "stage 2 without offload, both at --accumulation micro-batches a step");
  offload_ratio("gpu_step_offload_delayed_on_device_vs_device_accumulated", accumulated,
                off_delayed_on_device_acc, s2_acc,
                "Offload<CPU> with delayed_param_update, summing the window's gradient shards on "
                "the device, over stage 2 without offload, both at --accumulation micro-batches "
                "a step");
  return 0;
}

}  // namespace
}  // namespace zero::bench

int main(int argc, char** argv) try {
  zero::bench::Shape s;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "gpu_step: %s needs a value\n", flag.c_str());
      return 2;
    }
    const char* v = argv[i + 1];
    if (flag == "--batch") {
      s.batch = zero::bench::integer_arg("gpu_step", flag, v);
    } else if (flag == "--seq") {
      s.seq = zero::bench::integer_arg("gpu_step", flag, v);
    } else if (flag == "--steps") {
      s.steps = static_cast<int>(zero::bench::integer_arg("gpu_step", flag, v, 1, 1 << 20));
    } else if (flag == "--warmup") {
      s.warmup = static_cast<int>(zero::bench::integer_arg("gpu_step", flag, v, 0, 1 << 20));
    } else if (flag == "--model") {
      s.model = v;
    } else if (flag == "--activation-gib") {
      s.activation_gib = zero::bench::real_arg("gpu_step", flag, v);
    } else if (flag == "--runs") {
      s.runs = v;
      for (std::size_t start = 0; start <= s.runs.size();) {
        const std::size_t end = std::min(s.runs.find(',', start), s.runs.size());
        const std::string run = s.runs.substr(start, end - start);
        if (std::find_if(std::begin(zero::bench::run_names), std::end(zero::bench::run_names),
                         [&](const char* name) { return run == name; }) ==
            std::end(zero::bench::run_names)) {
          std::string names;
          for (const char* name : zero::bench::run_names) {
            names += (names.empty() ? "" : ", ") + std::string(name);
          }
          std::fprintf(stderr, "gpu_step: --runs names no run \"%s\" (%s)\n", run.c_str(),
                       names.c_str());
          return 2;
        }
        start = end + 1;
      }
    } else if (flag == "--accumulation") {
      s.accumulation = static_cast<int>(zero::bench::integer_arg("gpu_step", flag, v, 1, 1 << 20));
    } else if (flag == "--offload-ratio") {
      s.offload_ratio = zero::bench::real_arg("gpu_step", flag, v);
    } else if (flag == "--offload-ratio-delayed") {
      s.offload_ratio_delayed = zero::bench::real_arg("gpu_step", flag, v);
    } else if (flag == "--logits-chunk-mib") {
      s.logits_chunk_mib = zero::bench::real_arg("gpu_step", flag, v);  // 0: the whole batch
    } else {
      std::fprintf(stderr,
                   "usage: gpu_step [--batch B] [--seq T] [--steps N] [--warmup W] "
                   "[--model gpt2|gpt2-medium|gpt2-large|gpt2-xl] [--activation-gib G] "
                   "[--logits-chunk-mib M] [--accumulation A] [--offload-ratio R] "
                   "[--offload-ratio-delayed R] [--runs RUN,...]\n");
      return 2;
    }
  }
  if (s.batch <= 0 || s.seq <= 0 || s.steps <= 0 || s.warmup < 0 || s.activation_gib <= 0 ||
      s.accumulation <= 0) {
    std::fprintf(stderr,
                 "gpu_step: --batch, --seq, --steps, --activation-gib and --accumulation must be "
                 "positive, --warmup not negative\n");
    return 2;
  }
  return zero::bench::run(s);
} catch (const std::exception& e) {
  std::fprintf(stderr, "gpu_step: %s\n", e.what());
  return 1;
}
