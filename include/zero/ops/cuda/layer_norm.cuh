#pragma once
// zero-requires: cuda
// LayerNorm over the last dimension on the GPU; the twin of zero/ops/cpu/layer_norm.hpp (eps
// 1e-5, biased variance, mean and rstd saved in float for the backward pass):
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
// One block per row, sums through cub::BlockReduce (mean first, then the centred variance, as
// the host does: no E[x^2] - E[x]^2 cancellation). The parameter gradients reduce over rows in a
// fixed order (32 columns per block, 8 row slices combined in order), so they are deterministic
// and need no atomics.
// Reference: llm.c layernorm_forward/backward (dev/cuda/layernorm_*.cu).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/layer_norm.cuh needs nvcc; host-only code includes zero/ops/cpu/layer_norm.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

/// Threads per row of the LayerNorm row kernels.
inline constexpr int layer_norm_threads = 256;

// ---- kernels ------------------------------------------------------------------------------------

/// One block per row n: mean, centred variance, then the normalised row.
template <class T>
__global__ void __launch_bounds__(layer_norm_threads)
    layer_norm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                              const T* bias, int C, float eps) {
  const std::int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  float sum = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) sum += load(x[c]);
  const float m = block_all_reduce<layer_norm_threads>(sum, SumOp{}) / static_cast<float>(C);
  float sq = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = load(x[c]) - m;
    sq += d * d;
  }
  const float v = block_all_reduce<layer_norm_threads>(sq, SumOp{}) / static_cast<float>(C);
  const float s = 1.0f / sqrtf(v + eps);
  T* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    o[c] = store<T>((load(x[c]) - m) * s * load(weight[c]) + load(bias[c]));
  }
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

/// One block per row n: dinp[n] += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd.
template <class T>
__global__ void __launch_bounds__(layer_norm_threads)
    layer_norm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                     const float* mean, const float* rstd, int C) {
  const std::int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  const T* dy = dout + n * C;
  const float m = mean[n], s = rstd[n];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(x[c]) - m) * s;
    const float dnorm = load(weight[c]) * load(dy[c]);
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean =
      block_all_reduce<layer_norm_threads>(dnorm_sum, SumOp{}) / static_cast<float>(C);
  const float dnorm_norm_mean =
      block_all_reduce<layer_norm_threads>(dnorm_norm_sum, SumOp{}) / static_cast<float>(C);
  T* dx = dinp + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(x[c]) - m) * s;
    const float dnorm = load(weight[c]) * load(dy[c]);
    dx[c] = store<T>(load(dx[c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
  }
}

/// Columns per block and row slices of the column reductions (dweight, dbias, linear's dbias).
inline constexpr int column_block = 32;
inline constexpr int column_slices = 8;

/// Block (32, 8) owns 32 columns: thread (x, y) sums rows y, y + 8, ... of column x, and the 8
/// partial sums are added in slice order: a fixed order, so results repeat bit for bit.
template <class T>
__global__ void __launch_bounds__(column_block* column_slices)
    layer_norm_backward_params_kernel(T* dweight, T* dbias, const T* dout, const T* inp,
                                      const float* mean, const float* rstd, int N, int C) {
  __shared__ float dw_part[column_slices][column_block];
  __shared__ float db_part[column_slices][column_block];
  const int c = blockIdx.x * column_block + threadIdx.x;
  float dw = 0.0f, db = 0.0f;
  if (c < C) {
    for (int n = threadIdx.y; n < N; n += column_slices) {
      const std::int64_t i = static_cast<std::int64_t>(n) * C + c;
      const float norm = (load(inp[i]) - mean[n]) * rstd[n];
      dw += norm * load(dout[i]);
      db += load(dout[i]);
    }
  }
  dw_part[threadIdx.y][threadIdx.x] = dw;
  db_part[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float w = 0.0f, b = 0.0f;
    for (int y = 0; y < column_slices; ++y) {
      w += dw_part[y][threadIdx.x];
      b += db_part[y][threadIdx.x];
    }
    dweight[c] = store<T>(load(dweight[c]) + w);
    dbias[c] = store<T>(load(dbias[c]) + b);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// Normalises N rows of C; writes out [N, C], mean [N], rstd [N] (device pointers).
template <class T>
void layer_norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                        const T* bias, std::int64_t N, std::int64_t C, float eps,
                        cudaStream_t stream) {
  expect_int_range(N, "layer_norm_forward");
  expect_int_range(C, "layer_norm_forward");
  if (N == 0) return;
  layer_norm_forward_kernel<T><<<static_cast<unsigned>(N), layer_norm_threads, 0, stream>>>(
      out, mean, rstd, inp, weight, bias, static_cast<int>(C), eps);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// layer_norm_forward with the host's default eps 1e-5.
template <class T>
void layer_norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                        const T* bias, std::int64_t N, std::int64_t C, cudaStream_t stream) {
  layer_norm_forward(out, mean, rstd, inp, weight, bias, N, C, 1e-5f, stream);
}

/// Accumulates dinp, dweight, dbias from dout and the saved mean/rstd.
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const float* mean, const float* rstd, std::int64_t N,
                         std::int64_t C, cudaStream_t stream) {
  expect_int_range(N, "layer_norm_backward");
  expect_int_range(C * column_slices, "layer_norm_backward");
  if (N == 0 || C == 0) return;
  layer_norm_backward_input_kernel<T><<<static_cast<unsigned>(N), layer_norm_threads, 0, stream>>>(
      dinp, dout, inp, weight, mean, rstd, static_cast<int>(C));
  ZERO_CUDA_CHECK(cudaGetLastError());
  const unsigned blocks = static_cast<unsigned>((C + column_block - 1) / column_block);
  layer_norm_backward_params_kernel<T><<<blocks, dim3(column_block, column_slices), 0, stream>>>(
      dweight, dbias, dout, inp, mean, rstd, static_cast<int>(N), static_cast<int>(C));
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
