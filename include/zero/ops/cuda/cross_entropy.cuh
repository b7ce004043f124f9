#pragma once
// zero-requires: cuda
// Fused softmax cross-entropy over the vocabulary on the GPU; the twin of
// zero/ops/cpu/cross_entropy.hpp (mean over the tokens whose target is not cpu::ignore_index):
//   loss = mean_n [ logsumexp(logits_n) - logits_n[target_n] ]
//   dlogits_n = (softmax(logits_n) - onehot(target_n)) * dloss / valid     (0 for ignored rows)
// One block per row streams over the vocabulary in chunks of its threads: a pass for the maximum,
// a pass for the sum of exponentials (the host's two steps; no E[exp] rescaling), and in the
// backward a third pass that writes the gradient. No second logits-sized buffer exists: dlogits
// may be the logits buffer itself (each element is read and then overwritten by one thread after
// the row's reductions are complete).
// A target outside [0, V) that is not ignore_index cannot throw on the device: its loss is NaN
// (the host twin throws ShapeError).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/cross_entropy.cuh needs nvcc; host-only code includes zero/ops/cpu/cross_entropy.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

using cpu::ignore_index;

/// Threads per row of the cross-entropy kernels.
inline constexpr int cross_entropy_threads = 512;

// ---- kernels ------------------------------------------------------------------------------------

/// Calls fn(v, x[v] as float) for every v < V, this thread's share of the block's row: 16-byte
/// loads over the aligned middle of the row (a row of odd V starts at any 2-byte offset), single
/// elements over its unaligned head and its tail.
template <class T, class Fn>
__device__ __forceinline__ void for_each_in_row(const T* x, int V, Fn&& fn) {
  constexpr int P = pack_size<T>;
  const auto misaligned = static_cast<int>(reinterpret_cast<std::uintptr_t>(x) % 16);
  const int head = min(V, misaligned == 0 ? 0 : (16 - misaligned) / static_cast<int>(sizeof(T)));
  const int packs = (V - head) / P;
  const int tail = head + packs * P;
  for (int v = threadIdx.x; v < head; v += blockDim.x) fn(v, load(x[v]));
  const Pack<T>* body = reinterpret_cast<const Pack<T>*>(x + head);
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T> p = body[i];
#pragma unroll
    for (int k = 0; k < P; ++k) fn(head + i * P + k, load(p.v[k]));
  }
  for (int v = tail + threadIdx.x; v < V; v += blockDim.x) fn(v, load(x[v]));
}

/// The row's maximum and sum of exp(x - max), both on every thread of the block.
template <class T>
__device__ __forceinline__ void row_max_sum(const T* x, int V, float& maxval, float& sum) {
  float m = -INFINITY;
  for_each_in_row(x, V, [&](int, float value) { m = fmaxf(m, value); });
  maxval = block_all_reduce<cross_entropy_threads>(m, MaxOp{});
  float s = 0.0f;
  const float mx = maxval;
  for_each_in_row(x, V, [&](int, float value) { s += expf(value - mx); });
  sum = block_all_reduce<cross_entropy_threads>(s, SumOp{});
}

/// One block per row: losses[n] = logsumexp - logit of the target (0 when ignored).
template <class T>
__global__ void __launch_bounds__(cross_entropy_threads)
    cross_entropy_forward_kernel(float* losses, const T* logits, const std::int32_t* targets,
                                 int V) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  if (target == ignore_index) {  // uniform over the block: no thread reaches a barrier
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  const T* x = logits + n * V;
  float maxval, sum;
  row_max_sum(x, V, maxval, sum);
  if (threadIdx.x == 0) {
    losses[n] = target >= 0 && target < V ? logf(sum) + maxval - load(x[target])
                                          : __int_as_float(0x7fc00000);
  }
}

/// One block: the number of valid targets into *valid and, when losses is not null, their mean
/// loss into *mean. cub::BlockReduce's fixed tree makes both repeat run to run.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    cross_entropy_mean_kernel(float* mean, int* valid, const float* losses,
                              const std::int32_t* targets, int N) {
  using IntReduce = cub::BlockReduce<int, Threads>;
  __shared__ typename IntReduce::TempStorage temp;
  int count = 0;
  float total = 0.0f;
  for (int n = threadIdx.x; n < N; n += Threads) {
    count += targets[n] != ignore_index;
    if (losses != nullptr) total += losses[n];
  }
  const int all = IntReduce(temp).Sum(count);
  const float sum = block_all_reduce<Threads>(total, SumOp{});
  if (threadIdx.x == 0) {
    *valid = all;
    if (mean != nullptr) *mean = all > 0 ? sum / static_cast<float>(all) : 0.0f;
  }
}

