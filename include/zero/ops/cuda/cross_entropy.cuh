#pragma once
// zero-requires: cuda
// Fused softmax cross-entropy over the vocabulary on the GPU; the twin of
// zero/ops/cpu/cross_entropy.hpp (mean over the tokens whose target is not cpu::ignore_index):
//   loss = mean_n [ logsumexp(logits_n) - logits_n[target_n] ]
//   dlogits_n = (softmax(logits_n) - onehot(target_n)) * dloss / valid     (0 for ignored rows)
// One block per row streams over the vocabulary once, 16 bytes per thread at a time, keeping an
// online softmax's running maximum and sum of exponentials per thread (rescaled when a pack brings
// a new maximum), then merges the threads' pairs (the host makes two passes: maximum, then sum;
// the results agree to float rounding). A loss layer that takes its gradients in its forward
// runs both in one kernel (cross_entropy_forward_backward: each row read once into registers and
// written once, llm.c's fused classifier). The forward can keep each row's maximum and sum
// (row_stats, as the host twin does); a backward given them makes one pass that reads the logits
// and writes the gradient, and without them it first makes the forward's pass again. No second
// logits-sized buffer exists: dlogits may be the logits buffer itself (each element is read and
// then overwritten by one thread after the row's reductions are complete). Rows may lie ld >= V
// elements apart, as the host twin's: a buffer whose rows a GEMM wrote padded to whole 16-byte
// packs (linear.cuh's padded_row) is read in place, every row aligned, and the backward writes
// zeros into each row's padding. A target outside [0, V) that is not ignore_index cannot throw in
// a kernel: its row's loss is NaN there; count_valid_targets, which returns to the host, throws
// the host twin's ShapeError for it, so a loss layer refuses the batch before any kernel runs.
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/cross_entropy.cuh needs nvcc; host-only code includes zero/ops/cpu/cross_entropy.hpp"
#endif

#include <cstdint>
#include <type_traits>

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

/// A row of V elements at x split for 16-byte accesses: [0, head) up to the first 16-byte
/// boundary, packs whole packs from there, [tail, V) the rest.
template <class T>
struct RowPacks {
  int head, packs, tail;
  __device__ __forceinline__ RowPacks(const T* x, int V) {
    const auto misaligned = static_cast<int>(reinterpret_cast<std::uintptr_t>(x) % 16);
    head = min(V, misaligned == 0 ? 0 : (16 - misaligned) / static_cast<int>(sizeof(T)));
    packs = (V - head) / pack_size<T>;
    tail = head + packs * pack_size<T>;
  }
};

/// d[v] = fn(v, x[v] as float) rounded to T for every v < V, this thread's share of the block's
/// row: 16 bytes at a time over the aligned middle when d and x sit at the same offset from a
/// 16-byte boundary (d may be x), one element at a time otherwise. Each element is read before
/// the same thread writes it.
template <class T, class Fn>
__device__ __forceinline__ void transform_row(T* d, const T* x, int V, Fn&& fn) {
  const RowPacks<T> row(x, V);
  if (reinterpret_cast<std::uintptr_t>(d) % 16 != reinterpret_cast<std::uintptr_t>(x) % 16) {
    for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = store<T>(fn(v, load(x[v])));
    return;
  }
  for (int v = threadIdx.x; v < row.head; v += blockDim.x) d[v] = store<T>(fn(v, load(x[v])));
  const Pack<T>* in = reinterpret_cast<const Pack<T>*>(x + row.head);
  Pack<T>* out = reinterpret_cast<Pack<T>*>(d + row.head);
  for (int i = threadIdx.x; i < row.packs; i += blockDim.x) {
    const Pack<T> p = in[i];
    Pack<T> q;
#pragma unroll
    for (int k = 0; k < pack_size<T>; ++k) {
      q.v[k] = store<T>(fn(row.head + i * pack_size<T> + k, load(p.v[k])));
    }
    out[i] = q;
  }
  for (int v = row.tail + threadIdx.x; v < V; v += blockDim.x) d[v] = store<T>(fn(v, load(x[v])));
}

