#pragma once
// zero-requires: cuda
// Device-wide reductions for gradient clipping and fp16 loss scaling: the sum of squares of a
// gradient shard in double (the device twin of optim::grad_stats in optim/grad_norm.hpp) and a
// count of non-finite elements. Two kernels: blocks read the input 16 bytes at a time and reduce
// their share with cub::BlockReduce into per-block partials, then one block adds the partials. The
// block count depends on n and on whether x is 16-byte aligned alone, so the order, and the
// result, repeat on any GPU (the same data at another alignment may sum in another order).
// As on the host, squares of floats are exact in double and cannot overflow, so the sum is finite
// exactly when every element is: grad_stats' finiteness flag comes from the sum itself. The
// summation order is not the host's 8-lane order, so the two agree to double rounding (relative
// ~1e-15), not bit for bit.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/reduce.cuh needs nvcc; host-only code includes optim/grad_norm.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- reduction functors -------------------------------------------------------------------------

/// x widened to double and squared (exact).
template <class T>
struct SquareAsDouble {
  __device__ __forceinline__ double operator()(T x) const {
    const double d = load(x);
    return d * d;
  }
};

/// 1 for Inf or NaN, else 0.
template <class T>
struct IsNonFinite {
  __device__ __forceinline__ unsigned long long operator()(T x) const {
    return isfinite(load(x)) ? 0ull : 1ull;
  }
};

// ---- kernels ------------------------------------------------------------------------------------

/// Threads per block and the most blocks of the two-step reductions. The block count depends on n
/// and x's alignment (never on the GPU), so the summation order, and the result, repeat on any
/// device.
inline constexpr int reduce_threads = 256;
inline constexpr int reduce_max_blocks = 1024;

/// partials[block] = the sum of fn(x[i]) over the elements of this block's grid-stride share
/// (Packed: every pointer 16-byte aligned, 16-byte loads with a scalar tail), in a fixed order:
/// each thread adds its elements in index order, then cub::BlockReduce adds the threads.
template <class Out, class T, bool Packed, class Fn>
__global__ void __launch_bounds__(reduce_threads)
    transform_sum_partials_kernel(Out* partials, const T* x, std::int64_t n, Fn fn) {
  Out acc = Out{0};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  std::int64_t done = 0;
  if constexpr (Packed) {
    constexpr int P = pack_size<T>;
    // Four packs in flight per thread: their loads are issued before any of them is added.
    constexpr int U = 4;
    const std::int64_t packs = n / P;
    const auto* in = reinterpret_cast<const Pack<T>*>(x);
    for (std::int64_t i = first; i < packs; i += U * stride) {
      Pack<T> p[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * stride < packs) p[u] = in[i + u * stride];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * stride < packs) {
#pragma unroll
          for (int k = 0; k < P; ++k) acc += fn(p[u].v[k]);
        }
      }
    }
    done = packs * P;
  }
  for (std::int64_t i = done + first; i < n; i += stride) acc += fn(x[i]);
  using Reduce = cub::BlockReduce<Out, reduce_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const Out block = Reduce(temp).Sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

/// *out = the sum of partials [count] (one block, a fixed order).
template <class Out>
__global__ void __launch_bounds__(reduce_threads)
    sum_partials_kernel(Out* out, const Out* partials, int count) {
  Out acc = Out{0};
  for (int i = static_cast<int>(threadIdx.x); i < count; i += reduce_threads) acc += partials[i];
  using Reduce = cub::BlockReduce<Out, reduce_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const Out total = Reduce(temp).Sum(acc);
  if (threadIdx.x == 0) *out = total;
}

// ---- launchers ----------------------------------------------------------------------------------

/// *out (device) = the sum of fn(x[i]) over n elements in Out, in two steps (per-block partials,
/// then one block over them); ordered on stream, no host sync, deterministic.
template <class Out, class T, class Fn>
void transform_sum(Out* out, const T* x, std::int64_t n, Fn fn, cudaStream_t stream) {
  const bool packed = aligned16({x});
  const std::int64_t units = packed ? n / pack_size<T> + 1 : n;
  const auto blocks = static_cast<int>(
      std::min<std::int64_t>(reduce_max_blocks, (units + reduce_threads - 1) / reduce_threads));
  if (blocks == 0) {
    ZERO_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(Out), stream));
    return;
  }
  DeviceScratch partials(static_cast<std::size_t>(blocks) * sizeof(Out), stream);
  if (packed) {
    transform_sum_partials_kernel<Out, T, true, Fn>
        <<<blocks, reduce_threads, 0, stream>>>(partials.as<Out>(), x, n, fn);
  } else {
    transform_sum_partials_kernel<Out, T, false, Fn>
        <<<blocks, reduce_threads, 0, stream>>>(partials.as<Out>(), x, n, fn);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
  sum_partials_kernel<Out><<<1, reduce_threads, 0, stream>>>(out, partials.as<Out>(), blocks);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// *out (device) = sum of g[i]^2 over n elements, in double; ordered on stream, no host sync.
template <class T>
void sum_squares(double* out, const T* g, std::int64_t n, cudaStream_t stream) {
  transform_sum<double>(out, g, n, SquareAsDouble<T>{}, stream);
}

/// *out (device) = number of Inf and NaN elements among n; ordered on stream, no host sync.
template <class T>
void count_nonfinite(unsigned long long* out, const T* x, std::int64_t n, cudaStream_t stream) {
  transform_sum<unsigned long long>(out, x, n, IsNonFinite<T>{}, stream);
}

/// Sum of squares and finiteness of a device gradient shard, as optim::GradStats reports them.
struct DeviceGradStats {
  double sum_sq = 0.0;  ///< sum of g^2 over the shard
  bool finite = true;   ///< false when any element is Inf or NaN
};

/// The shard's sum of squares and finiteness; synchronises stream to return them to the host.
template <class T>
DeviceGradStats grad_stats(const T* g, std::int64_t n, cudaStream_t stream) {
  DeviceScratch result(sizeof(double), stream);
  sum_squares(result.as<double>(), g, n, stream);
  double sum = 0.0;
  ZERO_CUDA_CHECK(
      cudaMemcpyAsync(&sum, result.as<double>(), sizeof sum, cudaMemcpyDeviceToHost, stream));
  ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {sum, std::isfinite(sum)};
}

}  // namespace zero::ops::cuda
