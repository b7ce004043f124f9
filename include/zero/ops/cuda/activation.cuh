#pragma once
// zero-requires: cuda
// SwiGLU on the GPU (Llama's gated MLP activation), the twin of swiglu_forward/backward in
// zero/ops/cpu/activation.hpp: rows of [gate (f) | up (f)] give out = silu(gate) * up, rows of f;
// the backward writes or adds dgate = dout * up * silu'(gate) and dup = dout * silu(gate), with
// silu' = s + g s (s e), s = 1 / (1 + e), e = exp(-g). One thread per output element, the host's
// vector kernel's operations in float; expf (a couple of ulps) where the host takes its vector
// exp, so the results agree within float rounding, not bit for bit. ReLU and SiLU alone stay
// host-only (nn::Activation refuses a device pass for them).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/activation.cuh needs nvcc; host-only code includes zero/ops/cpu/activation.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// exp(-g) with -g clamped to [-87, 88] as the host's vector exp clamps its argument: below a
/// gate of -88.7 expf would overflow, and the backward's s * e would be 0 * inf, NaN, where the
/// host's slope is finite. A NaN gate still gives NaN results (through g s).
__device__ inline float swiglu_exp_neg(float g) {
  return expf(fmaxf(fminf(-g, 88.0f), -87.0f));
}

/// out[k] = silu(gate) * up for k < total = rows * f (grid-stride).
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, std::int64_t total, std::int64_t f) {
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t g_at = k / f * 2 * f + k % f;
    const float g = load(inp[g_at]), u = load(inp[g_at + f]);
    const float s = 1.0f / (1.0f + swiglu_exp_neg(g));
    out[k] = store<T>(g * s * u);
  }
}

/// dinp's gate and up elements of output k (+=, or = when overwrite).
template <class T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, std::int64_t total,
                                       std::int64_t f, bool overwrite) {
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t g_at = k / f * 2 * f + k % f, u_at = g_at + f;
    const float g = load(inp[g_at]), u = load(inp[u_at]), d = load(dout[k]);
    const float e = swiglu_exp_neg(g), s = 1.0f / (1.0f + e), gs = g * s;
    const float slope = fmaf(gs, s * e, s);  // s + g s (1 - s), 1 - s as e s
    dinp[g_at] = store<T>(fmaf(d * u, slope, overwrite ? 0.0f : load(dinp[g_at])));
    dinp[u_at] = store<T>(fmaf(d, gs, overwrite ? 0.0f : load(dinp[u_at])));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out [rows, f] = silu(gate) * up from inp [rows, 2f] = [gate | up] (device pointers, distinct).
template <class T>
void swiglu_forward(T* out, const T* inp, std::int64_t rows, std::int64_t f, cudaStream_t stream) {
  expect<ShapeError>(rows >= 0 && f >= 0, "swiglu_forward: rows ", rows, ", f ", f,
                     "; expected sizes >= 0");
  const std::int64_t total = rows * f;
  if (total == 0) return;
  swiglu_forward_kernel<T><<<grid_for(total), elementwise_threads, 0, stream>>>(out, inp, total, f);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp [rows, 2f] (+=, or = when overwrite) the gradient of swiglu_forward given dout [rows, f].
template <class T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, std::int64_t rows, std::int64_t f,
                     bool overwrite, cudaStream_t stream) {
  expect<ShapeError>(rows >= 0 && f >= 0, "swiglu_backward: rows ", rows, ", f ", f,
                     "; expected sizes >= 0");
  const std::int64_t total = rows * f;
  if (total == 0) return;
  swiglu_backward_kernel<T>
      <<<grid_for(total), elementwise_threads, 0, stream>>>(dinp, inp, dout, total, f, overwrite);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
