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
#include <type_traits>

#include <cuda_runtime.h>

#include <optim/lane_ops.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/dtype.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// out[i] = zero::convert<To>(in[i]) (Packed: 16-byte accesses, common.cuh's map_elements); from
/// float through store, the kernels' own rounding, so its bits are held to the host's here.
template <class To, class From, bool Packed>
__global__ void convert_kernel(To* out, const From* in, std::int64_t n) {
  map_elements<To, Packed>(
      out, n,
      [](From x) {
        if constexpr (std::is_same_v<From, float>) {
          return store<To>(x);
        } else {
          return ::zero::convert<To>(x);
        }
      },
      in);
}

/// out[i] = in[i] rounded stochastically to bf16 with the bits of element first_index + i.
/// Grouped (first_index a multiple of optim::rounding_group, every pointer 16-byte aligned): each
/// chunk of 8 elements is one rounding group, so it makes one Philox call for its 8 elements and
/// moves them as 16-byte packs; otherwise every element draws its own group's bits.
template <class From, bool Grouped>
__global__ void round_stochastic_kernel(bf16* out, const From* in, std::int64_t n,
                                        std::uint64_t key, std::uint32_t step,
                                        std::uint64_t first_index) {
  const auto element = [&](std::int64_t i, From x) {
    const std::uint32_t random16 =
        optim::rounding_bits(key, step, first_index + static_cast<std::uint64_t>(i));
    return bf16::from_bits(bf16::round_stochastic(load(x), random16));
  };
  if constexpr (Grouped) {
    constexpr int P = optim::rounding_group;
    static_assert(P == chunk_size<bf16, From>, "a chunk is one rounding group");
    const auto chunk = [&](std::int64_t i, const Chunk<From, P>& x) {
      const std::uint64_t index = first_index + static_cast<std::uint64_t>(i);
      const auto words = optim::rounding_words(key, step, index / P);
      Chunk<bf16, P> result;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        result[k] = bf16::from_bits(
            bf16::round_stochastic(load(x[k]), optim::rounding_bits_in(words, index + k)));
      }
      return result;
    };
    map_chunks<P>(out, n, chunk, element, in);
  } else {
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += stride) {
      out[i] = element(i, in[i]);
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out[i] = in[i] converted (nearest even when narrowing) for n elements.
template <class To, class From>
void convert_elements(To* out, const From* in, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16({out, in})) {
    convert_kernel<To, From, true>
        <<<grid_for(n / chunk_size<To, From> + 1), elementwise_threads, 0, stream>>>(out, in, n);
  } else {
    convert_kernel<To, From, false><<<grid_for(n), elementwise_threads, 0, stream>>>(out, in, n);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out[i] = in[i] rounded to bf16 stochastically; element i draws its bits as element
/// first_index + i of (key, step) (optim::rounding_bits), so any split of a shard into calls
/// gives the same bits as one call over the whole.
template <class From>
void round_stochastic_bf16(bf16* out, const From* in, std::int64_t n, std::uint64_t key,
                           std::uint32_t step, std::uint64_t first_index, cudaStream_t stream) {
  if (n == 0) return;
  if (first_index % optim::rounding_group == 0 && aligned16({out, in})) {
    round_stochastic_kernel<From, true>
        <<<grid_for(n / optim::rounding_group + 1), elementwise_threads, 0, stream>>>(
            out, in, n, key, step, first_index);
  } else {
    round_stochastic_kernel<From, false>
        <<<grid_for(n), elementwise_threads, 0, stream>>>(out, in, n, key, step, first_index);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
