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

/// out[i] = a[i] + b[i] (Packed: 16-byte accesses, common.cuh's map_elements).
template <class T, bool Packed>
__global__ void add_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  map_elements<T, Packed>(
      out, n, [](T x, T y) { return store<T>(load(x) + load(y)); }, a, b);
}

/// out[n, c] = x[n, c] + rows[n % R, c] over rows of C, grid-stride over all N*C elements.
template <class T>
__global__ void add_periodic_rows_kernel(T* out, const T* x, const T* rows, std::int64_t total,
                                         std::int64_t C, std::int64_t R) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = store<T>(load(x[i]) + load(rows[(i / C) % R * C + i % C]));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out = a + b over n elements (out may alias a or b).
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16({out, a, b})) {
    add_kernel<T, true>
        <<<grid_for(n / pack_size<T> + 1), elementwise_threads, 0, stream>>>(out, a, b, n);
  } else {
    add_kernel<T, false><<<grid_for(n), elementwise_threads, 0, stream>>>(out, a, b, n);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// acc += x over n elements.
template <class T>
void accumulate(T* acc, const T* x, std::int64_t n, cudaStream_t stream) {
  add<T>(acc, acc, x, n, stream);
}

/// out[n, c] = x[n, c] + rows[n % R, c] for N rows of C (out may alias x): a position table of
/// R = T rows added to B sequences of T rows, or a bias (R = 1).
template <class T>
void add_periodic_rows(T* out, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                       std::int64_t C, cudaStream_t stream) {
  if (N * C == 0) return;
  add_periodic_rows_kernel<T>
      <<<grid_for(N * C), elementwise_threads, 0, stream>>>(out, x, rows, N * C, C, R);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out[N, OC] += bias[OC] broadcast over the rows (what linear_forward's epilogue does, for
/// callers that produced out another way).
template <class T>
void add_bias(T* out, const T* bias, std::int64_t N, std::int64_t OC, cudaStream_t stream) {
  add_periodic_rows(out, out, bias, N, 1, OC, stream);
}

}  // namespace zero::ops::cuda
