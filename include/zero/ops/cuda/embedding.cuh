#pragma once
// zero-requires: cuda
// Token plus learned position embedding on the GPU; the twin of zero/ops/cpu/embedding.hpp:
//   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
// Backward without float atomics, in the host's order: positions are sorted by token with
// cub::DeviceRadixSort (stable, so each token's positions stay in increasing order), and one block
// per distinct token adds its positions' rows in that order, starting from the loaded gradient and
// rounding once. Every gradient element therefore sees the same float additions in the same order
// as on the host: the result is the host's bit for bit, and repeats run to run.
// A token outside [0, V) cannot throw on the device: forward writes NaN rows for it (the host
// twin throws ShapeError), and backward adds its positions nowhere (it takes V for that, which
// the host twin, never reached with such a token, does not).
#if !defined(__CUDACC__)
#error "zero/ops/cuda/embedding.cuh needs nvcc; host-only code includes zero/ops/cpu/embedding.hpp"
#endif

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// out[i, c] = wte[tokens[i], c] + wpe[i % T, c] (the row alone without wpe); NaN for a token
/// outside [0, V).
template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* tokens, const T* wte,
                                         const T* wpe, std::int64_t total, int Tn, int C, int V) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / C;
    const int c = static_cast<int>(e % C);
    const std::int32_t token = tokens[i];
    float value = __int_as_float(0x7fc00000);
    if (token >= 0 && token < V) {
      value = load(wte[static_cast<std::int64_t>(token) * C + c]);
      if (wpe != nullptr) value += load(wpe[(i % Tn) * C + c]);
    }
    out[e] = store<T>(value);
  }
}

/// Rows per block of the warp-per-row forward.
inline constexpr int embedding_warps = 8;

/// The forward with one warp per row and 16-byte packs (C a whole number of packs, every pointer
/// 16-byte aligned): the token is read once per row, and each lane adds whole packs.
template <class T>
__global__ void __launch_bounds__(32 * embedding_warps)
    embedding_forward_rows_kernel(T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                                  std::int64_t N, int Tn, int C, int V) {
  constexpr int P = pack_size<T>;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int packs = C / P;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * embedding_warps + threadIdx.x / 32;
       i < N; i += static_cast<std::int64_t>(gridDim.x) * embedding_warps) {
    const std::int32_t token = tokens[i];
    const bool valid = token >= 0 && token < V;
    const auto* row = reinterpret_cast<const Pack<T>*>(wte + (valid ? token : 0) * std::int64_t{C});
    const auto* position =
        wpe == nullptr ? nullptr : reinterpret_cast<const Pack<T>*>(wpe + (i % Tn) * C);
    auto* o = reinterpret_cast<Pack<T>*>(out + i * C);
    for (int c = lane; c < packs; c += 32) {
      Pack<T> r;
      if (valid) {
        const Pack<T> a = row[c];
        if (position != nullptr) {
          const Pack<T> b = position[c];
#pragma unroll
          for (int k = 0; k < P; ++k) r.v[k] = store<T>(load(a.v[k]) + load(b.v[k]));
        } else {
#pragma unroll
          for (int k = 0; k < P; ++k) r.v[k] = store<T>(load(a.v[k]));
        }
      } else {
#pragma unroll
        for (int k = 0; k < P; ++k) r.v[k] = store<T>(__int_as_float(0x7fc00000));
      }
      o[c] = r;
    }
  }
}

/// The radix sort's input: keys[i] = tokens[i], or V for a token outside [0, V) (so the sort
/// needs only the bits of V, and such tokens sort last, in one run the kernels below skip), and
/// positions[i] = i (the values it carries along).
template <class I>
__global__ void embedding_sort_input_kernel(I* keys, I* positions, const I* tokens, int n, int V) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const I token = tokens[i];
  keys[i] = token >= 0 && token < V ? token : V;
  positions[i] = i;
}

/// Block k handles sorted entry k when it starts a run of equal tokens below V: threads over
/// channels add the run's rows of dout in position order into dwte[token].
template <class T>
__global__ void embedding_backward_wte_kernel(T* dwte, const T* dout,
                                              const std::int32_t* sorted_tokens,
                                              const std::int32_t* sorted_positions, int N, int C,
                                              int V) {
  const int k = blockIdx.x;
  const std::int32_t token = sorted_tokens[k];
  if (token == V) return;                              // out of range: no row to add into
  if (k > 0 && sorted_tokens[k - 1] == token) return;  // not the first of its run
  int end = k + 1;
  while (end < N && sorted_tokens[end] == token) ++end;
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < C; c += gridDim.y * blockDim.x) {
    T* g = dwte + static_cast<std::int64_t>(token) * C + c;
    float acc = load(*g);
    for (int j = k; j < end; ++j) {
      acc += load(dout[static_cast<std::int64_t>(sorted_positions[j]) * C + c]);
    }
    *g = store<T>(acc);
  }
}

