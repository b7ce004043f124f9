#pragma once
// Block-wise int4 quantization on the host (DeepSpeed's width for ZeRO++'s quantized gradients):
// packs runs of values as core/int4_blocks.hpp lays them out, reads packed runs back, and sums
// packed runs. The int8 kernels' bodies (ops/cpu/int8_blocks.hpp) with 4-bit codes: a block's
// largest magnitude and its codes over the dispatched ISA's lanes into a block of int8 codes, two
// of them then paired into a byte; reading back and summing widen a block's nibbles to int8 codes
// first and run over the lanes from there (a sum keeps four vectors' f32 sums in registers over
// the runs, one fused multiply-add a run in run order). Work is cut into fixed chunks of whole
// quantization blocks, so every block's nibbles start at a byte; every ISA and thread count gives
// the rules' bits. The device's twins are in ops/cuda/int4_blocks.cuh.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include <zero/core/dtype.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#define ZERO_INT4_SSE2 1
#endif

namespace zero::ops::cpu {

namespace detail {

// codes[0, count) = the `count` codes whose nibbles start at bytes (quant::int4_code_at), and the
// padding nibble after them when count is odd. SSE2 (every x86-64) takes 16 bytes at a time: the
// low and high nibbles interleaved, then sign-extended as 4-bit two's complement ((x ^ 8) - 8).
inline void unpack_int4(const std::uint8_t* bytes, std::int64_t count, std::int8_t* codes) {
  const std::int64_t pairs = (count + 1) / 2;
  std::int64_t p = 0;
#if defined(ZERO_INT4_SSE2)
  const __m128i low4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  for (; p + 16 <= pairs; p += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + p));
    const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    const auto sign = [&](__m128i x) { return _mm_sub_epi8(_mm_xor_si128(x, eight), eight); };
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * p), sign(_mm_unpacklo_epi8(lo, hi)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * p + 16),
                     sign(_mm_unpackhi_epi8(lo, hi)));
  }
#endif
  for (; p < pairs; ++p) {
    codes[2 * p] = static_cast<std::int8_t>(static_cast<std::int8_t>(bytes[p] << 4) >> 4);
    codes[2 * p + 1] = static_cast<std::int8_t>(static_cast<std::int8_t>(bytes[p]) >> 4);
  }
}

// bytes[0, (count + 1) / 2) = codes[0, count) paired (quant::int4_pair), codes[count] being the
// padding nibble when count is odd. SSE2 takes 32 codes at a time: each 16-bit word (odd << 8 |
// even) becomes (even & 15) | ((odd & 15) << 4), and the words narrow to bytes.
inline void pack_int4(const std::int8_t* codes, std::int64_t count, std::uint8_t* bytes) {
  const std::int64_t pairs = (count + 1) / 2;
  std::int64_t p = 0;
#if defined(ZERO_INT4_SSE2)
  const __m128i even4 = _mm_set1_epi16(0x000f), odd4 = _mm_set1_epi16(0x00f0);
  const auto pair = [&](const std::int8_t* c) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    return _mm_or_si128(_mm_and_si128(w, even4), _mm_and_si128(_mm_srli_epi16(w, 4), odd4));
  };
  for (; p + 16 <= pairs; p += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + p),
                     _mm_packus_epi16(pair(codes + 2 * p), pair(codes + 2 * p + 16)));
  }
#endif
  for (; p < pairs; ++p) bytes[p] = quant::int4_pair(codes[2 * p], codes[2 * p + 1]);
}

// Packs quantization blocks [begin, end) of `runs` int4 packed runs of n values (quant_blocks):
// each block's scale, then its code bytes.
struct QuantizeInt4Kernel {
  template <class O, class T>
  static void run(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                  std::int64_t columns, std::int64_t begin, std::int64_t end) {
    alignas(64) std::int8_t codes[quant::int4_block];
    quant_blocks(n, begin, end,
                 [&](std::int64_t j, std::int64_t b, std::int64_t first, std::int64_t count) {
                   const T* x = in + quant::int8_source_run(j, runs, columns) * n + first;
                   std::uint8_t* run = out + j * quant::int4_packed_bytes(n);
                   const float scale = quant_block_codes<O>(x, count, quant::int4_max_code, codes);
                   std::memcpy(run + quant::int4_scales_offset(n) + 4 * b, &scale, 4);
                   if (count % 2 != 0) codes[count] = 0;  // the padding nibble
                   pack_int4(codes, count, run + first / 2);
                 });
  }
};

// The values of int4 quantization blocks [begin, end) of `runs` packed runs of n values into out
// (`runs` runs of n).
struct DequantizeInt4Kernel {
  template <class O, class T>
  static void run(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t begin,
                  std::int64_t end) {
    alignas(64) std::int8_t codes[quant::int4_block];
    quant_blocks(n, begin, end,
                 [&](std::int64_t r, std::int64_t b, std::int64_t first, std::int64_t count) {
                   const std::uint8_t* run = in + r * quant::int4_packed_bytes(n);
                   unpack_int4(run + first / 2, count, codes);
                   const float scale = quant::int4_scale_at(run, n, b);
                   T* y = out + r * n + first;
                   quant_lanes<O>(0, count, [&](auto ops, std::int64_t i) {
                     using P = decltype(ops);
                     quant_store_values<P>(y + i, P::mul(P::load_int8(codes + i), P::set1(scale)));
                   });
                 });
  }
};

