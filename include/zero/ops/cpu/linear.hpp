#pragma once
// Linear layer kernels, PyTorch layout: weight [OC, C], bias [OC].
//   forward:  out[n, o] = sum_c inp[n, c] * weight[o, c] + bias[o]
//   backward: dinp += dout @ weight, dweight += dout^T @ inp, dbias += column sums of dout
// Gradients accumulate (+=) so micro-batches add up without a separate pass.
// Half types: GEMMs accumulate in float (gemm.hpp) and bias sums are float, rounded once.
// float, bf16 and f16 sum the bias gradient through a dispatched kernel (isa_dispatch.hpp): the
// columns are vector lanes, each adding the rows in order, so every ISA gives the same bits.

#include <algorithm>
#include <array>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/gemm.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

struct BiasGradient {
  // dbias[c0, c1) += the column sums of dout [N, OC] there.
  template <class O, class T>
  static void run(T* dbias, const T* dout, std::int64_t N, std::int64_t OC, std::int64_t c0,
                  std::int64_t c1) {
    reduce_columns<O, 1>(
        c0, c1, N,
        [](auto ops, std::int64_t) {
          using P = decltype(ops);
          return std::array<typename P::V, 1>{P::set1(0.0f)};
        },
        [&](auto ops, auto& acc, std::int64_t n, std::int64_t c) {
          using P = decltype(ops);
          acc[0] = P::add(acc[0], load_lanes<P>(dout + n * OC + c));
        },
        [&](auto ops, const auto& acc, std::int64_t c) {
          using P = decltype(ops);
          store_lanes<P>(dbias + c, P::add(load_lanes<P>(dbias + c), acc[0]));
        });
  }
};

}  // namespace detail

/// out[N, OC] = inp[N, C] @ weight[OC, C]^T + bias[OC] (bias may be null).
template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, std::int64_t N,
                    std::int64_t C, std::int64_t OC) {
  gemm_bias<T>(Trans::no, Trans::yes, N, OC, C, inp, C, weight, C, bias, out, OC);
}

/// Accumulates the gradients of linear_forward; dinp, dweight, dbias may each be null.
/// overwrite_dinp writes dinp instead (the values of accumulating into zeros).
template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     std::int64_t N, std::int64_t C, std::int64_t OC, bool overwrite_dinp = false) {
  using A = compute_type_t<T>;
  if (dinp != nullptr) {
    gemm<T>(Trans::no, Trans::no, N, C, OC, A(1), dout, OC, weight, C, overwrite_dinp ? A(0) : A(1),
            dinp, C);
  }
  if (dweight != nullptr) {
    gemm<T>(Trans::yes, Trans::no, OC, C, N, A(1), dout, OC, inp, C, A(1), dweight, C);
  }
  if (dbias == nullptr) return;
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::BiasGradient, T*, const T*, std::int64_t, std::int64_t,
                                   std::int64_t, std::int64_t>();
    parallel_chunks(OC, 64, N * OC,
                    [&](std::int64_t c0, std::int64_t c1) { kernel(dbias, dout, N, OC, c0, c1); });
  } else {
    parallel_for(OC, [&](std::int64_t o) {  // each thread owns whole columns: deterministic
      A sum = A(0);
      for (std::int64_t n = 0; n < N; ++n) sum += load(dout[n * OC + o]);
      dbias[o] = store<T>(load(dbias[o]) + sum);
    });
  }
}

}  // namespace zero::ops::cpu
