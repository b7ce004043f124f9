// The GPT kernels of zero::ops::cuda on one GPU, at GPT-2 small's shapes (B=8, T=1024, C=768,
// NH=12, V=50257) in bf16. Memory-bound kernels report achieved bandwidth (the bytes they must
// move at least, over their time) beside a cudaMemcpy device-to-device copy measured in the same
// run (fraction_of_copy; fraction_of_copy_at_size beside a copy of the kernel's own bytes); GEMMs
// report FLOP/s beside a 4096^3 cuBLASLt GEMM; flash attention reports FLOP/s and its speed-up over
// the cuBLAS reference path (attention_reference.cuh); the whole GPT-2 small, forward and backward
// through the layers on nn::CudaKernels, reports tokens/s and its model FLOP rate (6N + 6LCT per
// token) against the same GEMM, then the milliseconds of each layer kind in one more forward and
// backward (profile::OpTimes with a stream fence). Prints one JSON object per line. Without a GPU
// it says so and exits 0.
//   kernel_bench [--batch B] [--seq T] [--repeats R] [--only NAME_PART]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <initializer_list>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <zero/core/arena.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/rng.hpp>
#include <zero/nn/cuda_kernels.cuh>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cuda/attention.cuh>
#include <zero/ops/cuda/attention_reference.cuh>
#include <zero/ops/cuda/convert.cuh>
#include <zero/ops/cuda/cross_entropy.cuh>
#include <zero/ops/cuda/dropout.cuh>
#include <zero/ops/cuda/elementwise.cuh>
#include <zero/ops/cuda/embedding.cuh>
#include <zero/ops/cuda/gelu.cuh>
#include <zero/ops/cuda/gemm.cuh>
#include <zero/ops/cuda/layer_norm.cuh>
#include <zero/ops/cuda/linear.cuh>
#include <zero/ops/cuda/reduce.cuh>
#include <zero/profile/op_times.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace gpu = zero::ops::cuda;
using zero::bf16;

using zero::bench::line;

