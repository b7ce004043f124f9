#pragma once
// Linear layer kernels, PyTorch layout: weight [OC, C], bias [OC].
//   forward:  out[n, o] = sum_c inp[n, c] * weight[o, c] + bias[o]
//   backward: dinp += dout @ weight, dweight += dout^T @ inp, dbias += column sums of dout
// Gradients accumulate (+=) so micro-batches add up without a separate pass.
// Half types: GEMMs accumulate in float (gemm.hpp) and bias sums are float, rounded once.

#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/gemm.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out[N, OC] = inp[N, C] @ weight[OC, C]^T + bias[OC] (bias may be null).
template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, std::int64_t N,
                    std::int64_t C, std::int64_t OC) {
  using A = compute_type_t<T>;
  if (bias != nullptr) {
    parallel_for(N, [&](std::int64_t n) {
      for (std::int64_t o = 0; o < OC; ++o) out[n * OC + o] = bias[o];
    });
  }
  gemm<T>(Trans::no, Trans::yes, N, OC, C, A(1), inp, C, weight, C, bias ? A(1) : A(0), out, OC);
}

/// Accumulates the gradients of linear_forward; dinp, dweight, dbias may each be null.
template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     std::int64_t N, std::int64_t C, std::int64_t OC) {
  using A = compute_type_t<T>;
  if (dinp != nullptr)
    gemm<T>(Trans::no, Trans::no, N, C, OC, A(1), dout, OC, weight, C, A(1), dinp, C);
  if (dweight != nullptr) {
    gemm<T>(Trans::yes, Trans::no, OC, C, N, A(1), dout, OC, inp, C, A(1), dweight, C);
  }
  if (dbias != nullptr) {
    parallel_for(OC, [&](std::int64_t o) {  // each thread owns whole columns: deterministic
      A sum = A(0);
      for (std::int64_t n = 0; n < N; ++n) sum += load(dout[n * OC + o]);
      dbias[o] = store<T>(load(dbias[o]) + sum);
    });
  }
}

}  // namespace zero::ops::cpu
