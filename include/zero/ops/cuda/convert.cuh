#pragma once
// zero-requires: cuda
// Element type conversion on the GPU: round to nearest even through zero::convert (the very
// bf16/f16 constructors of core/bfloat16.hpp and core/float16.hpp), and stochastic rounding to
// bf16 through bf16::round_stochastic with optim::rounding_bits (optim/lane_ops.hpp) as the
// random source, the host optimizer's rule: the device gives the host's bits for the same
// (key, step, element index).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/convert.cuh needs nvcc; host-only code uses zero::convert (zero/core/dtype.hpp)"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <optim/lane_ops.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/dtype.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// out[i] = zero::convert<To>(in[i]).
template <class To, class From>
__global__ void convert_kernel(To* out, const From* in, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = ::zero::convert<To>(in[i]);
  }
}

/// out[i] = in[i] rounded stochastically to bf16 with the bits of element first_index + i.
template <class From>
__global__ void round_stochastic_kernel(bf16* out, const From* in, std::int64_t n,
                                        std::uint64_t key, std::uint32_t step,
                                        std::uint64_t first_index) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t random16 =
        optim::rounding_bits(key, step, first_index + static_cast<std::uint64_t>(i));
    out[i] = bf16::from_bits(bf16::round_stochastic(load(in[i]), random16));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out[i] = in[i] converted (nearest even when narrowing) for n elements.
template <class To, class From>
void convert_elements(To* out, const From* in, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  convert_kernel<To, From><<<grid_for(n), elementwise_threads, 0, stream>>>(out, in, n);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out[i] = in[i] rounded to bf16 stochastically; element i draws its bits as element
/// first_index + i of (key, step) (optim::rounding_bits), so any split of a shard into calls
/// gives the same bits as one call over the whole.
template <class From>
void round_stochastic_bf16(bf16* out, const From* in, std::int64_t n, std::uint64_t key,
                           std::uint32_t step, std::uint64_t first_index, cudaStream_t stream) {
  if (n == 0) return;
  round_stochastic_kernel<From>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(out, in, n, key, step, first_index);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
