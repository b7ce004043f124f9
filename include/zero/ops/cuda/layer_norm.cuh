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
#include <zero/ops/cuda/column_sum.cuh>
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

/// LayerNorm's parameter-gradient terms of row n, column c: (x - mean) rstd dy and dy.
template <class T>
struct LayerNormParamTerms {
  const T* dout;
  const T* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float (&v)[2]) const {
    const std::int64_t i = static_cast<std::int64_t>(n) * C + c;
    const float dy = load(dout[i]);
    v[0] = (load(inp[i]) - mean[n]) * rstd[n] * dy;
    v[1] = dy;
  }
};

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
  expect_int_range(C, "layer_norm_backward");
  if (N == 0 || C == 0) return;
  layer_norm_backward_input_kernel<T><<<static_cast<unsigned>(N), layer_norm_threads, 0, stream>>>(
      dinp, dout, inp, weight, mean, rstd, static_cast<int>(C));
  ZERO_CUDA_CHECK(cudaGetLastError());
  column_sums<T, 2>({{dweight, dbias}},
                    LayerNormParamTerms<T>{dout, inp, mean, rstd, static_cast<int>(C)}, N, C,
                    "layer_norm_backward", stream);
}

}  // namespace zero::ops::cuda
