#pragma once
// zero-requires: cuda
// Grouped-query attention's repeat_kv on the GPU, the twin of zero/ops/cpu/grouped_qkv.hpp: rows
// of grouped qkv (kv_heads groups of `group` query heads, one key head, one value head, each
// head_size channels) to the packed [q | k | v] rows the attention kernels read, every key and
// value head repeated for each query head of its group; the backward copies the queries'
// gradient and sums each key's and value's over its group's heads in head order. One thread per
// output element (forward) or per input element (backward), each sum in the host's order in
// float: the host's bits.
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/grouped_qkv.cuh needs nvcc; host-only code includes zero/ops/cpu/grouped_qkv.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/error.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// out's element e of total = n * 3 * heads * hs from its grouped row (grid-stride).
template <class T>
__global__ void repeat_kv_forward_kernel(T* out, const T* inp, std::int64_t total, int kv_heads,
                                         int group, int hs) {
  const int heads = kv_heads * group;
  const std::int64_t out_width = 3LL * heads * hs;
  const std::int64_t in_width = static_cast<std::int64_t>(kv_heads) * (group + 2) * hs;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / out_width;
    const auto k = static_cast<int>(e % out_width);
    const int section = k / (heads * hs);  // 0 queries, 1 keys, 2 values
    const int h = k / hs % heads, c = k % hs;
    const int j = h / group;                                          // the head's group
    const int slot = section == 0 ? h % group : group + section - 1;  // its head in the group
    out[e] = inp[row * in_width + static_cast<std::int64_t>(j * (group + 2) + slot) * hs + c];
  }
}

/// dinp's element e of total = n * kv_heads * (group + 2) * hs (+=, or = when overwrite): a
/// query's gradient, or a key's or value's summed over its group's heads in head order.
template <class T>
__global__ void repeat_kv_backward_kernel(T* dinp, const T* dout, std::int64_t total, int kv_heads,
                                          int group, int hs, bool overwrite) {
  const int heads = kv_heads * group;
  const std::int64_t out_width = 3LL * heads * hs;
  const int in_width = kv_heads * (group + 2) * hs;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / in_width;
    const auto k = static_cast<int>(e % in_width);
    const int j = k / ((group + 2) * hs), slot = k / hs % (group + 2), c = k % hs;
    const T* dy = dout + row * out_width;
    float sum = overwrite ? 0.0f : load(dinp[e]);
    if (slot < group) {
      sum += load(dy[static_cast<std::int64_t>(j * group + slot) * hs + c]);
    } else {
      const int section = slot - group + 1;  // 1 keys, 2 values
      for (int i = 0; i < group; ++i) {
        sum += load(dy[static_cast<std::int64_t>(section * heads + j * group + i) * hs + c]);
      }
    }
    dinp[e] = store<T>(sum);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

namespace grouped_qkv_detail {

/// Checks the sizes fit the kernels' int fields; returns the grouped row's width.
inline std::int64_t checked_width(std::int64_t n, std::int64_t kv_heads, std::int64_t group,
                                  std::int64_t head_size, const char* op) {
  expect<ShapeError>(n >= 0 && kv_heads > 0 && group > 0 && head_size > 0, op, ": rows ", n,
                     ", kv_heads ", kv_heads, ", group ", group, ", head_size ", head_size,
                     "; expected positive sizes");
  expect_int_range(3 * kv_heads * group * head_size, op);
  expect_int_range(kv_heads * (group + 2) * head_size, op);
  return kv_heads * (group + 2) * head_size;
}

}  // namespace grouped_qkv_detail

/// out [n, 3 * kv_heads * group * head_size] = inp's n grouped rows as packed qkv, key and value
/// heads repeated over their groups (device pointers, distinct).
template <class T>
void repeat_kv_forward(T* out, const T* inp, std::int64_t n, std::int64_t kv_heads,
                       std::int64_t group, std::int64_t head_size, cudaStream_t stream) {
  grouped_qkv_detail::checked_width(n, kv_heads, group, head_size, "repeat_kv_forward");
  const std::int64_t total = n * 3 * kv_heads * group * head_size;
  if (total == 0) return;
  repeat_kv_forward_kernel<T><<<grid_for(total), elementwise_threads, 0, stream>>>(
      out, inp, total, static_cast<int>(kv_heads), static_cast<int>(group),
      static_cast<int>(head_size));
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp (+=, or = when overwrite) the gradient of repeat_kv_forward given dout (device pointers,
/// distinct).
template <class T>
void repeat_kv_backward(T* dinp, const T* dout, std::int64_t n, std::int64_t kv_heads,
                        std::int64_t group, std::int64_t head_size, bool overwrite,
                        cudaStream_t stream) {
  const std::int64_t total =
      n * grouped_qkv_detail::checked_width(n, kv_heads, group, head_size, "repeat_kv_backward");
  if (total == 0) return;
  repeat_kv_backward_kernel<T><<<grid_for(total), elementwise_threads, 0, stream>>>(
      dinp, dout, total, static_cast<int>(kv_heads), static_cast<int>(group),
      static_cast<int>(head_size), overwrite);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
