// host_ops_bench: the memory-bound host kernels of the layer library (GELU, SwiGLU, RMSNorm, the
// rotary embedding, repeat_kv) in f32 and bf16, each one's achieved bandwidth beside the copy
// bandwidth (memcpy of as many bytes, split over the same threads) measured in the same run. JSON
// lines:
//   {"bench": "host_ops", "config": {...}, "value": GB/s, "unit": "GB/s",
//    "copy_gbps": ..., "of_copy": ...}
// Bytes counted are each kernel's least traffic: its inputs read once and its outputs written
// once (the backwards write their input gradient, overwrite; RMSNorm's adds into it, so dx is
// read too; the weight gradient and rstd, a row's worth, are not counted).
//
//   ./host_ops_bench [--rows 2048] [--channels 2048] [--ffn 5632] [--heads 16] [--kv-heads 4]
//                    [--head-size 128] [--repeats 7]
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/ops/cpu/activation.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/ops/cpu/rms_norm.hpp>
#include <zero/ops/cpu/rotary.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace {

using zero::bf16;
namespace cpu = zero::ops::cpu;

struct Sizes {
  std::int64_t rows = 2048, channels = 2048, ffn = 5632, heads = 16, kv_heads = 4, head_size = 128;
  int repeats = 7;
};

template <class T>
std::vector<T> values(std::int64_t n, float scale) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    v[static_cast<std::size_t>(i)] =
        zero::convert<T>(scale * static_cast<float>((i * 7919) % 2001 - 1000) / 1000.0f);
  }
  return v;
}

// memcpy of bytes in 64 KiB chunks over the kernels' threads (parallel_chunks, as they split
// their work): bytes read plus bytes written per second.
double copy_gbps(std::size_t bytes, int repeats) {
  std::vector<unsigned char> a(bytes, 1), b(bytes, 0);
  constexpr std::int64_t chunk = 64 << 10;
  const auto n = static_cast<std::int64_t>(bytes);
  const double s = zero::bench::best_seconds(repeats, [&] {
    cpu::parallel_chunks(n, chunk, n, [&](std::int64_t b0, std::int64_t b1) {
      std::memcpy(b.data() + b0, a.data() + b0, static_cast<std::size_t>(b1 - b0));
    });
  });
  return 2.0 * static_cast<double>(bytes) / s / 1e9;
}

template <class Fn>
void report(const char* kernel, const char* dtype, const std::string& shape, double bytes,
            int repeats, Fn&& fn) {
  fn();  // first touch and warm-up
  const double s = zero::bench::best_seconds(repeats, fn);
  const double gbps = bytes / s / 1e9;
  const double copy = copy_gbps(static_cast<std::size_t>(bytes / 2), repeats);
  char extra[128];
  std::snprintf(extra, sizeof extra, ", \"copy_gbps\": %.4g, \"of_copy\": %.3f", copy, gbps / copy);
  zero::bench::line(
      "host_ops",
      std::string("\"kernel\": \"") + kernel + "\", \"dtype\": \"" + dtype + "\", " + shape, gbps,
      "GB/s", extra);
}