/// Folds value into a running maximum m and sum s of exp(x - m) (online softmax): a new maximum
/// rescales the sum. Elements at -inf add nothing, also while every element so far was -inf; a
/// NaN makes the sum NaN, also then (a NaN logit makes the row's loss NaN, as on the host).
__device__ __forceinline__ void online_softmax_add(float& m, float& s, float value) {
  if (value > m) {
    s = s * expf(m - value) + 1.0f;
    m = value;
  } else if (m != -INFINITY) {
    s += expf(value - m);
  } else if (value != value) {
    s = value;
  }
}

/// exp(value - max) over a row of T's logits, given max_log2 = max log2e: float logits take expf
/// (their losses and gradients are held to 1e-5 of the host's); bf16 and f16 ones exp2_approx of
/// one multiply-add (about 1e-6 relative, far below their ulp), a few instructions where expf
/// takes about ten: the kernels stream the vocabulary at the copy's rate only if the arithmetic
/// keeps up.
template <class T>
__device__ __forceinline__ float softmax_exp(float value, float max, float max_log2) {
  if constexpr (std::is_same_v<T, float>) {
    return expf(value - max);
  } else {
    return exp2_approx(fmaf(value, log2e, -max_log2));
  }
}

/// The row's maximum and sum of exp(x - max), both on every thread of the block, in one pass over
/// the row: each thread keeps its own running maximum and sum (rescaled once per 16-byte pack
/// with a new maximum), and the block merges them, rescaling each thread's sum to the row's
/// maximum. The thread split is fixed, so the result repeats bit for bit.
template <class T>
__device__ __forceinline__ void row_max_sum(const T* x, int V, float& maxval, float& sum) {
  const RowPacks<T> row(x, V);
  float m = -INFINITY, s = 0.0f;
  for (int v = threadIdx.x; v < row.head; v += blockDim.x) online_softmax_add(m, s, load(x[v]));
  float m_log2 = m * log2e;
  const Pack<T>* body = reinterpret_cast<const Pack<T>*>(x + row.head);
  for (int i = threadIdx.x; i < row.packs; i += blockDim.x) {
    const Pack<T> p = body[i];
    float values[pack_size<T>];
    float pack_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < pack_size<T>; ++k) {
      values[k] = load(p.v[k]);
      pack_max = fmaxf(pack_max, values[k]);
    }
    if (pack_max > m) {
      s *= expf(m - pack_max);
      m = pack_max;
      m_log2 = m * log2e;
    }
    if (m != -INFINITY) {
#pragma unroll
      for (int k = 0; k < pack_size<T>; ++k) s += softmax_exp<T>(values[k], m, m_log2);
    } else {
      // Nothing above -inf yet: fmaxf passed over any NaN in the pack, which must still reach
      // the sum (the packs after it rescale a NaN sum to NaN).
#pragma unroll
      for (int k = 0; k < pack_size<T>; ++k) {
        if (values[k] != values[k]) s = values[k];
      }
    }
  }
  for (int v = row.tail + threadIdx.x; v < V; v += blockDim.x) online_softmax_add(m, s, load(x[v]));
  maxval = block_all_reduce<cross_entropy_threads>(m, MaxOp{});
  const float rescaled = s == 0.0f ? 0.0f : s * expf(m - maxval);
  sum = block_all_reduce<cross_entropy_threads>(rescaled, SumOp{});
}

/// One block per row: losses[n] = logsumexp - logit of the target (0 when ignored); row_stats
/// (when not null) [n] = {max, sum of exp(x - max)} of the rows that count.
template <class T>
__global__ void __launch_bounds__(cross_entropy_threads)
    cross_entropy_forward_kernel(float* losses, float* row_stats, const T* logits,
                                 const std::int32_t* targets, int V, std::int64_t ld) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  if (target == ignore_index) {  // uniform over the block: no thread reaches a barrier
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  const T* x = logits + n * ld;
  float maxval, sum;
  row_max_sum(x, V, maxval, sum);
  if (threadIdx.x == 0) {
    losses[n] = target >= 0 && target < V ? logf(sum) + maxval - load(x[target])
                                          : __int_as_float(0x7fc00000);
    if (row_stats != nullptr) {
      row_stats[2 * n] = maxval;
      row_stats[2 * n + 1] = sum;
    }
  }
}

/// Minimum of two ints for cub::BlockReduce.
struct IntMinOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a < b ? a : b; }
};