namespace {

/// A device allocation of n elements filled with a repeating pattern of small values.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    ZERO_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)));
    std::vector<T> h(n < 4096 ? n : 4096);
    for (std::size_t i = 0; i < h.size(); ++i) {
      h[i] = zero::convert<T>(static_cast<float>(static_cast<int>(i % 97) - 48) / 64.0f);
    }
    ZERO_CUDA_CHECK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    for (std::size_t filled = h.size(); filled < n; filled *= 2) {  // doubling copies
      const std::size_t count = n - filled < filled ? n - filled : filled;
      ZERO_CUDA_CHECK(cudaMemcpy(p_ + filled, p_, count * sizeof(T), cudaMemcpyDeviceToDevice));
    }
  }
  /// Overwrites the first values.size() elements.
  void upload(const std::vector<T>& values) {
    ZERO_CUDA_CHECK(
        cudaMemcpy(p_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(p_); }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

/// Mean milliseconds of fn over repeats runs after one warm-up, timed with CUDA events.
template <class Fn>
double time_ms(int repeats, Fn&& fn) {
  fn();
  cudaEvent_t start, stop;
  ZERO_CUDA_CHECK(cudaEventCreate(&start));
  ZERO_CUDA_CHECK(cudaEventCreate(&stop));
  ZERO_CUDA_CHECK(cudaEventRecord(start));
  for (int r = 0; r < repeats; ++r) fn();
  ZERO_CUDA_CHECK(cudaEventRecord(stop));
  ZERO_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  ZERO_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(ms) / repeats;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t B = 8, Tn = 1024;
  int repeats = 20;
  std::string only;  // --only: the benchmarks whose name holds this (the baselines always run)
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag != "--batch" && flag != "--seq" && flag != "--repeats" && flag != "--only") {
      std::fprintf(stderr, "usage: %s [--batch B] [--seq T] [--repeats R] [--only NAME_PART]\n",
                   argv[0]);
      return 2;
    }
    const char* v = zero::bench::value_arg("kernel_bench", argc, argv, i);
    if (flag == "--batch") {
      B = zero::bench::integer_arg("kernel_bench", flag, v);
    } else if (flag == "--seq") {
      Tn = zero::bench::integer_arg("kernel_bench", flag, v);
    } else if (flag == "--repeats") {
      repeats = static_cast<int>(zero::bench::integer_arg("kernel_bench", flag, v, 1, 1 << 20));
    } else {
      only = v;
    }
  }
  // The attention lines time the two-kernel backward as the default, and the fused one by name,
  // whatever the caller's environment.
  ::unsetenv("ZERO_ATTENTION_BACKWARD");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kernel_bench: no CUDA device visible; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::int64_t C = 768, NH = 12, V = 50257, N = B * Tn;
  const std::string base = "\"gpu\": \"" + std::string(prop.name) + "\", \"dtype\": \"bf16\"";
  const std::string shape = base + ", \"B\": " + std::to_string(B) +
                            ", \"T\": " + std::to_string(Tn) + ", \"C\": " + std::to_string(C);
  cudaStream_t stream = nullptr;  // the legacy stream: events above time it

  // ---- baselines: copy bandwidth and GEMM rate ----
  const std::size_t copy_bytes = std::size_t{1} << 30;
  DeviceArray<char> src(copy_bytes), dst(copy_bytes);
  const double copy_ms = time_ms(repeats, [&] {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice));
  });
  const double copy_gbps = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3) / 1e9;
  line("memcpy_d2d", base + ", \"bytes\": " + std::to_string(copy_bytes), copy_gbps, "GB/s",
       ", \"note\": \"read + write bytes\"");

  gpu::GemmContext ctx(stream);
  const std::int64_t G = 4096;
  DeviceArray<bf16> ga(G * G), gb(G * G), gc(G * G);
  const double gemm_ms = time_ms(repeats, [&] {
    gpu::gemm<bf16>(ctx, gpu::Trans::no, gpu::Trans::no, G, G, G, 1.0f, ga.get(), G, gb.get(), G,
                    0.0f, gc.get(), G, stream);
  });
  const double gemm_tflops = 2.0 * G * G * G / (gemm_ms * 1e-3) / 1e12;
  line("cublaslt_gemm_4096", base, gemm_tflops, "TFLOP/s");

  // Whether a benchmark of this name runs (--only; a profiler's run of a few kernels).
  const auto wanted = [&](const char* name) {
    return only.empty() || std::string(name).find(only) != std::string::npos;
  };
  const auto wanted_any = [&](std::initializer_list<const char*> names) {
    for (const char* name : names) {
      if (wanted(name)) return true;
    }
    return false;
  };
  // cudaMemcpy D2D moving `bytes` (half read, half written; at most the baseline's buffers) in
  // GB/s: a small kernel's like-for-like baseline, which pays the same launch and ramp-up and
  // keeps as much of its buffers in L2 between repeats as the kernel does.
  auto copy_gbps_moving = [&](double bytes) {
    const auto half =
        static_cast<std::size_t>(std::min(bytes / 2, static_cast<double>(copy_bytes)));
    const double ms = time_ms(repeats, [&] {
      ZERO_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), half, cudaMemcpyDeviceToDevice));
    });
    return 2.0 * static_cast<double>(half) / (ms * 1e-3) / 1e9;
  };
  // A memory-bound kernel: bandwidth and its fraction of the copy (the 1 GiB baseline's, the
  // issue's measure, and a copy of the kernel's own bytes').
  auto bandwidth = [&](const char* name, double bytes, auto&& fn) {
    if (!wanted(name)) return;
    const double ms = time_ms(repeats, fn);
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    char extra[160];
    std::snprintf(extra, sizeof extra,
                  ", \"ms\": %.4f, \"fraction_of_copy\": %.3f, \"fraction_of_copy_at_size\": %.3f",
                  ms, gbps / copy_gbps, gbps / copy_gbps_moving(bytes));
    line(name, shape, gbps, "GB/s", extra);
  };
  // A compute-bound kernel: FLOP/s and its fraction of the 4096^3 GEMM rate.
  auto rate = [&](const char* name, const std::string& config, double flops, auto&& fn) {
    if (!wanted(name)) return 0.0;
    const double ms = time_ms(repeats, fn);
    const double tflops = flops / (ms * 1e-3) / 1e12;
    char extra[128];
    std::snprintf(extra, sizeof extra, ", \"ms\": %.4f, \"fraction_of_gemm\": %.3f", ms,
                  tflops / gemm_tflops);
    line(name, config, tflops, "TFLOP/s", extra);
    return ms;
  };

  const double e = 2.0;  // bytes per bf16 element
  const double nc = static_cast<double>(N * C);
  DeviceArray<bf16> x(N * C), y(N * C), z(N * C), w(4 * C * C), bias(4 * C);
  DeviceArray<bf16> fc(N * 4 * C), fc2(N * 4 * C);
  DeviceArray<bf16> dw(4 * C * C), db(4 * C);
  DeviceArray<float> mean(N), rstd(N);

  bandwidth("residual_add", 3 * nc * e,
            [&] { gpu::add<bf16>(z.get(), x.get(), y.get(), N * C, stream); });
  bandwidth("gelu_forward", 2 * 4 * nc * e,
            [&] { gpu::gelu_forward<bf16>(fc2.get(), fc.get(), N * 4 * C, stream); });
  {
    // A dout apart from inp, as in training: with one buffer for both the kernel reads 3 arrays
    // of bytes, not the 4 counted.
    DeviceArray<bf16> dfc(N * 4 * C);
    bandwidth("gelu_backward", 4 * 4 * nc * e,
              [&] { gpu::gelu_backward<bf16>(fc2.get(), fc.get(), dfc.get(), N * 4 * C, stream); });
  }
  const zero::CounterRng rng(zero::CounterRng::key_for(1, "bench"));
  bandwidth("dropout_forward", 2 * nc * e,
            [&] { gpu::dropout_forward<bf16>(z.get(), x.get(), N * C, 0.1, rng, 0, stream); });
  bandwidth("layer_norm_forward", 2 * nc * e + 8.0 * N, [&] {
    gpu::layer_norm_forward<bf16>(z.get(), mean.get(), rstd.get(), x.get(), w.get(), bias.get(), N,
                                  C, stream);
  });
  bandwidth("layer_norm_backward", 4 * nc * e + 8.0 * N, [&] {
    gpu::layer_norm_backward<bf16>(z.get(), dw.get(), db.get(), y.get(), x.get(), w.get(),
                                   mean.get(), rstd.get(), N, C, stream);
  });
  {
    // Its second kernel alone (the per-block partials of dweight and dbias added in block
    // order), to say how much of the backward's time is that kernel.
    const std::int64_t chunks =
        (N + gpu::layer_norm_backward_rows - 1) / gpu::layer_norm_backward_rows;
    DeviceArray<float> partials(2 * chunks * C);
    bandwidth("layer_norm_backward_finish", 2.0 * chunks * C * 4 + 2.0 * 2 * C * e, [&] {
      gpu::column_sum_detail::finish_column_sums<bf16, 2>({{dw.get(), db.get()}}, partials.get(),
                                                          chunks, C, stream);
    });
  }
  DeviceArray<std::int32_t> tokens(N);
  std::vector<std::int32_t> token_values(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < token_values.size(); ++i) {
    token_values[i] = static_cast<std::int32_t>((i * 7919) % static_cast<std::size_t>(V));
  }
  tokens.upload(token_values);
  DeviceArray<bf16> wte(V * C), wpe(Tn * C);
  // The bytes it must move: out written and each token's wte row read, and wpe read once (the
  // B sequences share it; counting it per token overstated the bandwidth by 3 / (2 + 1 / B)).
  bandwidth("embedding_forward", (2 * nc + static_cast<double>(Tn * C)) * e, [&] {
    gpu::embedding_forward<bf16>(z.get(), tokens.get(), wte.get(), wpe.get(), B, Tn, C, V, stream);
  });
  // The bytes it must move: dout read for dwte and again for dwpe, each distinct token's dwte row
  // read and written (the tokens below are all distinct), dwpe read and written.
  bandwidth("embedding_backward", (4 * nc + 2.0 * Tn * C) * e, [&] {
    gpu::embedding_backward<bf16>(wte.get(), wpe.get(), x.get(), tokens.get(), B, Tn, C, V, stream);
  });
  {
    DeviceArray<bf16> logits(N * V);
    DeviceArray<float> losses(N), loss(1), row_stats(2 * N);
    const double nv = static_cast<double>(N * V);
    bandwidth("cross_entropy_forward", nv * e, [&] {
      gpu::cross_entropy_forward<bf16>(losses.get(), loss.get(), row_stats.get(), logits.get(),
                                       tokens.get(), N, V, stream);
    });
    // The LM head's GEMMs: output rows of V = 50257 elements are not whole 16-byte packs, so
    // they run on padded scratch rows (linear.cuh).
    const std::string vocab_config = shape + ", \"OC\": " + std::to_string(V);
    rate("linear_forward_vocab", vocab_config, 2.0 * N * C * V, [&] {
      gpu::linear_forward<bf16>(ctx, logits.get(), x.get(), wte.get(), nullptr, N, C, V, stream);
    });
    rate("linear_backward_vocab", vocab_config, 4.0 * N * C * V, [&] {
      gpu::linear_backward<bf16>(ctx, z.get(), wte.get(), nullptr, logits.get(), x.get(), wte.get(),
                                 N, C, V, stream);
    });
    // The LM head's forward GEMM on logits rows of whole 16-byte packs (what the layers run:
    // 50264 for V = 50257) against rows of whole 64 elements (50304, nanoGPT's and llm.c's
    // padded vocabulary): whether the wider padding is worth its 0.08% more products.
    {
      const std::int64_t widest = (V + 63) / 64 * 64;
      DeviceArray<bf16> padded_w(widest * C), padded_logits(N * widest);
      for (const std::int64_t multiple : {std::int64_t{8}, std::int64_t{64}}) {
        const std::int64_t ld = (V + multiple - 1) / multiple * multiple;
        rate("lm_head_gemm_padded_rows", vocab_config + ", \"ld\": " + std::to_string(ld),
             2.0 * N * C * V, [&] {
               gpu::gemm<bf16>(ctx, gpu::Trans::no, gpu::Trans::yes, N, ld, C, 1.0f, x.get(), C,
                               padded_w.get(), C, 0.0f, padded_logits.get(), ld, stream);
             });
      }
    }
    // As the loss layers run it: the forward's row statistics, one pass.
    bandwidth("cross_entropy_backward_inplace", 2 * nv * e, [&] {
      gpu::cross_entropy_backward<bf16>(logits.get(), logits.get(), tokens.get(), N, V, 1.0f, N,
                                        row_stats.get(), stream);
    });
    // Without them: the row's maximum and sum again first (two passes).
    bandwidth("cross_entropy_backward_inplace_no_row_stats", 2 * nv * e, [&] {
      gpu::cross_entropy_backward<bf16>(logits.get(), logits.get(), tokens.get(), N, V, 1.0f,
                                        stream);
    });
  }
  {
    // As LinearCrossEntropy's training forward runs it, on rows of whole packs (50264 apart):
    // the loss and the gradient in place, by the fused kernel (each row read once into
    // registers) and by the forward and backward kernels one after the other. The bytes are
    // the logits read and the gradient written, for both.
    const std::int64_t ld = gpu::padded_row<bf16>(V);
    DeviceArray<bf16> rows(N * ld);
    DeviceArray<float> losses(N), row_stats(2 * N);
    const double bytes = 2.0 * static_cast<double>(N * ld) * e;
    bandwidth("cross_entropy_forward_backward_inplace", bytes, [&] {
      gpu::cross_entropy_forward_backward<bf16>(losses.get(), row_stats.get(), rows.get(),
                                                rows.get(), tokens.get(), N, V, ld, 1.0f, N,
                                                stream);
    });
    bandwidth("cross_entropy_forward_then_backward_inplace", bytes, [&] {
      gpu::cross_entropy_forward<bf16>(losses.get(), nullptr, row_stats.get(), rows.get(),
                                       tokens.get(), N, V, ld, stream);
      gpu::cross_entropy_backward<bf16>(rows.get(), rows.get(), tokens.get(), N, V, 1.0f, N,
                                        row_stats.get(), ld, stream);
    });
  }
  {
    DeviceArray<float> master(N * C);
    bandwidth("convert_f32_to_bf16", 6 * nc,
              [&] { gpu::convert_elements<bf16, float>(z.get(), master.get(), N * C, stream); });
    bandwidth("round_stochastic_bf16", 6 * nc, [&] {
      gpu::round_stochastic_bf16<float>(z.get(), master.get(), N * C, 7, 1, 0, stream);
    });
    DeviceArray<double> sum(1);
    bandwidth("sum_squares_f32", 4 * nc,
              [&] { gpu::sum_squares<float>(sum.get(), master.get(), N * C, stream); });
  }

  // ---- GEMMs of a block ----
  const std::string fc_config = shape + ", \"OC\": " + std::to_string(4 * C);
  rate("linear_forward_bias", fc_config, 2.0 * N * C * 4 * C, [&] {
    gpu::linear_forward<bf16>(ctx, fc.get(), x.get(), w.get(), bias.get(), N, C, 4 * C, stream);
  });
  rate("linear_gelu_forward", fc_config, 2.0 * N * C * 4 * C, [&] {
    gpu::linear_gelu_forward<bf16>(ctx, fc.get(), x.get(), w.get(), bias.get(), N, C, 4 * C,
                                   stream);
  });
  rate("linear_backward", fc_config, 4.0 * N * C * 4 * C, [&] {
    gpu::linear_backward<bf16>(ctx, z.get(), dw.get(), db.get(), fc.get(), x.get(), w.get(), N, C,
                               4 * C, stream);
  });

  // ---- the block's four linear layers: each shape's algorithm as cuBLASLt's heuristic answers,
  // then as a measured tuning picks it (the fastest of 16 candidates, GemmTuning::measured) ----
  if (wanted_any({"block_linear_forward", "block_linear_backward",
                  "block_linear_heuristic_over_measured",
                  "block_linears_heuristic_over_measured"})) {
    gpu::GemmContext tuned(stream);
    tuned.set_tuning(gpu::GemmTuning::measured, gpu::GemmContext::max_candidates);
    DeviceArray<bf16> lx(N * 4 * C), ly(N * 4 * C), ldx(N * 4 * C), lw(4 * C * C), ldw(4 * C * C),
        lb(4 * C), ldbias(4 * C);
    struct BlockLinear {
      const char* name;
      std::int64_t in, out;
    };
    double heuristic_ms = 0, measured_ms = 0;
    for (const BlockLinear l :
         {BlockLinear{"attn.c_attn", C, 3 * C}, BlockLinear{"attn.c_proj", C, C},
          BlockLinear{"mlp.c_fc", C, 4 * C}, BlockLinear{"mlp.c_proj", 4 * C, C}}) {
      const std::string config = shape + ", \"layer\": \"" + l.name +
                                 "\", \"in\": " + std::to_string(l.in) +
                                 ", \"out\": " + std::to_string(l.out);
      double ms[2] = {};
      for (int t = 0; t < 2; ++t) {
        gpu::GemmContext& g = t == 0 ? ctx : tuned;
        const std::string c =
            config + ", \"gemm_tuning\": \"" + (t == 0 ? "heuristic" : "measured") + "\"";
        ms[t] += rate("block_linear_forward", c, 2.0 * N * l.in * l.out, [&] {
          gpu::linear_forward<bf16>(g, ly.get(), lx.get(), lw.get(), lb.get(), N, l.in, l.out,
                                    stream);
        });
        ms[t] += rate("block_linear_backward", c, 4.0 * N * l.in * l.out, [&] {
          gpu::linear_backward<bf16>(g, ldx.get(), ldw.get(), ldbias.get(), ly.get(), lx.get(),
                                     lw.get(), N, l.in, l.out, stream);
        });
      }
      heuristic_ms += ms[0];
      measured_ms += ms[1];
      line("block_linear_heuristic_over_measured", config, ms[0] / ms[1], "x",
           ", \"meaning\": \"forward plus backward with cuBLASLt's first heuristic answer over "
           "the same with a measured tuning (> 1: tuning is faster)\"");
    }
    char extra[128];
    std::snprintf(extra, sizeof extra, ", \"shapes_retuned\": %zu, \"shapes\": %zu",
                  tuned.retuned_shapes(), tuned.cached_shapes());
    line("block_linears_heuristic_over_measured", shape, heuristic_ms / measured_ms, "x", extra);
  }

  // ---- the layers' fusions (what Sequential pairs on the device), each against its two
  // kernels apart: c_fc with its GELU, c_proj's backward through that GELU, a residual's sum in
  // c_proj's GEMM ----
  {
    DeviceArray<bf16> fin(N * 4 * C), fpre(N * 4 * C), fout(N * 4 * C), fscratch(N * 4 * C),
        fw(4 * C * C), fb(4 * C), fdw(4 * C * C), fdb(4 * C), fdy(N * C), fskip(N * C), fsum(N * C);
    const auto fused_line = [&](const char* name, const std::string& config, auto&& apart,
                                auto&& fused) {
      if (!wanted(name)) return;
      const double apart_ms = time_ms(repeats, apart), fused_ms = time_ms(repeats, fused);
      char extra[160];
      std::snprintf(extra, sizeof extra,
                    ", \"apart_ms\": %.4f, \"fused_ms\": %.4f, \"meaning\": \"two kernels "
                    "over one (> 1: the fusion is faster)\"",
                    apart_ms, fused_ms);
      line(name, config, apart_ms / fused_ms, "x", extra);
    };
    const std::string fc = shape + ", \"layer\": \"mlp.c_fc\"";
    fused_line(
        "fused_linear_gelu_forward", fc,
        [&] {
          gpu::linear_forward<bf16>(ctx, fpre.get(), x.get(), fw.get(), fb.get(), N, C, 4 * C,
                                    stream);
          gpu::gelu_forward<bf16>(fout.get(), fpre.get(), N * 4 * C, stream);
        },
        [&] {
          gpu::linear_gelu_aux_forward<bf16>(ctx, fpre.get(), fout.get(), x.get(), fw.get(),
                                             fb.get(), N, C, 4 * C, stream);
        });
    const std::string proj = shape + ", \"layer\": \"mlp.c_proj\"";
    fused_line(
        "fused_linear_backward_gelu", proj,
        [&] {
          gpu::linear_backward<bf16>(ctx, fscratch.get(), fdw.get(), fdb.get(), fdy.get(),
                                     fin.get(), fw.get(), N, 4 * C, C, true, stream);
          gpu::gelu_backward<bf16>(fout.get(), fpre.get(), fscratch.get(), N * 4 * C, true, stream);
        },
        [&] {
          gpu::linear_backward_gelu<bf16>(ctx, fout.get(), fdw.get(), fdb.get(), fdy.get(),
                                          fin.get(), fw.get(), fpre.get(), N, 4 * C, C, stream);
        });
    fused_line(
        "fused_linear_forward_add", proj,
        [&] {
          gpu::linear_forward<bf16>(ctx, fsum.get(), fin.get(), fw.get(), fb.get(), N, 4 * C, C,
                                    stream);
          gpu::add<bf16>(fsum.get(), fskip.get(), fsum.get(), N * C, stream);
        },
        [&] {
          gpu::linear_forward_add<bf16>(ctx, fsum.get(), fskip.get(), fin.get(), fw.get(), fb.get(),
                                        N, 4 * C, C, stream);
        });
    // A residual branch's first LayerNorm: its input gradient from the skip path's, against a
    // copy of the skip path's gradient and the backward adding into it.
    const std::string ln = shape + ", \"layer\": \"ln_1\"";
    fused_line(
        "fused_layer_norm_backward_from", ln,
        [&] {
          ZERO_CUDA_CHECK(cudaMemcpyAsync(fsum.get(), fskip.get(),
                                          static_cast<std::size_t>(N * C) * sizeof(bf16),
                                          cudaMemcpyDeviceToDevice, stream));
          gpu::layer_norm_backward<bf16>(fsum.get(), dw.get(), db.get(), y.get(), x.get(), w.get(),
                                         mean.get(), rstd.get(), N, C, stream);
        },
        [&] {
          gpu::layer_norm_backward_from<bf16>(fsum.get(), fskip.get(), dw.get(), db.get(), y.get(),
                                              x.get(), w.get(), mean.get(), rstd.get(), N, C,
                                              stream);
        });
  }

  // ---- attention: flash against the cuBLAS reference ----
  {
    DeviceArray<bf16> qkv(N * 3 * C), out(N * C), dout(N * C), dqkv(N * 3 * C);
    DeviceArray<float> lse(B * NH * Tn);
    DeviceArray<bf16> att(B * NH * Tn * Tn);
    const std::int64_t hs = C / NH;
    // Useful work of causal attention: half of the T x T scores, 2 GEMM-like products forward.
    const double fwd_flops = 2.0 * 2.0 * B * NH * static_cast<double>(Tn) * Tn * hs / 2.0;
    const std::string cfg = shape + ", \"NH\": " + std::to_string(NH);
    const double flash_fwd = rate("flash_attention_forward", cfg, fwd_flops, [&] {
      gpu::attention_forward<bf16>(out.get(), lse.get(), qkv.get(), B, Tn, C, NH, stream);
    });
    const double ref_fwd = rate("reference_attention_forward", cfg, fwd_flops, [&] {
      gpu::attention_forward_reference<bf16>(ctx, out.get(), att.get(), qkv.get(), B, Tn, C, NH,
                                             stream);
    });
    if (flash_fwd > 0 && ref_fwd > 0) {
      line("flash_attention_forward_speedup", cfg, ref_fwd / flash_fwd, "x");
    }
    // The tensor-core forward with each warp on 1 and on 2 tiles of 16 query rows (blocks of 64
    // and 128 rows), whatever the launcher's default (mma::forward_row_tiles) is.
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    const int Bi = static_cast<int>(B), Ti = static_cast<int>(Tn), Ci = static_cast<int>(C),
              NHi = static_cast<int>(NH);
    double row_tiles_ms[2] = {};
    for (const int tiles : {1, 2}) {
      row_tiles_ms[tiles - 1] =
          rate("flash_attention_forward_row_tiles",
               cfg + ", \"row_tiles\": " + std::to_string(tiles), fwd_flops, [&] {
                 if (tiles == 1) {
                   gpu::mma::forward<bf16, 64, 1>(out.get(), lse.get(), qkv.get(), Bi, Ti, Ci, NHi,
                                                  scale, gpu::DropoutMask{}, stream);
                 } else {
                   gpu::mma::forward<bf16, 64, 2>(out.get(), lse.get(), qkv.get(), Bi, Ti, Ci, NHi,
                                                  scale, gpu::DropoutMask{}, stream);
                 }
               });
    }
    if (row_tiles_ms[0] > 0) {
      line("flash_attention_forward_one_over_two_row_tiles", cfg, row_tiles_ms[0] / row_tiles_ms[1],
           "x", ", \"meaning\": \"> 1: two row tiles a warp are faster\"");
    }
    // As the layers run it: delta = rowsum(dout * out) from the forward's output, dqkv written
    // (Sequential no longer zeroes it first).
    const double flash_bwd = rate("flash_attention_backward", cfg, 2.5 * fwd_flops, [&] {
      gpu::attention_backward<bf16>(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.get(), B, Tn,
                                    C, NH, gpu::DropoutMask{}, true, stream);
    });
    // Added into dqkv, with the zeroing the layers did before: what writing it saves.
    rate("flash_attention_backward_zeroed_and_added", cfg, 2.5 * fwd_flops, [&] {
      ZERO_CUDA_CHECK(cudaMemsetAsync(dqkv.get(), 0,
                                      static_cast<std::size_t>(N * 3 * C) * sizeof(bf16), stream));
      gpu::attention_backward<bf16>(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.get(), B, Tn,
                                    C, NH, gpu::DropoutMask{}, false, stream);
    });
    // Without it: delta from the probabilities, a first pass over the keys in the dq kernel.
    rate("flash_attention_backward_delta_from_probabilities", cfg, 2.5 * fwd_flops, [&] {
      gpu::attention_backward<bf16>(dqkv.get(), dout.get(), qkv.get(), lse.get(), B, Tn, C, NH,
                                    stream);
    });
    const double ref_bwd = rate("reference_attention_backward", cfg, 2.5 * fwd_flops, [&] {
      gpu::attention_backward_reference<bf16>(ctx, dqkv.get(), dout.get(), qkv.get(), att.get(), B,
                                              Tn, C, NH, stream);
    });
    if (flash_bwd > 0 && ref_bwd > 0) {
      line("flash_attention_backward_speedup", cfg, ref_bwd / flash_bwd, "x");
    }
    // The backward's three kernels alone, as the layers run them (delta from the forward's
    // output, dqkv written): their shares of flash_attention_backward. The dq kernel's products
    // are 3 of the 2.5 x forward (S, dP, dS K: 1.5 x), the dk/dv kernel's 4 (S, dP, P^T dO,
    // dS^T Q: 2 x).
    DeviceArray<float> delta(B * NH * Tn);
    bandwidth("flash_attention_backward_delta", 2 * nc * e + 4.0 * B * NH * Tn, [&] {
      gpu::mma::backward_delta<bf16, 64>(delta.get(), out.get(), dout.get(), Bi, Ti, NHi, stream);
    });
    rate("flash_attention_backward_dq", cfg, 1.5 * fwd_flops, [&] {
      gpu::mma::backward_dq<bf16, 64>(dqkv.get(), delta.get(), true, dout.get(), qkv.get(),
                                      lse.get(), Bi, Ti, Ci, NHi, scale, gpu::DropoutMask{}, true,
                                      stream);
    });
    rate("flash_attention_backward_dkdv", cfg, 2.0 * fwd_flops, [&] {
      gpu::mma::backward_dkdv<bf16, 64>(dqkv.get(), delta.get(), dout.get(), qkv.get(), lse.get(),
                                        Bi, Ti, Ci, NHi, scale, gpu::DropoutMask{}, true, stream);
    });
    // dq fused into the dk/dv kernel (float atomics into B*T*C floats, then rounded into dqkv):
    // one pass over the scores instead of two, the products of 2.5 forwards (FlashAttention-2's
    // backward); against flash_attention_backward above.
    DeviceArray<float> dq_accum(N * C);
    const double fused_bwd = rate("flash_attention_backward_fused_dq", cfg, 2.5 * fwd_flops, [&] {
      gpu::mma::backward_fused_dq<bf16, 64>(dqkv.get(), delta.get(), dq_accum.get(), dout.get(),
                                            qkv.get(), out.get(), lse.get(), Bi, Ti, Ci, NHi, scale,
                                            gpu::DropoutMask{}, true, stream);
    });
    if (flash_bwd > 0 && fused_bwd > 0) {
      line("flash_attention_backward_apart_over_fused_dq", cfg, flash_bwd / fused_bwd, "x",
           ", \"meaning\": \"the dq and dk/dv kernels over dq fused into the dk/dv kernel (> 1: "
           "fusing is faster; its dq is not bit for bit run to run)\"");
    }
  }

  // ---- the whole GPT-2 small, forward and backward, through the layers on CudaKernels ----
  if (wanted_any({"gpt2_layers_forward_backward", "gpt2_layers_time_by_kind"})) {
    zero::nn::GPTConfig cfg = zero::nn::GPTConfig::preset("gpt2");
    cfg.max_seq_len = Tn > cfg.max_seq_len ? Tn : cfg.max_seq_len;
    zero::nn::GPT<bf16> gpt(cfg);
    zero::nn::LocalParameters<zero::nn::GPT<bf16>> host(gpt, 1);  // initialised on the host
    std::deque<DeviceArray<bf16>> values, grads;  // deque: DeviceArray does not move
    for (int u = 0; u < gpt.num_units(); ++u) {
      const zero::Tensor<bf16> v = host.unit_values(u);
      values.emplace_back(static_cast<std::size_t>(v.numel()));
      grads.emplace_back(static_cast<std::size_t>(v.numel()));
      values.back().upload(std::vector<bf16>(v.begin(), v.end()));
      std::vector<zero::nn::ParamView<bf16>> views;
      std::int64_t offset = 0;
      for (const zero::nn::ParamSpec& spec : host.unit_specs(u)) {
        views.push_back(
            {zero::Tensor<bf16>(values.back().get() + offset, spec.shape, zero::DeviceKind::cuda),
             zero::Tensor<bf16>(grads.back().get() + offset, spec.shape, zero::DeviceKind::cuda)});
        offset += spec.numel();
      }
      gpt.bind_unit(u, views);
    }
    zero::nn::CudaKernels<bf16> kernels(stream);
    zero::Arena<zero::Cuda> arena(std::size_t{24} << 30, "gpt2 activations");
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
    zero::nn::StepContext<bf16> step;
    step.arena = &arena;
    step.kernels = &kernels;
    step.tokens = tokens.get();
    step.targets = tokens.get();
    step.batch = B;
    step.seq_len = Tn;
    const double ms = time_ms(repeats, [&] {
      arena.reset();
      (void)gpt.forward(step);
      gpt.backward(step);
    });
    const double params = static_cast<double>(host.num_parameters());
    const double per_token = 6.0 * params + 6.0 * static_cast<double>(cfg.num_layers * C * Tn);
    const double tflops = per_token * static_cast<double>(N) / (ms * 1e-3) / 1e12;
    char extra[192];
    std::snprintf(extra, sizeof extra,
                  ", \"ms\": %.3f, \"tflops\": %.1f, \"fraction_of_gemm\": %.3f, "
                  "\"flops_per_token\": \"6N + 6LCT\", \"note\": \"no optimizer step\"",
                  ms, tflops, tflops / gemm_tflops);
    line("gpt2_layers_forward_backward", shape, static_cast<double>(N) / (ms * 1e-3), "tokens/s",
         extra);

    // Where that time goes: one more forward and backward with an op timer per pass, fenced by
    // a stream synchronize so that each layer kind gets its own device time.
    zero::profile::OpTimes forward_times, backward_times;
    const auto fence = [&] { ZERO_CUDA_CHECK(cudaStreamSynchronize(stream)); };
    forward_times.set_fence(fence);
    backward_times.set_fence(fence);
    arena.reset();
    step.op_times = &forward_times;
    (void)gpt.forward(step);
    step.op_times = &backward_times;
    gpt.backward(step);
    step.op_times = nullptr;
    for (const auto* pass : {&forward_times, &backward_times}) {
      const char* name = pass == &forward_times ? "forward" : "backward";
      for (const auto& [kind, seconds] : pass->seconds()) {
        // Pass and kind go into the config: bench-compare keys its rows on bench and config,
        // and would otherwise take every kind's line for one.
        const std::string kind_config =
            shape + ", \"pass\": \"" + name + "\", \"kind\": \"" + kind + "\"";
        std::snprintf(extra, sizeof extra, ", \"of_pass\": %.3f", seconds / pass->total());
        line("gpt2_layers_time_by_kind", kind_config, seconds * 1e3, "ms", extra);
      }
    }
  }
  ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
