#pragma once
// zero-requires: cuda
// Inverted dropout on the GPU; the twin of zero/ops/cpu/dropout.hpp. The keep decision is
// cpu::DropoutMask::keep itself (a __host__ __device__ function over the Philox counter RNG of
// core/rng.hpp), so the device draws exactly the host's mask for the same (rng, stream, index),
// and the scale is DropoutMask::scale: kept f32 elements equal the host's bit for bit.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/dropout.cuh needs nvcc; host-only code includes zero/ops/cpu/dropout.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/rng.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

using cpu::DropoutMask;

// ---- kernels ------------------------------------------------------------------------------------

/// out[i] = keep(i) ? inp[i] * scale : 0.
template <class T>
__global__ void dropout_forward_kernel(T* out, const T* inp, std::int64_t n, DropoutMask mask) {
  const float scale = mask.scale<float>();
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = mask.keep(i) ? store<T>(load(inp[i]) * scale) : store<T>(0.0f);
  }
}

/// dinp[i] += keep(i) ? dout[i] * scale : 0 (dropped elements are not touched, as on the host).
template <class T>
__global__ void dropout_backward_kernel(T* dinp, const T* dout, std::int64_t n, DropoutMask mask) {
  const float scale = mask.scale<float>();
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (mask.keep(i)) dinp[i] = store<T>(load(dinp[i]) + load(dout[i]) * scale);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// Inverted dropout over n elements with the mask of (p, rng, stream_id); out may alias inp.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, double p, const CounterRng& rng,
                     std::uint32_t stream_id, cudaStream_t stream) {
  if (n == 0) return;
  dropout_forward_kernel<T><<<grid_for(n), elementwise_threads, 0, stream>>>(
      out, inp, n, DropoutMask{p, rng, stream_id});
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp += dout * mask / (1 - p), the mask redrawn from the same (p, rng, stream_id).
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, double p, const CounterRng& rng,
                      std::uint32_t stream_id, cudaStream_t stream) {
  if (n == 0) return;
  dropout_backward_kernel<T><<<grid_for(n), elementwise_threads, 0, stream>>>(
      dinp, dout, n, DropoutMask{p, rng, stream_id});
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
