#pragma once
// zero-requires: cuda
// Deterministic column sums over many rows, for the parameter gradients of LayerNorm (dweight,
// dbias) and of a linear layer's bias: out_k[c] += sum over rows n of term_k(n, c). Two passes in
// a fixed order, so results repeat bit for bit: blocks of (32 columns x a chunk of rows) add their
// rows (8 interleaved slices, then the slices in order) into float partials [K][chunks][C], and a
// second kernel adds each column's partials (32 interleaved slices of the chunks, then the slices
// in order) and rounds once into out_k. Splitting
// the rows over chunks keeps every SM busy: one block per 32 columns alone leaves 24 blocks for
// GPT-2 small's 768 channels, each walking all 8192 rows.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/column_sum.cuh needs nvcc"
#endif

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

namespace column_sum_detail {

inline constexpr int columns = 32;  ///< columns per block (one warp wide)
inline constexpr int slices = 8;    ///< row slices per block
inline constexpr int min_chunk_rows = 64;
inline constexpr int max_chunks = 1024;

/// The K outputs of a column sum.
template <class T, int K>
struct Outputs {
  T* out[K];
};

/// Block (columns, slices) at (blockIdx.x: 32 columns, blockIdx.y: a chunk of chunk_rows rows).
template <int K, class Term>
__global__ void __launch_bounds__(columns* slices)
    partials_kernel(float* partials, Term term, int N, int C, int chunk_rows, int chunks) {
  __shared__ float part[K][slices][columns];
  const int c = blockIdx.x * columns + threadIdx.x;
  // Rows in 64 bits: N may come within a chunk (or a slice step) of 2^31.
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * chunk_rows;
  const std::int64_t last = min(static_cast<std::int64_t>(N), first + chunk_rows);
  float acc[K] = {};
  if (c < C) {
    for (std::int64_t n = first + threadIdx.y; n < last; n += slices) {
      float v[K];
      term(static_cast<int>(n), c, v);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) part[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float sum = 0.0f;
      for (int y = 0; y < slices; ++y) sum += part[k][y][threadIdx.x];
      partials[(static_cast<std::int64_t>(k) * chunks + blockIdx.y) * C + c] = sum;
    }
  }
}

/// Chunk slices per block of the finishing kernel.
inline constexpr int finish_slices = 32;

/// Block (columns, finish_slices) at blockIdx.x: out_k[c] += the chunks' partials of column c,
/// rounded once. Slice y adds chunks y, y + 32, ... in order; then the slices are added in order.
/// Each column's many partials are read by 32 threads at once rather than by one in sequence.
template <class T, int K>
__global__ void __launch_bounds__(columns* finish_slices)
    finish_kernel(Outputs<T, K> outs, const float* partials, int chunks, int C) {
  __shared__ float part[finish_slices][columns];
  const int c = blockIdx.x * columns + threadIdx.x;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float sum = 0.0f;
    if (c < C) {
      for (int chunk = threadIdx.y; chunk < chunks; chunk += finish_slices) {
        sum += partials[(static_cast<std::int64_t>(k) * chunks + chunk) * C + c];
      }
    }
    part[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float total = 0.0f;
      for (int y = 0; y < finish_slices; ++y) total += part[y][threadIdx.x];
      outs.out[k][c] = store<T>(load(outs.out[k][c]) + total);
    }
    __syncthreads();
  }
}

/// Launches finish_kernel for C columns of chunks partials each.
template <class T, int K>
void finish_column_sums(const Outputs<T, K>& outs, const float* partials, std::int64_t chunks,
                        std::int64_t C, cudaStream_t stream) {
  finish_kernel<T, K>
      <<<static_cast<unsigned>((C + columns - 1) / columns), dim3(columns, finish_slices), 0,
         stream>>>(outs, partials, static_cast<int>(chunks), static_cast<int>(C));
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace column_sum_detail

/// out_k[c] += sum over n < N of term(n, c)[k] for c < C, K outputs of T (device pointers);
/// term is a device functor void(int n, int c, float (&v)[K]). Uses K * chunks * C floats of
/// stream-ordered scratch.
template <class T, int K, class Term>
void column_sums(const column_sum_detail::Outputs<T, K>& outs, const Term& term, std::int64_t N,
                 std::int64_t C, const char* op, cudaStream_t stream) {
  using namespace column_sum_detail;
  expect_int_range(N, op);
  expect_int_range(C, op);
  if (N == 0 || C == 0) return;
  const std::int64_t chunk_rows =
      std::max<std::int64_t>(min_chunk_rows, (N + max_chunks - 1) / max_chunks);
  const std::int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
  DeviceScratch partials(static_cast<std::size_t>(K * chunks * C) * sizeof(float), stream);
  const dim3 grid(static_cast<unsigned>((C + columns - 1) / columns),
                  static_cast<unsigned>(chunks));
  partials_kernel<K, Term><<<grid, dim3(columns, slices), 0, stream>>>(
      partials.as<float>(), term, static_cast<int>(N), static_cast<int>(C),
      static_cast<int>(chunk_rows), static_cast<int>(chunks));
  ZERO_CUDA_CHECK(cudaGetLastError());
  finish_column_sums(outs, partials.as<float>(), chunks, C, stream);
}

}  // namespace zero::ops::cuda
