#pragma once
// zero-requires: cuda
// Rotary position embedding on the GPU, the twin of zero/ops/cpu/rotary.hpp: on rows of grouped
// qkv (kv_heads groups of `group` query heads, one key head and one value head, each head_size
// channels), pair i of every query and key head at position t turns by the angle whose cos and
// sin are the table's [t, i] (ops::cpu::rotary_table, computed on the host in double and copied
// to the device once); value heads are copied. One thread per pair (i, i + head_size/2) of a
// head, consecutive threads on consecutive pairs. Each value is the host's operations in float,
// written out so nvcc cannot contract them otherwise: a rounded product and one fused
// multiply-add (x[i] cos - x[i + h] sin as fma(-x[i + h], sin, x[i] cos); the backward's sum
// added to the gradient's start), so the results equal the host's bit for bit.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/rotary.cuh needs nvcc; host-only code includes zero/ops/cpu/rotary.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/error.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

namespace rotary_detail {

/// Where pair p of the n rows lies: the offset of its head's first channel, its index i in the
/// head, its row's position index t, and whether the head turns (a query or key head).
struct PairAt {
  std::int64_t head_offset;
  int i, t;
  bool rotates;
};

__device__ __forceinline__ PairAt pair_at(std::int64_t p, int seq_len, int heads, int group,
                                          int half) {
  const auto i = static_cast<int>(p % half);
  const std::int64_t head = p / half;  // over all rows' heads
  const auto h = static_cast<int>(head % heads);
  const std::int64_t row = head / heads;
  return {head * 2 * half, i, static_cast<int>(row % seq_len), h % (group + 2) <= group};
}

}  // namespace rotary_detail

/// out = inp with each query and key head turned (one thread per pair, grid-stride).
template <class T>
__global__ void rotary_forward_kernel(T* out, const T* inp, const float* cos_t, const float* sin_t,
                                      std::int64_t pairs, int seq_len, int heads, int group,
                                      int half) {
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const rotary_detail::PairAt at = rotary_detail::pair_at(p, seq_len, heads, group, half);
    const std::int64_t lo = at.head_offset + at.i, hi = lo + half;
    if (!at.rotates) {
      out[lo] = inp[lo];
      out[hi] = inp[hi];
      continue;
    }
    const float c = cos_t[at.t * half + at.i], s = sin_t[at.t * half + at.i];
    const float a = load(inp[lo]), b = load(inp[hi]);
    out[lo] = store<T>(__fmaf_rn(-b, s, __fmul_rn(a, c)));
    out[hi] = store<T>(__fmaf_rn(a, s, __fmul_rn(b, c)));
  }
}

/// dinp (+=, or = when overwrite) dout with each query and key head turned back.
template <class T>
__global__ void rotary_backward_kernel(T* dinp, const T* dout, const float* cos_t,
                                       const float* sin_t, std::int64_t pairs, int seq_len,
                                       int heads, int group, int half, bool overwrite) {
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const rotary_detail::PairAt at = rotary_detail::pair_at(p, seq_len, heads, group, half);
    const std::int64_t lo = at.head_offset + at.i, hi = lo + half;
    const float start_lo = overwrite ? 0.0f : load(dinp[lo]);
    const float start_hi = overwrite ? 0.0f : load(dinp[hi]);
    const float a = load(dout[lo]), b = load(dout[hi]);
    if (!at.rotates) {
      dinp[lo] = store<T>(start_lo + a);
      dinp[hi] = store<T>(start_hi + b);
      continue;
    }
    const float c = cos_t[at.t * half + at.i], s = sin_t[at.t * half + at.i];
    dinp[lo] = store<T>(__fadd_rn(start_lo, __fmaf_rn(b, s, __fmul_rn(a, c))));
    dinp[hi] = store<T>(__fadd_rn(start_hi, __fmaf_rn(-a, s, __fmul_rn(b, c))));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

namespace rotary_detail {

/// The pairs of n rows, after checking the shape fits the kernels' int fields.
inline std::int64_t checked_pairs(std::int64_t n, std::int64_t seq_len, std::int64_t kv_heads,
                                  std::int64_t group, std::int64_t head_size, const char* op) {
  expect<ShapeError>(
      n >= 0 && seq_len > 0 && kv_heads > 0 && group > 0 && head_size > 0 && head_size % 2 == 0, op,
      ": rows ", n, ", seq_len ", seq_len, ", kv_heads ", kv_heads, ", group ", group,
      ", head_size ", head_size, "; expected positive sizes and an even head_size");
  expect<ShapeError>(n % seq_len == 0, op, ": ", n, " rows are not whole sequences of ", seq_len);
  expect_int_range(seq_len * (head_size / 2), op);
  expect_int_range(kv_heads * (group + 2), op);
  return n * kv_heads * (group + 2) * (head_size / 2);
}

}  // namespace rotary_detail

/// out [n, kv_heads * (group + 2) * head_size] = inp's rows with every query and key head turned
/// by its position's angles; cos_t, sin_t: rotary_table's [seq_len, head_size / 2] in device
/// memory (float). All pointers device memory; out and inp distinct.
template <class T>
void rotary_forward(T* out, const T* inp, const float* cos_t, const float* sin_t, std::int64_t n,
                    std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                    std::int64_t head_size, cudaStream_t stream) {
  const std::int64_t pairs =
      rotary_detail::checked_pairs(n, seq_len, kv_heads, group, head_size, "rotary_forward");
  if (pairs == 0) return;
  rotary_forward_kernel<T><<<grid_for(pairs), elementwise_threads, 0, stream>>>(
      out, inp, cos_t, sin_t, pairs, static_cast<int>(seq_len),
      static_cast<int>(kv_heads * (group + 2)), static_cast<int>(group),
      static_cast<int>(head_size / 2));
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp (+=, or = when overwrite) the gradient of rotary_forward given dout: each query and key
/// head turned back by its position's angles, value heads passed through.
template <class T>
void rotary_backward(T* dinp, const T* dout, const float* cos_t, const float* sin_t, std::int64_t n,
                     std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                     std::int64_t head_size, bool overwrite, cudaStream_t stream) {
  const std::int64_t pairs =
      rotary_detail::checked_pairs(n, seq_len, kv_heads, group, head_size, "rotary_backward");
  if (pairs == 0) return;
  rotary_backward_kernel<T><<<grid_for(pairs), elementwise_threads, 0, stream>>>(
      dinp, dout, cos_t, sin_t, pairs, static_cast<int>(seq_len),
      static_cast<int>(kv_heads * (group + 2)), static_cast<int>(group),
      static_cast<int>(head_size / 2), overwrite);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
