#pragma once
// Block-wise int8 quantization on the host (ZeRO++'s quantized weights and gradients): packs runs
// of values as core/int8_blocks.hpp lays them out, reads packed runs back, and sums packed runs
// (the reduction of qgZ's exchange). The device's twins are in ops/cuda/int8_blocks.cuh, with the
// same rules and bits.
//
// float, bf16 and f16 run the dispatched kernels (isa_dispatch.hpp): a block's largest magnitude
// is a max over vector lanes (any order gives the same maximum; a NaN never wins, as the rule's
// std::max and the device's fmaxf), its codes x / scale rounded to nearest even and clamped in
// every lane with the rule's operations, and a sum of runs one fused multiply-add a run in run
// order per lane. double runs the same bodies one value at a time. Work is cut into fixed chunks
// of whole quantization blocks or values over the OpenMP threads; every path gives the bits of
// quant::int8_code, int8_value and int8_add_value.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include <zero/core/dtype.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

// O's lanes of the values at p as floats (double: one value, rounded to float as convert does).
template <class O, class T>
inline typename O::V quant_load_values(const T* p) {
  if constexpr (dispatched_type<T>) {
    return load_lanes<O>(p);
  } else {
    static_assert(O::width == 1, "double runs the quantization kernels one value at a time");
    return convert<float>(*p);
  }
}

// Stores O's lanes at p, rounded once to T.
template <class O, class T>
inline void quant_store_values(T* p, const typename O::V& x) {
  if constexpr (dispatched_type<T>) {
    store_lanes<O>(p, x);
  } else {
    static_assert(O::width == 1, "double runs the quantization kernels one value at a time");
    *p = convert<T>(x);
  }
}

// Calls body(ops, i) for i in [first, last) stepping by the vector width, the tail one value at a
// time with the scalar ops.
template <class O, class Body>
inline void quant_lanes(std::int64_t first, std::int64_t last, Body&& body) {
  std::int64_t i = first;
  for (; i + O::width <= last; i += O::width) body(O{}, i);
  for (; i < last; ++i) body(optim::ScalarHostOps{}, i);
}

// The largest magnitude of x[0, count) over O's lanes: O::max(|x|, acc) keeps acc for a NaN |x|,
// as the rule's std::max and the device's fmaxf skip it, and any order gives the same maximum.
template <class O, class T>
inline float quant_absmax(const T* x, std::int64_t count) {
  using S = optim::ScalarHostOps;
  typename O::V acc = O::set1(0.0f);
  float tail = 0.0f;
  quant_lanes<O>(0, count, [&](auto ops, std::int64_t i) {
    if constexpr (std::is_same_v<decltype(ops), O>) {
      acc = O::max(O::abs(quant_load_values<O>(x + i)), acc);
    } else {
      tail = S::max(S::abs(quant_load_values<S>(x + i)), tail);
    }
  });
  float lanes[O::width];
  O::store(lanes, acc);
  float absmax = tail;
  for (float lane : lanes) absmax = std::max(absmax, lane);
  return absmax;
}

// codes[0, count) = the codes of x[0, count) under a nonzero scale, as quant::int8_code and
// int4_code make them: rint(x / scale) clamped to [-max_code, max_code], a NaN quotient giving
// -max_code (the rules' fmaxf, O::max's second operand).
template <class O, class T>
inline void quant_codes(const T* x, std::int64_t count, float scale, float max_code,
                        std::int8_t* codes) {
  quant_lanes<O>(0, count, [&](auto ops, std::int64_t i) {
    using P = decltype(ops);
    const auto q = P::round_nearest(P::div(quant_load_values<P>(x + i), P::set1(scale)));
    P::store_int8(codes + i, P::min(P::max(q, P::set1(-max_code)), P::set1(max_code)));
  });
}

// codes[0, count) = the codes of x[0, count) at max_code (127: int8, 7: int4), the zero block's
// codes 0 (quant::int8_code's and int4_code's); returns the block's scale (quant::int8_scale,
// int4_scale).
template <class O, class T>
inline float quant_block_codes(const T* x, std::int64_t count, float max_code, std::int8_t* codes) {
  const float scale = quant_absmax<O>(x, count) / max_code;
  if (scale == 0.0f) {
    std::memset(codes, 0, static_cast<std::size_t>(count));
  } else {
    quant_codes<O>(x, count, scale, max_code, codes);
  }
  return scale;
}

