#pragma once
// zero-requires: cuda
// Elementwise kernels on the GPU, twins of zero/ops/cpu/elementwise.hpp: residual add,
// accumulate, and the bias add of a linear layer. Each element is loaded to float, added there
// and rounded once, as on the host, so results equal the host's bit for bit.
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/elementwise.cuh needs nvcc; host-only code includes zero/ops/cpu/elementwise.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// out[i] = a[i] + b[i], grid-stride.
template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = store<T>(load(a[i]) + load(b[i]));
  }
}

/// out[n, o] += bias[o] over rows of OC, grid-stride over all N*OC elements.
template <class T>
__global__ void add_bias_kernel(T* out, const T* bias, std::int64_t total, std::int64_t OC) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = store<T>(load(out[i]) + load(bias[i % OC]));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out = a + b over n elements (out may alias a or b).
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<T><<<grid_for(n), elementwise_threads, 0, stream>>>(out, a, b, n);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// acc += x over n elements.
template <class T>
void accumulate(T* acc, const T* x, std::int64_t n, cudaStream_t stream) {
  add<T>(acc, acc, x, n, stream);
}

/// out[N, OC] += bias[OC] broadcast over the rows (what linear_forward's epilogue does, for
/// callers that produced out another way).
template <class T>
void add_bias(T* out, const T* bias, std::int64_t N, std::int64_t OC, cudaStream_t stream) {
  if (N * OC == 0) return;
  add_bias_kernel<T><<<grid_for(N * OC), elementwise_threads, 0, stream>>>(out, bias, N * OC, OC);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