/// One block per row: dlogits[n] = (softmax - onehot) * dloss / valid, or zeros when ignored;
/// valid is *valid_count when that is given, else fixed_valid.
template <class T>
__global__ void __launch_bounds__(cross_entropy_threads)
    cross_entropy_backward_kernel(T* dlogits, const T* logits, const std::int32_t* targets,
                                  const int* valid_count, int fixed_valid, int V, float dloss) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  T* d = dlogits + n * V;
  if (target == ignore_index) {
    for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = store<T>(0.0f);
    return;
  }
  const T* x = logits + n * V;
  float maxval, sum;
  row_max_sum(x, V, maxval, sum);
  const int count = valid_count != nullptr ? *valid_count : fixed_valid;
  const float scale = count > 0 ? dloss / static_cast<float>(count) : 0.0f;
  const float inv = 1.0f / sum;
  // Each element is read before it is written, by the same thread: d may be x (in place).
  for_each_in_row(x, V, [&](int v, float value) {
    float g = expf(value - maxval) * inv * scale;
    if (v == target) g -= scale;
    d[v] = store<T>(g);
  });
}

// ---- launchers ----------------------------------------------------------------------------------

/// Per-token losses [N] (0 for ignored tokens) and, when mean is not null, the mean over valid
/// tokens into *mean (0 if none). All pointers are device pointers; nothing synchronises.
template <class T>
void cross_entropy_forward(float* losses, float* mean, const T* logits, const std::int32_t* targets,
                           std::int64_t N, std::int64_t V, cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_forward");
  expect_int_range(V, "cross_entropy_forward");
  if (N == 0) {
    if (mean != nullptr) ZERO_CUDA_CHECK(cudaMemsetAsync(mean, 0, sizeof(float), stream));
    return;
  }
  cross_entropy_forward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      losses, logits, targets, static_cast<int>(V));
  ZERO_CUDA_CHECK(cudaGetLastError());
  if (mean != nullptr) {
    DeviceScratch valid(sizeof(int), stream);
    cross_entropy_mean_kernel<1024>
        <<<1, 1024, 0, stream>>>(mean, valid.as<int>(), losses, targets, static_cast<int>(N));
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
}

/// Writes (not accumulates) dlogits [N, V] for the mean loss scaled by dloss; dlogits may be
/// logits itself (in place).
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V, float dloss, cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_backward");
  expect_int_range(V, "cross_entropy_backward");
  if (N == 0) return;
  DeviceScratch valid(sizeof(int), stream);
  cross_entropy_mean_kernel<1024>
      <<<1, 1024, 0, stream>>>(nullptr, valid.as<int>(), nullptr, targets, static_cast<int>(N));
  ZERO_CUDA_CHECK(cudaGetLastError());
  cross_entropy_backward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      dlogits, logits, targets, valid.as<int>(), 0, static_cast<int>(V), dloss);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// cross_entropy_backward for N rows that are a chunk of a batch with valid counted targets
/// (count_valid_targets of the whole batch): the mean's denominator is valid, not the chunk's.
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V, float dloss, std::int64_t valid,
                            cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_backward");
  expect_int_range(V, "cross_entropy_backward");
  expect_int_range(valid, "cross_entropy_backward");
  if (N == 0) return;
  cross_entropy_backward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      dlogits, logits, targets, nullptr, static_cast<int>(valid), static_cast<int>(V), dloss);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

namespace detail {
/// The count of targets [N] that count and, given losses, their mean loss, on the host.
struct TargetStats {
  int valid = 0;
  float mean = 0.0f;
};
inline TargetStats target_stats(const float* losses, const std::int32_t* targets, std::int64_t N,
                                cudaStream_t stream, const char* op) {
  expect_int_range(N, op);
  if (N == 0) return {};
  DeviceScratch scratch(sizeof(TargetStats), stream);
  auto* stats = scratch.as<TargetStats>();
  cross_entropy_mean_kernel<1024>
      <<<1, 1024, 0, stream>>>(losses != nullptr ? &stats->mean : nullptr, &stats->valid, losses,
                               targets, static_cast<int>(N));
  ZERO_CUDA_CHECK(cudaGetLastError());
  TargetStats host;
  ZERO_CUDA_CHECK(
      cudaMemcpyAsync(&host, stats, sizeof(TargetStats), cudaMemcpyDeviceToHost, stream));
  ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}
}  // namespace detail

/// The number of targets [N] that count (not ignore_index), returned to the host: synchronises
/// the stream.
inline std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                        cudaStream_t stream) {
  return detail::target_stats(nullptr, targets, N, stream, "count_valid_targets").valid;
}

/// The mean of per-token losses [N] (cross_entropy_forward's, of every chunk) over the valid
/// targets (0 if none), returned to the host: synchronises the stream.
inline float cross_entropy_mean(const float* losses, const std::int32_t* targets, std::int64_t N,
                                cudaStream_t stream) {
  return detail::target_stats(losses, targets, N, stream, "cross_entropy_mean").mean;
}

}  // namespace zero::ops::cuda