/// embedding_backward_wte_kernel with one warp per sorted entry and 16-byte packs (C a whole
/// number of packs, every pointer 16-byte aligned): the same additions in the same order.
template <class T>
__global__ void __launch_bounds__(32 * embedding_warps)
    embedding_backward_wte_rows_kernel(T* dwte, const T* dout, const std::int32_t* sorted_tokens,
                                       const std::int32_t* sorted_positions, int N, int C, int V) {
  constexpr int P = pack_size<T>;
  const int k = static_cast<int>(blockIdx.x) * embedding_warps + static_cast<int>(threadIdx.x / 32);
  if (k >= N) return;
  const std::int32_t token = sorted_tokens[k];
  if (token == V) return;                              // out of range: no row to add into
  if (k > 0 && sorted_tokens[k - 1] == token) return;  // not the first of its run
  int end = k + 1;
  while (end < N && sorted_tokens[end] == token) ++end;
  const int packs = C / P;
  auto* g = reinterpret_cast<Pack<T>*>(dwte + static_cast<std::int64_t>(token) * C);
  for (int c = static_cast<int>(threadIdx.x % 32); c < packs; c += 32) {
    Pack<T> row = g[c];
    float acc[P];
#pragma unroll
    for (int q = 0; q < P; ++q) acc[q] = load(row.v[q]);
    for (int j = k; j < end; ++j) {
      const Pack<T> d = reinterpret_cast<const Pack<T>*>(
          dout + static_cast<std::int64_t>(sorted_positions[j]) * C)[c];
#pragma unroll
      for (int q = 0; q < P; ++q) acc[q] += load(d.v[q]);
    }
#pragma unroll
    for (int q = 0; q < P; ++q) row.v[q] = store<T>(acc[q]);
    g[c] = row;
  }
}