// Quantization blocks [begin, end) of `outputs` runs of n values (block k: output k / B, its
// block k % B) = factor * the f32 sums of that block of run (k / B) in every one of the `blocks`
// blocks of int4 packed runs, one fused multiply-add a run in run order
// (quant::int8_add_value): four vectors of values at a time, their sums in registers while each
// run's nibbles for them are widened (unpack_int4), as the int8 sum keeps its; a block's last
// values that fill no four vectors one at a time.
struct SumInt4Kernel {
  static constexpr int group = 4;

  template <class O, class T>
  static void run(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t outputs,
                  std::int64_t blocks, float factor, std::int64_t begin, std::int64_t end) {
    using S = optim::ScalarHostOps;
    constexpr int values = group * O::width;
    const std::int64_t packed = quant::int4_packed_bytes(n);
    alignas(64) std::int8_t codes[values];
    quant_blocks(n, begin, end,
                 [&](std::int64_t o, std::int64_t b, std::int64_t first, std::int64_t count) {
                   T* y = out + o * n + first;
                   std::int64_t i = 0;
                   for (; i + values <= count; i += values) {  // i even: whole bytes
                     typename O::V acc[group];
                     for (auto& a : acc) a = O::set1(0.0f);
                     for (std::int64_t r = 0; r < blocks; ++r) {
                       const std::uint8_t* run = in + (r * outputs + o) * packed;
                       unpack_int4(run + (first + i) / 2, values, codes);
                       const auto scale = O::set1(quant::int4_scale_at(run, n, b));
                       for (int g = 0; g < group; ++g) {
                         acc[g] = O::fma(O::load_int8(codes + g * O::width), scale, acc[g]);
                       }
                     }
                     for (int g = 0; g < group; ++g) {
                       quant_store_values<O>(y + i + g * O::width, O::mul(acc[g], O::set1(factor)));
                     }
                   }
                   for (; i < count; ++i) {
                     float sum = 0.0f;
                     for (std::int64_t r = 0; r < blocks; ++r) {
                       const std::uint8_t* run = in + (r * outputs + o) * packed;
                       sum = quant::int8_add_value(sum, quant::int4_code_at(run, first + i),
                                                   quant::int4_scale_at(run, n, b));
                     }
                     quant_store_values<S>(y + i, S::mul(sum, factor));
                   }
                 });
  }
};

}  // namespace detail

/// out = in cut into `runs` equal runs, each packed as int4 codes (two a byte) and one fp32 scale
/// a block, one packed run after another (out: runs * int4_packed_bytes(in.size() / runs)
/// bytes). With columns > 1, in's runs are rows of `columns` runs and out takes them column by
/// column (quant::int8_source_run), as quantize_int8_blocks does.
template <class T>
void quantize_int4_blocks(std::span<const T> in, std::span<std::uint8_t> out, std::int64_t runs = 1,
                          std::int64_t columns = 1) {
  const std::int64_t n =
      quant::int4_run_values("quantize_int4_blocks", static_cast<std::int64_t>(in.size()), runs,
                             static_cast<std::int64_t>(out.size()), columns);
  const auto kernel =
      detail::quant_kernel<detail::QuantizeInt4Kernel, T, const T*, std::uint8_t*, std::int64_t,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
  parallel_chunks(runs * quant::int4_blocks(n), detail::quant_chunk_blocks, runs * n,
                  [&](std::int64_t begin, std::int64_t end) {
                    kernel(in.data(), out.data(), n, runs, columns, begin, end);
                  });
}

/// out = the values `runs` int4 packed runs stand for, one run's after another (in:
/// runs * int4_packed_bytes(out.size() / runs) bytes).
template <class T>
void dequantize_int4_blocks(std::span<const std::uint8_t> in, std::span<T> out,
                            std::int64_t runs = 1) {
  const std::int64_t n =
      quant::int4_run_values("dequantize_int4_blocks", static_cast<std::int64_t>(out.size()), runs,
                             static_cast<std::int64_t>(in.size()));
  const auto kernel = detail::quant_kernel<detail::DequantizeInt4Kernel, T, const std::uint8_t*, T*,
                                           std::int64_t, std::int64_t, std::int64_t>();
  parallel_chunks(
      runs * quant::int4_blocks(n), detail::quant_chunk_blocks, runs * n,
      [&](std::int64_t begin, std::int64_t end) { kernel(in.data(), out.data(), n, begin, end); });
}

/// out = factor * the sums of the int4 packed runs in, added in f32 in run order
/// (quant::int8_add_value) and rounded to T once, as sum_int8_blocks: out holds `outputs` runs
/// of n = out.size() / outputs values, and in a whole number of blocks of `outputs` packed runs
/// (at least one); out's run o sums run o of every block.
template <class T>
void sum_int4_blocks(std::span<const std::uint8_t> in, std::span<T> out, float factor,
                     std::int64_t outputs = 1) {
  const std::int64_t n =
      quant::int4_sum_values("sum_int4_blocks", static_cast<std::int64_t>(out.size()), outputs,
                             static_cast<std::int64_t>(in.size()));
  if (n == 0) return;
  const auto blocks =
      static_cast<std::int64_t>(in.size()) / (quant::int4_packed_bytes(n) * outputs);
  const auto kernel =
      detail::quant_kernel<detail::SumInt4Kernel, T, const std::uint8_t*, T*, std::int64_t,
                           std::int64_t, std::int64_t, float, std::int64_t, std::int64_t>();
  parallel_chunks(outputs * quant::int4_blocks(n), detail::quant_chunk_blocks, outputs * n * blocks,
                  [&](std::int64_t begin, std::int64_t end) {
                    kernel(in.data(), out.data(), n, outputs, blocks, factor, begin, end);
                  });
}

}  // namespace zero::ops::cpu
