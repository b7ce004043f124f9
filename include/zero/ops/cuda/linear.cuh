#pragma once
// zero-requires: cuda
// Linear layer kernels on the GPU, PyTorch layout (weight [OC, C], bias [OC]); the twin of
// zero/ops/cpu/linear.hpp:
//   forward:  out[n, o] = sum_c inp[n, c] * weight[o, c] + bias[o]     (bias in the epilogue)
//   backward: dinp += dout @ weight, dweight += dout^T @ inp, dbias += column sums of dout
// Gradients accumulate (+=, GEMM beta = 1) like the host's. The bias gradient is a column sum in
// a fixed order (no atomics): 32 columns per block, 8 row slices added in slice order.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/linear.cuh needs nvcc; host-only code includes zero/ops/cpu/linear.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/column_sum.cuh>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/gemm.cuh>

namespace zero::ops::cuda {

/// A linear layer's bias-gradient term of row n, column o: dout[n, o].
template <class T>
struct BiasGradTerm {
  const T* dout;
  int OC;
  __device__ void operator()(int n, int o, float (&v)[1]) const {
    v[0] = load(dout[static_cast<std::int64_t>(n) * OC + o]);
  }
};

// ---- launchers ----------------------------------------------------------------------------------

/// out[N, OC] = inp[N, C] @ weight[OC, C]^T + bias[OC] (bias may be null).
template <class T>
void linear_forward(GemmContext& ctx, T* out, const T* inp, const T* weight, const T* bias,
                    std::int64_t N, std::int64_t C, std::int64_t OC, cudaStream_t stream) {
  gemm<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC,
          bias != nullptr ? Epilogue::bias : Epilogue::none, bias, stream);
}

/// out = gelu(inp @ weight^T + bias) in one cuBLASLt call (GELU-tanh epilogue; bias required).
/// The GPT block keeps the pre-activation for its backward pass and so uses linear_forward plus
/// gelu_forward; this fused form serves inference and the benchmark.
template <class T>
void linear_gelu_forward(GemmContext& ctx, T* out, const T* inp, const T* weight, const T* bias,
                         std::int64_t N, std::int64_t C, std::int64_t OC, cudaStream_t stream) {
  gemm<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC,
          Epilogue::gelu_bias, bias, stream);
}

/// Accumulates the gradients of linear_forward; dinp, dweight, dbias may each be null.
template <class T>
void linear_backward(GemmContext& ctx, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, std::int64_t N, std::int64_t C, std::int64_t OC,
                     cudaStream_t stream) {
  if (dinp != nullptr) {
    gemm<T>(ctx, Trans::no, Trans::no, N, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C, stream);
  }
  if (dweight != nullptr) {
    gemm<T>(ctx, Trans::yes, Trans::no, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C, stream);
  }
  if (dbias != nullptr && OC > 0) {
    column_sums<T, 1>({{dbias}}, BiasGradTerm<T>{dout, static_cast<int>(OC)}, N, OC,
                      "linear_backward", stream);
  }
}

}  // namespace zero::ops::cuda