/// The first target a vocabulary of V refuses (neither ignore_index nor in [0, V)): its position
/// (N when there is none) and its value.
struct OutsideTarget {
  int position;
  std::int32_t target;
};

/// One block: the number of valid targets into *valid and, when losses is not null, their mean
/// loss into *mean and the losses' sum into *sum (when not null); when outside is not null, the
/// first target outside [0, V) into *outside.
/// cub::BlockReduce's fixed tree makes every result repeat run to run.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    cross_entropy_mean_kernel(float* mean, float* sum_out, int* valid, OutsideTarget* outside,
                              const float* losses, const std::int32_t* targets, int N, int V) {
  using IntReduce = cub::BlockReduce<int, Threads>;
  __shared__ typename IntReduce::TempStorage temp;
  int count = 0;
  int first = N;  // this thread's first position outside the vocabulary
  float total = 0.0f;
  for (int n = threadIdx.x; n < N; n += Threads) {
    const std::int32_t target = targets[n];
    count += target != ignore_index;
    if (target != ignore_index && (target < 0 || target >= V) && first == N) first = n;
    if (losses != nullptr) total += losses[n];
  }
  const int all = IntReduce(temp).Sum(count);
  __syncthreads();  // temp again
  const int first_outside = outside != nullptr ? IntReduce(temp).Reduce(first, IntMinOp{}) : N;
  const float sum = block_all_reduce<Threads>(total, SumOp{});
  if (threadIdx.x == 0) {
    *valid = all;
    if (mean != nullptr) *mean = all > 0 ? sum / static_cast<float>(all) : 0.0f;
    if (sum_out != nullptr) *sum_out = sum;
    if (outside != nullptr) {
      *outside = {first_outside, first_outside < N ? targets[first_outside] : 0};
    }
  }
}

/// One block per row: dlogits[n] = (softmax - onehot) * dloss / valid, or zeros when ignored,
/// and zeros in the row's padding [V, ld); valid is *valid_count when that is given, else
/// fixed_valid; the row's max and sum come from row_stats when it is given (the forward's), else
/// from a pass over the row first.
template <class T>
__global__ void __launch_bounds__(cross_entropy_threads)
    cross_entropy_backward_kernel(T* dlogits, const T* logits, const std::int32_t* targets,
                                  const float* row_stats, const int* valid_count, int fixed_valid,
                                  int V, std::int64_t ld, float dloss) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  T* d = dlogits + n * ld;
  for (int v = V + static_cast<int>(threadIdx.x); v < ld; v += blockDim.x) d[v] = store<T>(0.0f);
  if (target == ignore_index) {
    for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = store<T>(0.0f);
    return;
  }
  const T* x = logits + n * ld;
  float maxval, sum;
  if (row_stats != nullptr) {
    maxval = row_stats[2 * n];
    sum = row_stats[2 * n + 1];
  } else {
    row_max_sum(x, V, maxval, sum);
  }
  const int count = valid_count != nullptr ? *valid_count : fixed_valid;
  const float scale = count > 0 ? dloss / static_cast<float>(count) : 0.0f;
  const float inv = 1.0f / sum;
  const float max_log2 = maxval * log2e;
  transform_row(d, x, V, [&](int v, float value) {
    float g = softmax_exp<T>(value, maxval, max_log2) * inv * scale;
    if (v == target) g -= scale;
    return g;
  });
}

/// Threads per row of the fused forward and backward, which holds the row in registers.
inline constexpr int cross_entropy_fused_threads = 1024;

