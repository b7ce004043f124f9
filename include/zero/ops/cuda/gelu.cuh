#pragma once
// zero-requires: cuda
// GELU, tanh approximation (GPT-2), on the GPU; the twin of zero/ops/cpu/gelu.hpp:
//   y = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),  s = sqrt(2 / pi).
// s is computed on the host exactly as the host kernel computes it and passed in, so the only
// difference from the host is tanhf's last-ulp rounding on the device.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/gelu.cuh needs nvcc; host-only code includes zero/ops/cpu/gelu.hpp"
#endif

#include <cmath>
#include <cstdint>
#include <numbers>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

/// sqrt(2/pi) in float, the host kernel's expression.
inline float gelu_tanh_scale() {
  return std::sqrt(2.0f / std::numbers::pi_v<float>);
}

// ---- kernels ------------------------------------------------------------------------------------

/// out[i] = gelu(inp[i]).
template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, std::int64_t n, float s) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float x = load(inp[i]);
    out[i] = store<T>(0.5f * x * (1.0f + tanhf(s * (x + 0.044715f * x * x * x))));
  }
}

/// dinp[i] += gelu'(inp[i]) * dout[i], the host's expression term for term.
template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, std::int64_t n,
                                     float s) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float x = load(inp[i]);
    const float u = s * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float grad =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * s * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = store<T>(load(dinp[i]) + grad * load(dout[i]));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out[i] = gelu(inp[i]) for n elements (out may alias inp).
template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_forward_kernel<T>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(out, inp, n, gelu_tanh_scale());
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp[i] += gelu'(inp[i]) * dout[i].
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_backward_kernel<T>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(dinp, inp, dout, n, gelu_tanh_scale());
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
