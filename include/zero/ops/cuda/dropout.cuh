#pragma once
// zero-requires: cuda
// Inverted dropout on the GPU; the twin of zero/ops/cpu/dropout.hpp. The keep decision is
// cpu::DropoutMask's own __host__ __device__ functions over the Philox counter RNG of core/rng.hpp
// (keep for one element; group_words and kept for a 16-byte chunk, one Philox call per four
// elements), so the device draws exactly the host's mask for the same (rng, stream, index), and
// the scale is DropoutMask::scale: kept f32 elements equal the host's bit for bit.
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

/// Calls fn(k, kept) for the P elements of the chunk at element i (i a multiple of P, P a
/// multiple of DropoutMask::group_size, the mask's chunks whole groups: whole_groups<T>): one
/// Philox call per group of four.
template <int P, class Fn>
__device__ __forceinline__ void for_chunk_mask(const DropoutMask& mask, std::int64_t i, Fn&& fn) {
  constexpr int G = DropoutMask::group_size;
  static_assert(P % G == 0, "a chunk is whole mask groups");
#pragma unroll
  for (int g = 0; g < P / G; ++g) {
    const auto words = mask.group_words(mask.index_of(i) / G + g);
#pragma unroll
    for (int k = 0; k < G; ++k) fn(g * G + k, mask.kept(words[k]));
  }
}

/// out[i] = inp[i] * (keep(i) ? scale : 0) (DropoutMask::factor: a dropped NaN or infinity is
/// NaN, as on the host; Packed: 16-byte chunks, one draw per group of four).
template <class T, bool Packed>
__global__ void dropout_forward_kernel(T* out, const T* inp, std::int64_t n, DropoutMask mask) {
  const float scale = mask.scale<float>();
  const auto element = [&](std::int64_t i, T x) {
    return store<T>(load(x) * DropoutMask::factor(mask.keep(i), scale));
  };
  if constexpr (Packed) {
    constexpr int P = chunk_size<T>;
    const auto chunk = [&](std::int64_t i, const Chunk<T, P>& x) {
      Chunk<T, P> y;
      for_chunk_mask<P>(mask, i, [&](int k, bool kept) {
        y[k] = store<T>(load(x[k]) * DropoutMask::factor(kept, scale));
      });
      return y;
    };
    map_chunks<P>(out, n, chunk, element, inp);
  } else {
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      out[i] = element(i, inp[i]);
    }
  }
}

/// dinp[i] += dout[i] * (keep(i) ? scale : 0): a dropped element adds dout * 0, which keeps a
/// finite dinp and gives NaN for a NaN or infinite dout, as on the host (Packed as in the
/// forward). The host adds with one fused multiply-add, so the device asks for one (__fmaf_rn)
/// rather than relying on nvcc's contraction, which -fmad=false turns off.
template <class T, bool Packed>
__global__ void dropout_backward_kernel(T* dinp, const T* dout, std::int64_t n, DropoutMask mask) {
  const float scale = mask.scale<float>();
  const auto element = [&](std::int64_t i, T dx, T dy) {
    return store<T>(__fmaf_rn(load(dy), DropoutMask::factor(mask.keep(i), scale), load(dx)));
  };
  if constexpr (Packed) {
    constexpr int P = chunk_size<T>;
    const auto chunk = [&](std::int64_t i, const Chunk<T, P>& dx, const Chunk<T, P>& dy) {
      Chunk<T, P> r;
      for_chunk_mask<P>(mask, i, [&](int k, bool kept) {
        r[k] = store<T>(__fmaf_rn(load(dy[k]), DropoutMask::factor(kept, scale), load(dx[k])));
      });
      return r;
    };
    map_chunks<P>(dinp, n, chunk, element, static_cast<const T*>(dinp), dout);
  } else {
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      const float factor = DropoutMask::factor(mask.keep(i), scale);
      dinp[i] = store<T>(__fmaf_rn(load(dout[i]), factor, load(dinp[i])));
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// Whether every 16-byte chunk of T's elements is whole mask groups (the chunk kernels' draw): the
/// mask's first index is a multiple of the group size and, placed in blocks, each block is whole
/// chunks starting at a group.
template <class T>
bool whole_groups(const DropoutMask& mask) {
  constexpr std::uint64_t G = DropoutMask::group_size;
  return mask.first % G == 0 &&
         (mask.block == 0 || (mask.block % chunk_size<T> == 0 && mask.stride % G == 0));
}

/// Inverted dropout over n elements with mask (element i at mask.index_of(i)); out may alias
/// inp.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, const DropoutMask& mask,
                     cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16({out, inp}) && whole_groups<T>(mask)) {
    dropout_forward_kernel<T, true>
        <<<grid_for(n / chunk_size<T> + 1), elementwise_threads, 0, stream>>>(out, inp, n, mask);
  } else {
    dropout_forward_kernel<T, false>
        <<<grid_for(n), elementwise_threads, 0, stream>>>(out, inp, n, mask);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp += dout * mask / (1 - p), the mask redrawn as the forward's.
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, const DropoutMask& mask,
                      cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16({dinp, dout}) && whole_groups<T>(mask)) {
    dropout_backward_kernel<T, true>
        <<<grid_for(n / chunk_size<T> + 1), elementwise_threads, 0, stream>>>(dinp, dout, n, mask);
  } else {
    dropout_backward_kernel<T, false>
        <<<grid_for(n), elementwise_threads, 0, stream>>>(dinp, dout, n, mask);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dropout_forward over the mask of (p, rng, stream_id) from index 0.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, double p, const CounterRng& rng,
                     std::uint32_t stream_id, cudaStream_t stream) {
  dropout_forward(out, inp, n, DropoutMask{p, rng, stream_id}, stream);
}

/// dropout_backward over the mask of (p, rng, stream_id) from index 0.
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, double p, const CounterRng& rng,
                      std::uint32_t stream_id, cudaStream_t stream) {
  dropout_backward(dinp, dout, n, DropoutMask{p, rng, stream_id}, stream);
}

}  // namespace zero::ops::cuda