/// One block per row, the row's packs [0, ld / P) in registers (Packs per thread, pack i of
/// thread t at k = i / blockDim.x): the forward and the backward of cross_entropy_forward_kernel
/// and cross_entropy_backward_kernel reading the logits once. The maximum first, then the sum
/// of exp(x - max) over the registers (the host's two passes, without reading the row twice);
/// losses[n] and row_stats (when not null) as the forward's; dlogits[n] (may be logits, each
/// pack written by the thread that read it, after the row's reductions) as the backward's with
/// scale = dloss / valid, zeros in [V, ld) and for ignored rows.
template <class T, int Packs>
__global__ void __launch_bounds__(cross_entropy_fused_threads)
    cross_entropy_fused_kernel(float* losses, float* row_stats, T* dlogits, const T* logits,
                               const std::int32_t* targets, int V, std::int64_t ld, float scale) {
  constexpr int P = pack_size<T>;
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  const int packs = static_cast<int>(ld / P);
  const auto* x = reinterpret_cast<const Pack<T>*>(logits + n * ld);
  auto* d = reinterpret_cast<Pack<T>*>(dlogits + n * ld);
  if (target == ignore_index) {  // uniform over the block: no thread reaches a barrier
    Pack<T> zeros;
#pragma unroll
    for (int j = 0; j < P; ++j) zeros.v[j] = store<T>(0.0f);
    for (int i = threadIdx.x; i < packs; i += blockDim.x) d[i] = zeros;
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  const bool counted = target >= 0 && target < V;
  // Read before the barriers below, so before any thread overwrites the row.
  const float target_logit = threadIdx.x == 0 && counted ? load(logits[n * ld + target]) : 0.0f;
  const int lane = static_cast<int>(threadIdx.x), lanes = static_cast<int>(blockDim.x);
  Pack<T> row[Packs];
  float m = -INFINITY;
  for_lane_packs<Packs>(
      lane, packs,
      [&](int k, int i) {
        row[k] = x[i];
#pragma unroll
        for (int j = 0; j < P; ++j) {
          if (i * P + j < V) m = fmaxf(m, load(row[k].v[j]));
        }
      },
      lanes);
  const float maxval = block_all_reduce<cross_entropy_fused_threads>(m, MaxOp{});
  const float max_log2 = maxval * log2e;
  float s = 0.0f;
  if (maxval != -INFINITY) {
    for_lane_packs<Packs>(
        lane, packs,
        [&](int k, int i) {
#pragma unroll
          for (int j = 0; j < P; ++j) {
            if (i * P + j < V) s += softmax_exp<T>(load(row[k].v[j]), maxval, max_log2);
          }
        },
        lanes);
  }
  const float sum = block_all_reduce<cross_entropy_fused_threads>(s, SumOp{});
  if (threadIdx.x == 0) {
    losses[n] = counted ? logf(sum) + maxval - target_logit : __int_as_float(0x7fc00000);
    if (row_stats != nullptr) {
      row_stats[2 * n] = maxval;
      row_stats[2 * n + 1] = sum;
    }
  }
  const float inv = 1.0f / sum;
  for_lane_packs<Packs>(
      lane, packs,
      [&](int k, int i) {
        Pack<T> q;
#pragma unroll
        for (int j = 0; j < P; ++j) {
          const int v = i * P + j;
          float g =
              v < V ? softmax_exp<T>(load(row[k].v[j]), maxval, max_log2) * inv * scale : 0.0f;
          if (v < V && v == target) g -= scale;  // a target in the padding leaves it 0
          q.v[j] = store<T>(g);
        }
        d[i] = q;
      },
      lanes);
}

// ---- launchers ----------------------------------------------------------------------------------

/// Per-token losses [N] (0 for ignored tokens), when mean is not null the mean over valid tokens
/// into *mean (0 if none), and when row_stats is not null each counted row's {max, sum of
/// exponentials} into row_stats [N, 2] for cross_entropy_backward. Row n of the logits starts
/// at logits + n * ld (ld >= V). All pointers are device pointers; nothing synchronises.
template <class T>
void cross_entropy_forward(float* losses, float* mean, float* row_stats, const T* logits,
                           const std::int32_t* targets, std::int64_t N, std::int64_t V,
                           std::int64_t ld, cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_forward");
  expect_int_range(V, "cross_entropy_forward");
  expect_int_range(ld, "cross_entropy_forward");
  ld = cpu::detail::logits_row_stride(V, ld, "cross_entropy_forward");
  if (N == 0) {
    if (mean != nullptr) ZERO_CUDA_CHECK(cudaMemsetAsync(mean, 0, sizeof(float), stream));
    return;
  }
  cross_entropy_forward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      losses, row_stats, logits, targets, static_cast<int>(V), ld);
  ZERO_CUDA_CHECK(cudaGetLastError());
  if (mean != nullptr) {
    DeviceScratch valid(sizeof(int), stream);
    cross_entropy_mean_kernel<1024><<<1, 1024, 0, stream>>>(mean, nullptr, valid.as<int>(), nullptr,
                                                            losses, targets, static_cast<int>(N),
                                                            static_cast<int>(V));
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
}

/// cross_entropy_forward of rows of V logits, V apart.
template <class T>
void cross_entropy_forward(float* losses, float* mean, float* row_stats, const T* logits,
                           const std::int32_t* targets, std::int64_t N, std::int64_t V,
                           cudaStream_t stream) {
  cross_entropy_forward<T>(losses, mean, row_stats, logits, targets, N, V, V, stream);
}

/// cross_entropy_forward without row statistics.
template <class T>
void cross_entropy_forward(float* losses, float* mean, const T* logits, const std::int32_t* targets,
                           std::int64_t N, std::int64_t V, cudaStream_t stream) {
  cross_entropy_forward<T>(losses, mean, nullptr, logits, targets, N, V, V, stream);
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
  cross_entropy_mean_kernel<1024><<<1, 1024, 0, stream>>>(nullptr, nullptr, valid.as<int>(),
                                                          nullptr, nullptr, targets,
                                                          static_cast<int>(N), static_cast<int>(V));
  ZERO_CUDA_CHECK(cudaGetLastError());
  cross_entropy_backward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      dlogits, logits, targets, nullptr, valid.as<int>(), 0, static_cast<int>(V),
      static_cast<std::int64_t>(V), dloss);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// cross_entropy_backward for N rows that are a chunk of a batch with valid counted targets
/// (count_valid_targets of the whole batch): the mean's denominator is valid, not the chunk's.
/// row_stats (may be null) is what cross_entropy_forward kept for these rows, on these logits.
/// Rows lie ld >= V apart in both buffers; the columns [V, ld) of dlogits become zeros.
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V, float dloss, std::int64_t valid,
                            const float* row_stats, std::int64_t ld, cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_backward");
  expect_int_range(V, "cross_entropy_backward");
  expect_int_range(ld, "cross_entropy_backward");
  expect_int_range(valid, "cross_entropy_backward");
  ld = cpu::detail::logits_row_stride(V, ld, "cross_entropy_backward");
  if (N == 0) return;
  cross_entropy_backward_kernel<T><<<static_cast<unsigned>(N), cross_entropy_threads, 0, stream>>>(
      dlogits, logits, targets, row_stats, nullptr, static_cast<int>(valid), static_cast<int>(V),
      ld, dloss);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// The chunk backward over rows of V logits, V apart.
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V, float dloss, std::int64_t valid,
                            const float* row_stats, cudaStream_t stream) {
  cross_entropy_backward<T>(dlogits, logits, targets, N, V, dloss, valid, row_stats, V, stream);
}