/// dwpe[t, c] += sum over b (in order) of dout[b, t, c] (Packed: T*C a whole number of packs,
/// both pointers 16-byte aligned, each thread adding whole packs).
template <class T, bool Packed>
__global__ void embedding_backward_wpe_kernel(T* dwpe, const T* dout, int B, int Tn, int C) {
  constexpr int P = Packed ? pack_size<T> : 1;
  const std::int64_t units = static_cast<std::int64_t>(Tn) * C / P;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < units;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (Packed) {
      Pack<T> r = reinterpret_cast<const Pack<T>*>(dwpe)[e];
      float acc[P];
#pragma unroll
      for (int q = 0; q < P; ++q) acc[q] = load(r.v[q]);
      for (int b = 0; b < B; ++b) {
        const Pack<T> d = reinterpret_cast<const Pack<T>*>(dout)[b * units + e];
#pragma unroll
        for (int q = 0; q < P; ++q) acc[q] += load(d.v[q]);
      }
#pragma unroll
      for (int q = 0; q < P; ++q) r.v[q] = store<T>(acc[q]);
      reinterpret_cast<Pack<T>*>(dwpe)[e] = r;
    } else {
      float acc = load(dwpe[e]);
      for (int b = 0; b < B; ++b) acc += load(dout[b * units + e]);
      dwpe[e] = store<T>(acc);
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out [B*T, C] from tokens [B*T] (device pointers; wpe may be null: no positions); rows of
/// out-of-range tokens become NaN.
template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                       std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V,
                       cudaStream_t stream) {
  expect_int_range(C, "embedding_forward");
  expect_int_range(V, "embedding_forward");
  expect_int_range(Tn, "embedding_forward");
  const std::int64_t total = B * Tn * C;
  if (total == 0) return;
  if (C % pack_size<T> == 0 && aligned16({out, wte, wpe})) {
    const std::int64_t N = B * Tn;
    embedding_forward_rows_kernel<T>
        <<<grid_for(N, embedding_warps), 32 * embedding_warps, 0, stream>>>(
            out, tokens, wte, wpe, N, static_cast<int>(Tn), static_cast<int>(C),
            static_cast<int>(V));
    ZERO_CUDA_CHECK(cudaGetLastError());
    return;
  }
  embedding_forward_kernel<T><<<grid_for(total), elementwise_threads, 0, stream>>>(
      out, tokens, wte, wpe, total, static_cast<int>(Tn), static_cast<int>(C), static_cast<int>(V));
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// Accumulates dwte [V, C] and dwpe [T, C] (either may be null) from dout [B*T, C]; a token
/// outside [0, V) adds nothing (its forward row was NaN). Uses stream-ordered scratch of about
/// 16 bytes per position plus CUB's sort storage.
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const std::int32_t* tokens, std::int64_t B,
                        std::int64_t Tn, std::int64_t C, std::int64_t V, cudaStream_t stream) {
  const std::int64_t N = B * Tn;
  expect_int_range(N, "embedding_backward");
  expect_int_range(C, "embedding_backward");
  expect_int_range(V, "embedding_backward");
  if (N == 0 || C == 0) return;
  constexpr int threads = 256;
  // Blocks over channels: the kernel strides by the grid, so a row past 65535 blocks is fine.
  const int c_blocks = static_cast<int>(std::min<std::int64_t>((C + threads - 1) / threads, 65535));
  if (dwte != nullptr) {
    const int n = static_cast<int>(N);
    // Keys in [0, V]: the sort passes over the bits V needs (16 for GPT-2's 50257), not all 32.
    const int key_bits =
        std::max(1, static_cast<int>(std::bit_width(static_cast<std::uint32_t>(V))));
    std::size_t sort_bytes = 0;
    ZERO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, sort_bytes, static_cast<const std::int32_t*>(nullptr),
        static_cast<std::int32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
        static_cast<std::int32_t*>(nullptr), n, 0, key_bits, stream));
    const std::size_t array_bytes = (static_cast<std::size_t>(n) * 4 + 255) / 256 * 256;
    DeviceScratch scratch(4 * array_bytes + sort_bytes, stream);
    auto* keys = scratch.as<std::int32_t>();
    auto* positions = reinterpret_cast<std::int32_t*>(scratch.as<char>() + array_bytes);
    auto* sorted_positions = reinterpret_cast<std::int32_t*>(scratch.as<char>() + 2 * array_bytes);
    auto* sorted_tokens = reinterpret_cast<std::int32_t*>(scratch.as<char>() + 3 * array_bytes);
    void* sort_storage = scratch.as<char>() + 4 * array_bytes;
    embedding_sort_input_kernel<std::int32_t>
        <<<static_cast<unsigned>((N + threads - 1) / threads), threads, 0, stream>>>(
            keys, positions, tokens, n, static_cast<int>(V));
    ZERO_CUDA_CHECK(cudaGetLastError());
    // Keys are non-negative and below 2^key_bits, so sorting those bits keeps their order.
    ZERO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys, sorted_tokens,
                                                    positions, sorted_positions, n, 0, key_bits,
                                                    stream));
    if (C % pack_size<T> == 0 && aligned16({dwte, dout})) {
      embedding_backward_wte_rows_kernel<T>
          <<<static_cast<unsigned>((N + embedding_warps - 1) / embedding_warps),
             32 * embedding_warps, 0, stream>>>(dwte, dout, sorted_tokens, sorted_positions, n,
                                                static_cast<int>(C), static_cast<int>(V));
    } else {
      embedding_backward_wte_kernel<T>
          <<<dim3(static_cast<unsigned>(n), c_blocks), threads, 0, stream>>>(
              dwte, dout, sorted_tokens, sorted_positions, n, static_cast<int>(C),
              static_cast<int>(V));
    }
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
  if (dwpe != nullptr) {
    expect_int_range(Tn * C, "embedding_backward");
    if (Tn * C % pack_size<T> == 0 && aligned16({dwpe, dout})) {
      embedding_backward_wpe_kernel<T, true>
          <<<grid_for(Tn * C / pack_size<T>), elementwise_threads, 0, stream>>>(
              dwpe, dout, static_cast<int>(B), static_cast<int>(Tn), static_cast<int>(C));
    } else {
      embedding_backward_wpe_kernel<T, false><<<grid_for(Tn * C), elementwise_threads, 0, stream>>>(
          dwpe, dout, static_cast<int>(B), static_cast<int>(Tn), static_cast<int>(C));
    }
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace zero::ops::cuda
