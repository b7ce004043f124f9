// f32 -> bf16 / f16 conversion throughput (the write-back of every mixed-precision step),
// beside memcpy of the same bytes measured in the same run. One JSON object per line.
//
//   ./convert_bench [elements]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <zero/zero.hpp>

#include "bench_flags.hpp"
#include "bench_timing.hpp"

namespace {

double best_seconds(const auto& fn) {
  return zero::bench::best_seconds(7, fn);
}

void report(const char* bench, long long n, double seconds, double bytes, double baseline_gbps) {
  const double gbps = bytes / seconds / 1e9;
  std::printf(
      "{\"bench\": \"%s\", \"config\": {\"elements\": %lld}, \"value\": %.3f, "
      "\"unit\": \"GB/s\", \"ms\": %.3f, \"fraction_of_memcpy\": %.3f}\n",
      bench, n, gbps, seconds * 1e3, baseline_gbps > 0 ? gbps / baseline_gbps : 1.0);
}

}  // namespace

int main(int argc, char** argv) {
  const long long n =
      argc > 1 ? zero::bench::integer_arg("convert_bench", "elements", argv[1]) : 32ll << 20;
  zero::Buffer<float> src(static_cast<std::size_t>(n));
  zero::fill_uniform(src.view(), zero::CounterRng(1), 0, -4.0, 4.0);
  zero::Buffer<float> copy(static_cast<std::size_t>(n));
  zero::Buffer<zero::bf16> bf(static_cast<std::size_t>(n));
  zero::Buffer<zero::f16> hf(static_cast<std::size_t>(n));
  const float* in = src.data();

  const double t_copy = best_seconds([&] { std::memcpy(copy.data(), in, n * sizeof(float)); });
  const double copy_gbps = 2.0 * n * sizeof(float) / t_copy / 1e9;
  report("memcpy_f32", n, t_copy, 2.0 * n * sizeof(float), 0);

  const double t_bf = best_seconds([&] {
    zero::bf16* out = bf.data();
    for (long long i = 0; i < n; ++i) out[i] = zero::bf16(in[i]);
  });
  report("convert_f32_to_bf16", n, t_bf, n * (sizeof(float) + 2.0), copy_gbps);

  const double t_hf = best_seconds([&] {
    zero::f16* out = hf.data();
    for (long long i = 0; i < n; ++i) out[i] = zero::f16(in[i]);
  });
  report("convert_f32_to_f16", n, t_hf, n * (sizeof(float) + 2.0), copy_gbps);
  return 0;
}