/// The chunk backward without the forward's row statistics (one more pass per row).
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V, float dloss, std::int64_t valid,
                            cudaStream_t stream) {
  cross_entropy_backward<T>(dlogits, logits, targets, N, V, dloss, valid, nullptr, V, stream);
}

/// Packs per thread the fused kernel needs for rows of ld elements (1, 2, 4 or 8), or 0 when it
/// cannot take them: ld not a whole number of packs, a pointer not 16-byte aligned, or a row of
/// more than 8 packs per thread (over 65536 bf16 or 32768 float logits).
template <class T>
int cross_entropy_fused_packs(std::int64_t ld, const void* logits, const void* dlogits) {
  if (ld % pack_size<T> != 0 || !aligned16({logits, dlogits})) return 0;
  return lane_packs_for(ld / pack_size<T>, cross_entropy_fused_threads);
}

/// cross_entropy_forward (losses, row_stats when not null) and then cross_entropy_backward of the
/// same rows (dlogits for the mean over valid targets scaled by dloss; dlogits is logits or does
/// not overlap it): a loss layer that takes its gradients in its forward. Rows of whole 16-byte
/// packs, 16-byte aligned, up to 8 packs a thread of 1024 (GPT-2's 50257 logits in rows of
/// 50264) go through one kernel that reads each row once and writes it once; others run the two
/// kernels. The sums run in another order than the two kernels' (a split of the row over 1024
/// threads, maximum first), so the two forms agree to float rounding, not bit for bit.
template <class T>
void cross_entropy_forward_backward(float* losses, float* row_stats, T* dlogits, const T* logits,
                                    const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                    std::int64_t ld, float dloss, std::int64_t valid,
                                    cudaStream_t stream) {
  expect_int_range(N, "cross_entropy_forward_backward");
  expect_int_range(V, "cross_entropy_forward_backward");
  expect_int_range(ld, "cross_entropy_forward_backward");
  expect_int_range(valid, "cross_entropy_forward_backward");
  ld = cpu::detail::logits_row_stride(V, ld, "cross_entropy_forward_backward");
  if (N == 0) return;
  const int packs = V > 0 ? cross_entropy_fused_packs<T>(ld, logits, dlogits) : 0;
  if (packs == 0) {
    cross_entropy_forward<T>(losses, nullptr, row_stats, logits, targets, N, V, ld, stream);
    cross_entropy_backward<T>(dlogits, logits, targets, N, V, dloss, valid, row_stats, ld, stream);
    return;
  }
  const float scale = valid > 0 ? dloss / static_cast<float>(valid) : 0.0f;
  with_lane_packs(packs, [&](auto per_thread) {
    cross_entropy_fused_kernel<T, decltype(per_thread)::value>
        <<<static_cast<unsigned>(N), cross_entropy_fused_threads, 0, stream>>>(
            losses, row_stats, dlogits, logits, targets, static_cast<int>(V), ld, scale);
  });
  ZERO_CUDA_CHECK(cudaGetLastError());
}