template <class T>
void run(const Sizes& z, const char* dtype) {
  const double e = sizeof(T);
  const std::int64_t N = z.rows, C = z.channels, F = z.ffn;
  const std::string rows_c = "\"rows\": " + std::to_string(N) + ", \"C\": " + std::to_string(C);
  {  // GELU over [N, 4C]
    const std::int64_t n = N * 4 * C;
    const auto x = values<T>(n, 4.0f), dy = values<T>(n, 1.0f);
    std::vector<T> y(x.size()), dx(x.size());
    const std::string shape = "\"n\": " + std::to_string(n);
    report("gelu_forward", dtype, shape, 2 * e * n, z.repeats,
           [&] { cpu::gelu_forward(y.data(), x.data(), n); });
    report("gelu_backward", dtype, shape, 3 * e * n, z.repeats,
           [&] { cpu::gelu_backward(dx.data(), x.data(), dy.data(), n, true); });
  }
  {  // SwiGLU over [N, 2F] -> [N, F]
    const auto x = values<T>(N * 2 * F, 4.0f), dy = values<T>(N * F, 1.0f);
    std::vector<T> y(dy.size()), dx(x.size());
    const std::string shape = "\"rows\": " + std::to_string(N) + ", \"F\": " + std::to_string(F);
    report("swiglu_forward", dtype, shape, 3 * e * N * F, z.repeats,
           [&] { cpu::swiglu_forward(y.data(), x.data(), N, F); });
    report("swiglu_backward", dtype, shape, 5 * e * N * F, z.repeats,
           [&] { cpu::swiglu_backward(dx.data(), x.data(), dy.data(), N, F, true); });
  }
  {  // RMSNorm over [N, C]
    using A = zero::compute_type_t<T>;
    const auto x = values<T>(N * C, 2.0f), w = values<T>(C, 1.0f), dy = values<T>(N * C, 1.0f);
    std::vector<T> y(x.size()), dx(x.size()), dw(w.size());
    std::vector<A> rstd(static_cast<std::size_t>(N));
    report("rms_norm_forward", dtype, rows_c, 2 * e * N * C, z.repeats,
           [&] { cpu::rms_norm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C); });
    report("rms_norm_backward", dtype, rows_c, 4 * e * N * C, z.repeats, [&] {
      cpu::rms_norm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N,
                             C);
    });
  }
  {  // the rotary embedding and repeat_kv over grouped qkv rows
    using A = zero::compute_type_t<T>;
    const std::int64_t g = z.heads / z.kv_heads, hs = z.head_size, T_ = 512;
    const std::int64_t width = cpu::grouped_qkv_width(z.kv_heads, g, hs);
    const std::int64_t packed = 3 * z.heads * hs;
    const auto x = values<T>(N * width, 2.0f), dy = values<T>(N * packed, 1.0f);
    std::vector<T> y(x.size()), dx(x.size()), out(dy.size());
    std::vector<A> cs(static_cast<std::size_t>(T_ * hs / 2)), sn(cs.size());
    cpu::rotary_table(cs.data(), sn.data(), 0, T_, hs, 500000.0);
    const std::string shape =
        "\"rows\": " + std::to_string(N) + ", \"heads\": " + std::to_string(z.heads) +
        ", \"kv_heads\": " + std::to_string(z.kv_heads) + ", \"head_size\": " + std::to_string(hs);
    report("rotary_forward", dtype, shape, 2 * e * N * width, z.repeats, [&] {
      cpu::rotary_forward(y.data(), x.data(), cs.data(), sn.data(), N, T_, z.kv_heads, g, hs);
    });
    report("rotary_backward", dtype, shape, 2 * e * N * width, z.repeats, [&] {
      cpu::rotary_backward(dx.data(), y.data(), cs.data(), sn.data(), N, T_, z.kv_heads, g, hs,
                           true);
    });
    report("repeat_kv_forward", dtype, shape, e * N * (width + packed), z.repeats,
           [&] { cpu::repeat_kv_forward(out.data(), x.data(), N, z.kv_heads, g, hs); });
    report("repeat_kv_backward", dtype, shape, e * N * (width + packed), z.repeats,
           [&] { cpu::repeat_kv_backward(dx.data(), dy.data(), N, z.kv_heads, g, hs, true); });
  }
}

}  // namespace

int main(int argc, char** argv) {
  Sizes z;
  if (!zero::bench::parse_flags(argc, argv, "host_ops_bench",
                                {{"--rows", &z.rows},
                                 {"--channels", &z.channels},
                                 {"--ffn", &z.ffn},
                                 {"--heads", &z.heads},
                                 {"--kv-heads", &z.kv_heads},
                                 {"--head-size", &z.head_size},
                                 {"--repeats", &z.repeats}})) {
    return 2;
  }
  if (z.heads % z.kv_heads != 0 || z.head_size % 2 != 0 || z.rows % 512 != 0) {
    std::fprintf(stderr,
                 "host_ops_bench: --heads must be a multiple of --kv-heads, --head-size even, "
                 "--rows a multiple of 512 (sequences of 512)\n");
    return 2;
  }
  run<float>(z, "f32");
  run<bf16>(z, "bf16");
  return 0;
}
