// f32 -> bf16 / f16 conversion throughput (the write-back of every mixed-precision step),
// beside memcpy of the same bytes measured in the same run; and ZeRO++'s block-wise int8 and int4
// packing of f32 and bf16 values in 4 runs, its reading back and its sum of the 4 runs (qgZ's
// reduction), and the packing with LoCo's error feedback (the kept errors, int8, read and
// written beside it), on one thread under every instruction set the CPU has, beside the scalar
// path and memcpy.
// One JSON object per line.
//
//   ./convert_bench [elements]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <zero/ops/cpu/error_feedback.hpp>
#include <zero/ops/cpu/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
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

// The lines of a block format (8 or 4 bits a code) for values of type T: packing n values in 4
// runs, reading them back, summing the 4 runs into one, packing with error feedback; each under
// every ISA the CPU has, with its rate beside the scalar path's.
template <class T>
void quant_lines(const char* type, int bits, const float* src, long long n, double copy_gbps) {
  namespace cpu = zero::ops::cpu;
  constexpr std::int64_t runs = 4;
  n -= n % runs;
  std::vector<T> in(static_cast<std::size_t>(n)), back(in.size()), sums(in.size() / runs);
  for (long long i = 0; i < n; ++i) in[static_cast<std::size_t>(i)] = zero::convert<T>(src[i]);
  const std::int64_t run_bytes = bits == 8 ? zero::quant::int8_packed_bytes(n / runs)
                                           : zero::quant::int4_packed_bytes(n / runs);
  const auto packed = static_cast<std::size_t>(run_bytes * runs);
  std::vector<std::uint8_t> bytes(packed);
  std::vector<std::uint8_t> kept(
      static_cast<std::size_t>(zero::quant::int8_packed_bytes(n / runs) * runs));
  const std::span<const T> values(in);
  const std::span<std::uint8_t> out(bytes);
  const std::span<const std::uint8_t> packed_in(bytes);
  const double value_bytes = static_cast<double>(sizeof(T)) * static_cast<double>(n);
  struct Op {
    std::string name;
    double bytes;  // read and written
    std::function<void()> run;
  };
  const std::string width = bits == 8 ? "int8" : "int4";
  const Op ops[] = {
      {"quantize_" + width, value_bytes + static_cast<double>(packed),
       [&] {
         bits == 8 ? cpu::quantize_int8_blocks(values, out, runs)
                   : cpu::quantize_int4_blocks(values, out, runs);
       }},
      {"dequantize_" + width, value_bytes + static_cast<double>(packed),
       [&] {
         bits == 8 ? cpu::dequantize_int8_blocks(packed_in, std::span<T>(back), runs)
                   : cpu::dequantize_int4_blocks(packed_in, std::span<T>(back), runs);
       }},
      {"sum_" + width, value_bytes / runs + static_cast<double>(packed),
       [&] {
         bits == 8 ? cpu::sum_int8_blocks(packed_in, std::span<T>(sums), 0.25f)
                   : cpu::sum_int4_blocks(packed_in, std::span<T>(sums), 0.25f);
       }},
      {"quantize_feedback_" + width,
       value_bytes + static_cast<double>(packed) + 2.0 * static_cast<double>(kept.size()),
       [&] {
         cpu::quantize_with_feedback(values, out, std::span<std::uint8_t>(kept),
                                     zero::quant::ErrorFeedback::with_beta(0.8f), bits, runs);
       }},
  };
  for (const Op& op : ops) {
    double scalar_seconds = 0;
    for (zero::optim::Isa isa :
         {zero::optim::Isa::scalar, zero::optim::Isa::avx2, zero::optim::Isa::avx512}) {
      if (!zero::optim::cpu_supports(isa)) continue;
      cpu::set_host_isa(isa);
      const double seconds = best_seconds(op.run);
      if (isa == zero::optim::Isa::scalar) scalar_seconds = seconds;
      const double gbps = op.bytes / seconds / 1e9;
      zero::bench::line(
          (op.name + "_" + type).c_str(),
          "\"elements\": " + std::to_string(n) + ", \"runs\": 4, \"isa\": \"" +
              std::string(zero::optim::name_of(isa)) + "\", \"threads\": 1",
          gbps, "GB/s",
          ", \"ns_per_value\": " + std::to_string(seconds / static_cast<double>(n) * 1e9) +
              ", \"ms\": " + std::to_string(seconds * 1e3) +
              ", \"speedup_vs_scalar\": " + std::to_string(scalar_seconds / seconds) +
              ", \"fraction_of_memcpy\": " + std::to_string(gbps / copy_gbps));
    }
    cpu::set_host_isa(zero::optim::Isa::automatic);
  }
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

  for (int bits : {8, 4}) {
    quant_lines<float>("f32", bits, in, n, copy_gbps);
    quant_lines<zero::bf16>("bf16", bits, in, n, copy_gbps);
  }
  return 0;
}
