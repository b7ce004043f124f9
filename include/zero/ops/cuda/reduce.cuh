#pragma once
// zero-requires: cuda
// Device-wide reductions for gradient clipping and fp16 loss scaling, over CUB
// (cub::DeviceReduce::TransformReduce): the sum of squares of a gradient shard in double (the
// device twin of optim::grad_stats in optim/grad_norm.hpp) and a count of non-finite elements.
// As on the host, squares of floats are exact in double and cannot overflow, so the sum is finite
// exactly when every element is: grad_stats' finiteness flag comes from the sum itself. The
// summation order is CUB's (fixed for a given size and GPU), not the host's 8-lane order, so the
// two agree to double rounding (relative ~1e-15), not bit for bit.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/reduce.cuh needs nvcc; host-only code includes optim/grad_norm.hpp"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>
#include <cub/device/device_reduce.cuh>

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

/// a + b for CUB (CCCL 3 dropped cub::Sum).
struct PlusOp {
  template <class U>
  __device__ __forceinline__ U operator()(U a, U b) const {
    return a + b;
  }
};

// ---- launchers ----------------------------------------------------------------------------------

/// *out (device) = sum of g[i]^2 over n elements, in double; ordered on stream, no host sync.
template <class T>
void sum_squares(double* out, const T* g, std::int64_t n, cudaStream_t stream) {
  std::size_t bytes = 0;
  ZERO_CUDA_CHECK(cub::DeviceReduce::TransformReduce(nullptr, bytes, g, out, n, PlusOp{},
                                                     SquareAsDouble<T>{}, 0.0, stream));
  DeviceScratch temp(bytes, stream);
  ZERO_CUDA_CHECK(cub::DeviceReduce::TransformReduce(temp.as<void>(), bytes, g, out, n, PlusOp{},
                                                     SquareAsDouble<T>{}, 0.0, stream));
}

/// *out (device) = number of Inf and NaN elements among n; ordered on stream, no host sync.
template <class T>
void count_nonfinite(unsigned long long* out, const T* x, std::int64_t n, cudaStream_t stream) {
  std::size_t bytes = 0;
  ZERO_CUDA_CHECK(cub::DeviceReduce::TransformReduce(nullptr, bytes, x, out, n, PlusOp{},
                                                     IsNonFinite<T>{}, 0ull, stream));
  DeviceScratch temp(bytes, stream);
  ZERO_CUDA_CHECK(cub::DeviceReduce::TransformReduce(temp.as<void>(), bytes, x, out, n, PlusOp{},
                                                     IsNonFinite<T>{}, 0ull, stream));
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