// Calls body(run, block, first, count) for quantization blocks [begin, end) of runs of n values
// (block k: run k / B, its block k % B, B = int8_blocks(n); first: the block's first value in its
// run, count: its values), the int8 and int4 kernels' unit of work.
template <class Body>
inline void quant_blocks(std::int64_t n, std::int64_t begin, std::int64_t end, Body&& body) {
  const std::int64_t per_run = quant::int8_blocks(n);
  for (std::int64_t k = begin; k < end; ++k) {
    const std::int64_t first = k % per_run * quant::int8_block;
    body(k / per_run, k % per_run, first, std::min(quant::int8_block, n - first));
  }
}

// Packs quantization blocks [begin, end) of `runs` packed runs of n values (quant_blocks): each
// block's scale, then its codes.
struct QuantizeInt8Kernel {
  template <class O, class T>
  static void run(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                  std::int64_t columns, std::int64_t begin, std::int64_t end) {
    quant_blocks(
        n, begin, end, [&](std::int64_t j, std::int64_t b, std::int64_t first, std::int64_t count) {
          const T* x = in + quant::int8_source_run(j, runs, columns) * n + first;
          std::uint8_t* run = out + j * quant::int8_packed_bytes(n);
          const float scale =
              quant_block_codes<O>(x, count, 127.0f, reinterpret_cast<std::int8_t*>(run + first));
          std::memcpy(run + quant::int8_scales_offset(n) + 4 * b, &scale, 4);
        });
  }
};

// The value index k of `runs` runs of n: calls body(run, i, last) for each stretch [i, last) of
// one run's quantization block within [begin, end).
template <class Body>
inline void quant_block_stretches(std::int64_t n, std::int64_t begin, std::int64_t end,
                                  Body&& body) {
  for (std::int64_t k = begin; k < end;) {
    const std::int64_t r = k / n, i = k - r * n;
    const std::int64_t last =
        std::min({n, (i / quant::int8_block + 1) * quant::int8_block, i + (end - k)});
    body(r, i, last);
    k += last - i;
  }
}

// out[k] for k in [begin, end) of `runs` runs of n values = what the packed runs in stand for.
struct DequantizeInt8Kernel {
  template <class O, class T>
  static void run(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t begin,
                  std::int64_t end) {
    quant_block_stretches(
        n, begin, end, [&](std::int64_t r, std::int64_t first, std::int64_t last) {
          const std::uint8_t* run = in + r * quant::int8_packed_bytes(n);
          const float scale = quant::int8_scale_at(run, n, first / quant::int8_block);
          const auto* codes = reinterpret_cast<const std::int8_t*>(run);
          T* y = out + r * n;
          quant_lanes<O>(first, last, [&](auto ops, std::int64_t i) {
            using P = decltype(ops);
            quant_store_values<P>(y + i, P::mul(P::load_int8(codes + i), P::set1(scale)));
          });
        });
  }
};

// out[k] for k in [begin, end) of `outputs` runs of n values = factor * the f32 sum of that value
// of run (k / n) in every one of the `blocks` blocks of packed runs, one fused multiply-add a run
// in run order (quant::int8_add_value), four vectors at a time.
struct SumInt8Kernel {
  static constexpr int group = 4;

  template <class O, class T>
  static void run(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t outputs,
                  std::int64_t blocks, float factor, std::int64_t begin, std::int64_t end) {
    const std::int64_t packed = quant::int8_packed_bytes(n);
    quant_block_stretches(
        n, begin, end, [&](std::int64_t o, std::int64_t first, std::int64_t last) {
          const std::int64_t block = first / quant::int8_block;
          const auto sums = [&](auto ops, std::int64_t i, auto width) {
            using P = decltype(ops);
            typename P::V acc[decltype(width)::value];
            for (auto& a : acc) a = P::set1(0.0f);
            for (std::int64_t b = 0; b < blocks; ++b) {
              const std::uint8_t* run = in + (b * outputs + o) * packed;
              const auto scale = P::set1(quant::int8_scale_at(run, n, block));
              const auto* codes = reinterpret_cast<const std::int8_t*>(run) + i;
              for (int g = 0; g < decltype(width)::value; ++g) {
                acc[g] = P::fma(P::load_int8(codes + g * P::width), scale, acc[g]);
              }
            }
            for (int g = 0; g < decltype(width)::value; ++g) {
              quant_store_values<P>(out + o * n + i + g * P::width,
                                    P::mul(acc[g], P::set1(factor)));
            }
          };
          std::int64_t i = first;
          for (; i + group * O::width <= last; i += group * O::width) {
            sums(O{}, i, std::integral_constant<int, group>{});
          }
          quant_lanes<O>(i, last, [&](auto ops, std::int64_t at) {
            sums(ops, at, std::integral_constant<int, 1>{});
          });
        });
  }
};