namespace detail {
/// The count of targets [N] that count, given losses their mean loss over them and their sum,
/// and given V >= 0 the first target outside [0, V), on the host.
struct TargetStats {
  int valid = 0;
  float mean = 0.0f;
  float sum = 0.0f;
  OutsideTarget outside{};
};
inline TargetStats target_stats(const float* losses, const std::int32_t* targets, std::int64_t N,
                                std::int64_t V, cudaStream_t stream, const char* op) {
  expect_int_range(N, op);
  if (V >= 0) expect_int_range(V, op);
  if (N == 0) return {};
  DeviceScratch scratch(sizeof(TargetStats), stream);
  auto* stats = scratch.as<TargetStats>();
  cross_entropy_mean_kernel<1024><<<1, 1024, 0, stream>>>(
      losses != nullptr ? &stats->mean : nullptr, losses != nullptr ? &stats->sum : nullptr,
      &stats->valid, V >= 0 ? &stats->outside : nullptr, losses, targets, static_cast<int>(N),
      static_cast<int>(V));
  ZERO_CUDA_CHECK(cudaGetLastError());
  TargetStats host;
  ZERO_CUDA_CHECK(
      cudaMemcpyAsync(&host, stats, sizeof(TargetStats), cudaMemcpyDeviceToHost, stream));
  ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}
}  // namespace detail

/// The number of targets [N] that count (not ignore_index), returned to the host: synchronises
/// the stream. Throws the host twin's ShapeError, naming the first one, for a target outside
/// [0, V) that is not ignore_index.
inline std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                        cudaStream_t stream) {
  const auto stats = detail::target_stats(nullptr, targets, N, V, stream, "count_valid_targets");
  if (stats.outside.position < N) {
    cpu::throw_target_outside_vocabulary(stats.outside.target, stats.outside.position, V);
  }
  return stats.valid;
}

/// The mean of per-token losses [N] (cross_entropy_forward's, of every chunk) over the valid
/// targets (0 if none), returned to the host: synchronises the stream.
inline float cross_entropy_mean(const float* losses, const std::int32_t* targets, std::int64_t N,
                                cudaStream_t stream) {
  return detail::target_stats(losses, targets, N, -1, stream, "cross_entropy_mean").mean;
}

/// The sum of per-token losses [N] (ignored tokens' are zeros) over valid, the count of tokens
/// the mean is over (0 if none): the host twin's cross_entropy_mean(losses, N, valid), where
/// valid may be the whole batch's when these N rows are one chunk of it. Synchronises the stream.
inline float cross_entropy_mean(const float* losses, const std::int32_t* targets, std::int64_t N,
                                std::int64_t valid, cudaStream_t stream) {
  const float sum = detail::target_stats(losses, targets, N, -1, stream, "cross_entropy_mean").sum;
  return valid > 0 ? sum / static_cast<float>(valid) : 0.0f;
}

}  // namespace zero::ops::cuda
