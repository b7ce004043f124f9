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
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/gemm.cuh>

namespace zero::ops::cuda {

/// Columns per block and row slices of the bias-gradient column sum.
inline constexpr int bias_grad_columns = 32;
inline constexpr int bias_grad_slices = 8;

// ---- kernels ------------------------------------------------------------------------------------

/// dbias[o] += sum over n of dout[n, o]; block (32, 8) owns 32 columns, partial sums of rows
/// y, y + 8, ... are added in slice order.
template <class T>
__global__ void __launch_bounds__(bias_grad_columns* bias_grad_slices)
    bias_grad_kernel(T* dbias, const T* dout, int N, int OC) {
  __shared__ float part[bias_grad_slices][bias_grad_columns];
  const int o = blockIdx.x * bias_grad_columns + threadIdx.x;
  float sum = 0.0f;
  if (o < OC) {
    for (int n = threadIdx.y; n < N; n += bias_grad_slices) {
      sum += load(dout[static_cast<std::int64_t>(n) * OC + o]);
    }
  }
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && o < OC) {
    float total = 0.0f;
    for (int y = 0; y < bias_grad_slices; ++y) total += part[y][threadIdx.x];
    dbias[o] = store<T>(load(dbias[o]) + total);
  }
}

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
    expect_int_range(N * bias_grad_slices, "linear_backward");
    expect_int_range(OC, "linear_backward");
    const unsigned blocks = static_cast<unsigned>((OC + bias_grad_columns - 1) / bias_grad_columns);
    bias_grad_kernel<T><<<blocks, dim3(bias_grad_columns, bias_grad_slices), 0, stream>>>(
        dbias, dout, static_cast<int>(N), static_cast<int>(OC));
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace zero::ops::cuda