// Quantization blocks a chunk of the packing takes (4096 values); int8's reading back and sums
// take chunks of elementwise_chunk values.
inline constexpr std::int64_t quant_chunk_blocks = elementwise_chunk / quant::int8_block;

// Body's entry for T: the dispatched ISA's for float, bf16 and f16, the scalar one for double.
template <class Body, class T, class... Args>
auto quant_kernel() -> void (*)(Args...) {
  if constexpr (dispatched_type<T>) {
    return kernel_for<Body, Args...>();
  } else {
    return &kernel_scalar<Body, Args...>;
  }
}

}  // namespace detail

/// out = in cut into `runs` equal runs, each packed as int8 codes and one fp32 scale a block, one
/// packed run after another (out: runs * int8_packed_bytes(in.size() / runs) bytes). With
/// columns > 1, in's runs are rows of `columns` runs and out takes them column by column: packed
/// run j is in's run quant::int8_source_run(j, runs, columns) (qgZ's first hop sends each rank
/// of a node the runs of the shards at its place in every node).
template <class T>
void quantize_int8_blocks(std::span<const T> in, std::span<std::uint8_t> out, std::int64_t runs = 1,
                          std::int64_t columns = 1) {
  const std::int64_t n =
      quant::int8_run_values("quantize_int8_blocks", static_cast<std::int64_t>(in.size()), runs,
                             static_cast<std::int64_t>(out.size()), columns);
  const auto kernel =
      detail::quant_kernel<detail::QuantizeInt8Kernel, T, const T*, std::uint8_t*, std::int64_t,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
  parallel_chunks(runs * quant::int8_blocks(n), detail::quant_chunk_blocks, runs * n,
                  [&](std::int64_t begin, std::int64_t end) {
                    kernel(in.data(), out.data(), n, runs, columns, begin, end);
                  });
}

/// out = the values `runs` packed runs stand for, one run's after another (in:
/// runs * int8_packed_bytes(out.size() / runs) bytes).
template <class T>
void dequantize_int8_blocks(std::span<const std::uint8_t> in, std::span<T> out,
                            std::int64_t runs = 1) {
  const std::int64_t n =
      quant::int8_run_values("dequantize_int8_blocks", static_cast<std::int64_t>(out.size()), runs,
                             static_cast<std::int64_t>(in.size()));
  const auto kernel = detail::quant_kernel<detail::DequantizeInt8Kernel, T, const std::uint8_t*, T*,
                                           std::int64_t, std::int64_t, std::int64_t>();
  const auto values = static_cast<std::int64_t>(out.size());
  parallel_chunks(values, elementwise_chunk, values, [&](std::int64_t begin, std::int64_t end) {
    kernel(in.data(), out.data(), n, begin, end);
  });
}

/// out = factor * the sums of the packed runs in, added in f32 in run order
/// (quant::int8_add_value) and rounded to T once: qgZ's reduction of what every rank sent for
/// this rank's shard, with factor 1 / ranks for their mean. out holds `outputs` runs of
/// n = out.size() / outputs values, and in a whole number of blocks of `outputs` packed runs
/// (at least one); out's run o sums run o of every block.
template <class T>
void sum_int8_blocks(std::span<const std::uint8_t> in, std::span<T> out, float factor,
                     std::int64_t outputs = 1) {
  const std::int64_t n =
      quant::int8_sum_values("sum_int8_blocks", static_cast<std::int64_t>(out.size()), outputs,
                             static_cast<std::int64_t>(in.size()));
  if (n == 0) return;
  const auto blocks =
      static_cast<std::int64_t>(in.size()) / (quant::int8_packed_bytes(n) * outputs);
  const auto kernel =
      detail::quant_kernel<detail::SumInt8Kernel, T, const std::uint8_t*, T*, std::int64_t,
                           std::int64_t, std::int64_t, float, std::int64_t, std::int64_t>();
  const auto values = static_cast<std::int64_t>(out.size());
  parallel_chunks(values, elementwise_chunk, values * blocks,
                  [&](std::int64_t begin, std::int64_t end) {
                    kernel(in.data(), out.data(), n, outputs, blocks, factor, begin, end);
                  });
}

}  // namespace zero::ops::cpu
