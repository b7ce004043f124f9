#pragma once
// zero-requires: cuda
// Flash attention on tensor cores: the bf16 and f16 kernels behind attention.cuh's launchers for
// head sizes 64 and 128 (FlashAttention-2's layout, Dao 2023; written from the paper and the PTX
// ISA's mma.sync fragment tables). Same inputs, outputs and contracts as the CUDA-core kernels in
// attention.cuh: causal, packed qkv [B, T, 3C], lse [B, NH, T] saved by the forward, the host's
// dropout mask, gradients added into dqkv by one thread per element (no atomics; backward_fused_dq,
// which no launcher takes, adds dq with float atomics).
//
// A block holds 64 rows (4 warps x 16; the forward also compiles with 128, 2 tiles of 16 a warp)
// and streams tiles of the other side's rows through double buffers in shared memory (cp.async:
// the next tile's copy overlaps this one's work); every product is mma.sync.m16n8k16 with float
// accumulators, its operands loaded with ldmatrix (.trans where the tile's rows are the reduction
// dimension). A score tile's accumulators become the next product's A
// operand in registers (the C and A fragment layouts line up two 8-column tiles per 16-wide slice),
// rounded to T as the host rounds its saved probabilities. The softmax (max, exp, sums) runs in
// float on the accumulators.
//   forward:  S = Q K^T, online softmax, O += P V; out = O / l, lse = m + log l
//   dq:       pass 1 delta = rowsum(P * dP) (the host's sum_j att dp), pass 2
//             dS = P (dP - delta) scale, dQ += dS K, with dP = dO V^T; or, given the forward's
//             output O, delta = rowsum(dO * O) first (FlashAttention-2's form, the same sum up to
//             O's rounding to T: O_t = sum_j dropout(P_tj) V_j) and one pass over the keys
//   dkdv:     per key block over the query tiles after it: S^T = K Q^T, P^T = exp(S^T - lse),
//             dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q;
//             FuseDq also dQ += dS K over the block's keys (dS through shared memory, atomics)
// Shared rows are padded by 8 elements so the 8 rows an ldmatrix reads fall in distinct banks.
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/attention_mma.cuh needs nvcc; host-only code includes zero/ops/cpu/attention.hpp"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <zero/core/bfloat16.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/float16.hpp>
#include <zero/ops/causal_tiles.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

namespace detail {

/// The index of attention entry (bh, t, t2) in the host's att [B, NH, T, T]: the dropout mask's
/// counter, shared with cpu::attention_forward and with attention.cuh's CUDA-core kernels.
__device__ __forceinline__ std::int64_t attention_entry(int bh, int t, int t2, int Tn) {
  return (static_cast<std::int64_t>(bh) * Tn + t) * Tn + t2;
}

}  // namespace detail

namespace mma {

/// Rows a block owns: 4 warps of 16.
inline constexpr int block_rows = 64;
inline constexpr int block_threads = 128;
/// Elements of padding at the end of each shared row (16 bytes).
inline constexpr int row_pad = 8;

/// The storage types with a tensor-core path.
template <class T>
inline constexpr bool has_mma = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

/// Rows of the streamed tile: 64, or 32 for head size 128 in the backward (registers).
template <int HD, bool Backward>
inline constexpr int stream_rows = Backward&& HD == 128 ? 32 : 64;

// ---- PTX wrappers -------------------------------------------------------------------------------

/// d += a b for a 16x16 (row) by 16x8 (col) tile of T, float accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row
/// l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// Two floats rounded to T (nearest even) in one register, lo in the low half.
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}

// ---- fragments ----------------------------------------------------------------------------------
// In an m16n8 accumulator c[4], lane l holds row l / 4 (c[0], c[1]) and row l / 4 + 8 (c[2],
// c[3]), columns 2 (l % 4) and 2 (l % 4) + 1.

/// The A operand (16 rows x 16 columns) at rows [r0, r0 + 16) and columns [c0, c0 + 16) of a
/// row-major shared tile with ld elements per row.
template <class T>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const T* tile, int ld, int r0, int c0,
                                       int lane) {
  ldmatrix_x4(a, tile + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8);
}

/// The A operand (16 rows x 16 columns) of a tile stored transposed: A[r][c] is
/// tile[(k0 + c) * ld + m0 + r], rows [m0, m0 + 16) of A the tile's columns, A's columns
/// [k0, k0 + 16) the tile's rows (ldmatrix .trans; matrices in A's order: rows 0-7 and 8-15 at
/// columns 0-7, then at columns 8-15).
template <class T>
__device__ __forceinline__ void load_a_trans(std::uint32_t (&a)[4], const T* tile, int ld, int m0,
                                             int k0, int lane) {
  ldmatrix_x4_trans(a,
                    tile + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}

/// B operands of two adjacent 8-column tiles of a product whose reduction runs along the shared
/// tile's columns (the tile's rows are the product's columns: K in Q K^T): rows [n0, n0 + 16),
/// columns [k0, k0 + 16). b[0], b[1] serve columns n0..n0+7, b[2], b[3] n0+8..n0+15.
template <class T>
__device__ __forceinline__ void load_b_rows(std::uint32_t (&b)[4], const T* tile, int ld, int n0,
                                            int k0, int lane) {
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}

/// B operands of a product whose reduction runs along the shared tile's rows (V in P V): rows
/// [k0, k0 + 16), columns [n0, n0 + 16), transposed on load.
template <class T>
__device__ __forceinline__ void load_b_cols(std::uint32_t (&b)[4], const T* tile, int ld, int k0,
                                            int n0, int lane) {
  ldmatrix_x4_trans(b,
                    tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

/// The A operand of the 16-wide slice j of a 16 x (8 n) accumulator tile, rounded to T.
template <class T, int N>
__device__ __forceinline__ void accumulators_as_a(std::uint32_t (&a)[4], const float (&c)[N][4],
                                                  int j) {
  a[0] = pack2<T>(c[2 * j][0], c[2 * j][1]);
  a[1] = pack2<T>(c[2 * j][2], c[2 * j][3]);
  a[2] = pack2<T>(c[2 * j + 1][0], c[2 * j + 1][1]);
  a[3] = pack2<T>(c[2 * j + 1][2], c[2 * j + 1][3]);
}

/// c[2j], c[2j + 1] += a (16 x 16) times the 16 rows [16 j, 16 j + 16) of a shared tile,
/// transposed, over its columns [k0, k0 + 16): a product reducing along the tile's columns
/// (S = Q K^T).
template <class T, int N>
__device__ __forceinline__ void mma_by_rows(float (&c)[N][4], const std::uint32_t (&a)[4],
                                            const T* tile, int ld, int j, int k0, int lane) {
  std::uint32_t b[4];
  load_b_rows(b, tile, ld, j * 16, k0, lane);
  mma_16816<T>(c[2 * j], a, b[0], b[1]);
  mma_16816<T>(c[2 * j + 1], a, b[2], b[3]);
}

/// c[2 d], c[2 d + 1] += a (16 x 16) times the tile's rows [k0, k0 + 16) at columns
/// [16 d, 16 d + 16): a product reducing along the tile's rows (O += P V).
template <class T, int N>
__device__ __forceinline__ void mma_by_cols(float (&c)[N][4], const std::uint32_t (&a)[4],
                                            const T* tile, int ld, int k0, int d, int lane) {
  std::uint32_t b[4];
  load_b_cols(b, tile, ld, k0, d * 16, lane);
  mma_16816<T>(c[2 * d], a, b[0], b[1]);
  mma_16816<T>(c[2 * d + 1], a, b[2], b[3]);
}

/// Sum over the 4 lanes that share an accumulator row.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/// fn(std::true_type{}) when the warp's part of a tile is whole (causal_tile_whole: no entry
/// masked), else fn(std::false_type{}): the per-entry checks compiled out of the whole tiles.
/// whole must be the same for every lane of the warp.
template <class Fn>
__device__ __forceinline__ void with_causal_mask(bool whole, Fn&& fn) {
  if (whole) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

/// The 16-key slices of a key tile of KT keys from k0 that hold a key visible to a row tile whose
/// last row is last_row (keys up to last_row); none when the tile starts after that row, where
/// the division would truncate -1 to 0 and count a slice of masked work (and 0 times an Inf or
/// NaN key there would reach rows that never see it).
template <int KT>
__device__ __forceinline__ int visible_slices(int last_row, int k0) {
  return last_row < k0 ? 0 : min(KT / 16, (last_row - k0) / 16 + 1);
}

/// 16 bytes from global to shared memory without passing through registers (cp.async); zeros
/// instead when !valid (src-size 0: nothing is read).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit_async() {
  asm volatile("cp.async.commit_group;\n" ::);
}
/// Waits until at most Pending groups of this thread's copies are still in flight.
template <int Pending>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

/// Copies rows [first, first + count) of one head (HD elements each, row_stride apart from base)
/// into a shared tile of ld elements per row, 16 bytes per thread and step, with cp.async (wait
/// for it with wait_async, or wait_all_async, and a barrier); rows past Tn become zero.
template <class T, int HD>
__device__ __forceinline__ void load_tile_async(T* tile, int ld, const T* base,
                                                std::int64_t row_stride, int first, int count,
                                                int Tn) {
  constexpr int chunks = HD / 8;
  for (int i = threadIdx.x; i < count * chunks; i += blockDim.x) {
    const int r = i / chunks, c = (i % chunks) * 8, row = first + r;
    const bool valid = row < Tn;
    copy16_async(tile + r * ld + c, base + (valid ? row * row_stride + c : 0), valid);
  }
}

/// Waits for every copy this thread has issued: a block's own tiles, loaded before the streamed
/// ones start, arrive in one round trip to memory (each thread's copies of all their rows in
/// flight together) instead of one per 16 bytes a thread.
__device__ __forceinline__ void wait_all_async() {
  commit_async();
  wait_async<0>();
}

/// Streams the tiles at first, first + rows, ... (below end) of two row sets through double
/// buffers: the copy of the next tile overlaps the work on this one. fn(a, b, start) sees the
/// tiles of rows [start, start + rows) of a_base and b_base; buffers hold 2 tiles of each.
template <class T, int HD, class Fn>
__device__ __forceinline__ void stream_tiles(T* a_buf, T* b_buf, int ld, const T* a_base,
                                             std::int64_t a_stride, const T* b_base,
                                             std::int64_t b_stride, int first, int end, int rows,
                                             int Tn, Fn&& fn) {
  const int tile_elems = rows * ld;
  if (first < end) {
    load_tile_async<T, HD>(a_buf, ld, a_base, a_stride, first, rows, Tn);
    load_tile_async<T, HD>(b_buf, ld, b_base, b_stride, first, rows, Tn);
    commit_async();
  }
  for (int start = first, it = 0; start < end; start += rows, ++it) {
    const int cur = it & 1;
    if (start + rows < end) {  // the next tile into the other buffers (free since the last barrier)
      load_tile_async<T, HD>(a_buf + (cur ^ 1) * tile_elems, ld, a_base, a_stride, start + rows,
                             rows, Tn);
      load_tile_async<T, HD>(b_buf + (cur ^ 1) * tile_elems, ld, b_base, b_stride, start + rows,
                             rows, Tn);
      commit_async();
      wait_async<1>();
    } else {
      wait_async<0>();
    }
    __syncthreads();  // this tile has landed for every thread
    fn(a_buf + cur * tile_elems, b_buf + cur * tile_elems, start, cur);
    __syncthreads();  // every warp is done with it before it is overwritten
  }
}

/// Adds a 16 x HD accumulator block (rows row0 and row0 + 8 of this lane) into dst (row stride
/// row_stride) for rows below Tn, each element rounded once; writes it (dst not read) when
/// overwrite.
template <class T, int HD>
__device__ __forceinline__ void add_rows(T* dst, std::int64_t row_stride,
                                         const float (&acc)[HD / 8][4], int row0, int Tn, int lane,
                                         bool overwrite) {
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + half * 8;
    if (row >= Tn) continue;
    T* r = dst + row * row_stride + 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      T* e = r + nt * 8;
      e[0] = store<T>(overwrite ? acc[nt][2 * half] : load(e[0]) + acc[nt][2 * half]);
      e[1] = store<T>(overwrite ? acc[nt][2 * half + 1] : load(e[1]) + acc[nt][2 * half + 1]);
    }
  }
}

// ---- forward ------------------------------------------------------------------------------------

/// m16 row tiles each warp of the forward owns: 1 (a block of 64 query rows) or, at head size 64,
/// 2 (128 rows, FlashAttention-2's forward block): each K and V fragment loaded from shared memory
/// then feeds two products, and each streamed tile serves twice the rows. The launchers stay on 1:
/// on an H200 at 4fda685 two tiles took 0.105 ms against one tile's 0.092 at GPT-2's shape
/// (kernel_bench's flash_attention_forward_row_tiles; docs/cuda.md).
template <int HD>
inline constexpr int forward_row_tiles = 1;

/// Query rows of a forward block.
template <int RowTiles>
inline constexpr int forward_block_rows = block_rows* RowTiles;

/// Block (blockIdx.x: b * NH + h; blockIdx.y: forward_block_rows query rows, the last rows of
/// every head first): out rows and lse. Dropping: dropout is active (a kernel without it has no
/// Philox code). Warp w owns the RowTiles x 16 rows from q0 + 16 RowTiles w, tile i of them the
/// 16 rows from q0 + 16 (RowTiles w + i).
template <class T, int HD, bool Dropping, int RowTiles>
__global__ void __launch_bounds__(block_threads)
    forward_kernel(T* out, float* lse, const T* qkv, int Tn, int C, int NH, float scale,
                   cpu::DropoutMask dropout) {
  static_assert(RowTiles == 1 || (RowTiles == 2 && HD == 64),
                "two row tiles a warp only at head size 64 (registers)");
  constexpr int KT = stream_rows<HD, false>, LD = HD + row_pad, MT = RowTiles;
  constexpr int rows = forward_block_rows<RowTiles>;
  extern __shared__ __align__(16) unsigned char shared[];
  T* q_s = reinterpret_cast<T*>(shared);
  T* k_buf = q_s + rows * LD;  // two K tiles, then two V tiles
  T* v_buf = k_buf + 2 * KT * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
  const int q0 =
      causal_row_tile_in_work_order(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y)) *
      rows;
  const int warp_row = q0 + warp * 16 * MT;  // the first row of the warp's tiles
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * HD;
  constexpr bool dropping = Dropping;
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;
  const float scale_log2 =
      scale * log2e;  // the scores stay unscaled: s scale = (s scale_log2) ln 2

  load_tile_async<T, HD>(q_s, LD, head, stride, q0, rows, Tn);
  wait_all_async();
  __syncthreads();
  std::uint32_t qf[MT][HD / 16][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      load_a(qf[i][kk], q_s, LD, (warp * MT + i) * 16, kk * 16, lane);
    }
  }

  float o[MT][HD / 8][4] = {};
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    m[i][0] = m[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.0f;
  }
  const int kv_end = min(q0 + rows, Tn);
  stream_tiles<T, HD>(
      k_buf, v_buf, LD, head + C, stride, head + 2 * C, stride, 0, kv_end, KT, Tn,
      [&](const T* k_s, const T* v_s, int k0, int) {
        // 16-key slices of the tile with a key visible to tile i's last row (warp_row + 16 i +
        // 15), none when the tile starts after it (a 128-row block's second key tile, for the
        // first rows); the last tile's are the most.
        int slices[MT];
#pragma unroll
        for (int i = 0; i < MT; ++i) slices[i] = visible_slices<KT>(warp_row + 16 * i + 15, k0);
        if (slices[MT - 1] <= 0) return;
        float s[MT][KT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
          for (int j = 0; j < KT / 16; ++j) {
            if (j >= slices[MT - 1]) break;
            std::uint32_t kb[4];  // one load of K's fragments for every row tile
            load_b_rows(kb, k_s, LD, j * 16, kk * 16, lane);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              if (j >= slices[i]) continue;
              mma_16816<T>(s[i][2 * j], qf[i][kk], kb[0], kb[1]);
              mma_16816<T>(s[i][2 * j + 1], qf[i][kk], kb[2], kb[3]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int row0 = warp_row + 16 * i + lane / 4;  // and row0 + 8
          float mx[2] = {m[i][0], m[i][1]};
          with_causal_mask(causal_tile_whole(warp_row + 16 * i, 16, k0, KT, Tn), [&](auto whole) {
#pragma unroll
            for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                float v = s[i][nt][e];
                if constexpr (!decltype(whole)::value) {
                  const int row = row0 + (e >> 1) * 8, key = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                  if (!(key <= row && key < Tn)) v = -INFINITY;
                }
                s[i][nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
              }
            }
          });
          float correction[2], offset[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // Finite: key 0 (the first tile's) is visible to every row, so m is after it.
            mx[r] = quad_max(mx[r]);
            correction[r] = exp2_approx((m[i][r] - mx[r]) * scale_log2);  // 0 on the first tile
            m[i][r] = mx[r];
            l[i][r] *= correction[r];
            offset[r] = m[i][r] * scale_log2;
          }
#pragma unroll
          for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float p = exp2_approx(fmaf(s[i][nt][e], scale_log2, -offset[e >> 1]));
              l[i][e >> 1] += p;
              if (dropping && p != 0.0f) {
                const int row = row0 + (e >> 1) * 8, key = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                p *= cpu::DropoutMask::factor(
                    dropout.keep(detail::attention_entry(bh, row, key, Tn)), drop_scale);
              }
              s[i][nt][e] = p;
            }
          }
#pragma unroll
          for (int nt = 0; nt < HD / 8; ++nt) {
            o[i][nt][0] *= correction[0];
            o[i][nt][1] *= correction[0];
            o[i][nt][2] *= correction[1];
            o[i][nt][3] *= correction[1];
          }
        }
#pragma unroll
        for (int j = 0; j < KT / 16; ++j) {
          if (j >= slices[MT - 1]) break;
          std::uint32_t pa[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) accumulators_as_a<T>(pa[i], s[i], j);
#pragma unroll
          for (int dp = 0; dp < HD / 16; ++dp) {
            std::uint32_t vb[4];  // one load of V's fragments for every row tile
            load_b_cols(vb, v_s, LD, j * 16, dp * 16, lane);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              if (j >= slices[i]) continue;
              mma_16816<T>(o[i][2 * dp], pa[i], vb[0], vb[1]);
              mma_16816<T>(o[i][2 * dp + 1], pa[i], vb[2], vb[3]);
            }
          }
        }
      });
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row + 16 * i + lane / 4 + r * 8;
      const float sum = quad_sum(l[i][r]);
      if (row >= Tn) continue;
      const float inv = 1.0f / sum;
      T* dst = out + (static_cast<std::int64_t>(b) * Tn + row) * C + h * HD + 2 * (lane & 3);
#pragma unroll
      for (int nt = 0; nt < HD / 8; ++nt) {
        dst[nt * 8] = store<T>(o[i][nt][2 * r] * inv);
        dst[nt * 8 + 1] = store<T>(o[i][nt][2 * r + 1] * inv);
      }
      if ((lane & 3) == 0) {
        lse[static_cast<std::int64_t>(bh) * Tn + row] = m[i][r] * scale + logf(sum);
      }
    }
  }
}

// ---- backward: dq (and delta) -------------------------------------------------------------------

/// One thread per row (b, t, h): delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d], in
/// float from 16-byte loads.
template <class T, int HD>
__global__ void delta_kernel(float* delta, const T* out, const T* dout, int B, int Tn, int NH) {
  constexpr int P = pack_size<T>;
  const std::int64_t rows = static_cast<std::int64_t>(B) * Tn * NH;
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  const auto* o = reinterpret_cast<const Pack<T>*>(out + i * HD);  // row (b, t), head h
  const auto* g = reinterpret_cast<const Pack<T>*>(dout + i * HD);
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < HD / P; ++k) {
    const Pack<T> op = o[k], gp = g[k];
#pragma unroll
    for (int j = 0; j < P; ++j) sum += load(op.v[j]) * load(gp.v[j]);
  }
  const std::int64_t h = i % NH, bt = i / NH, b = bt / Tn, t = bt % Tn;
  delta[(b * NH + h) * Tn + t] = sum;
}

/// Blocks an SM the dq kernel asks for at head size 64 without dropout: 3 where three blocks'
/// shared memory fits an SM (sm_90: 228 KiB), which caps its registers at 168; elsewhere 1 (on
/// sm_80, 164 KiB, three blocks' 55 KiB do not fit, so asking for 3 only capped the registers
/// and spilled).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define ZERO_ATTENTION_DQ_BLOCKS_PER_SM 1
#else
#define ZERO_ATTENTION_DQ_BLOCKS_PER_SM 3
#endif

/// Block (blockIdx.x: b * NH + h; blockIdx.y: 64 query rows, the last first): dq += dS K, with
/// delta computed here from P and dP (written to delta for the dk/dv kernel) or, GivenDelta, read
/// from delta. overwrite writes dq into dqkv instead of adding (dqkv not read).
template <class T, int HD, bool GivenDelta, bool Dropping>
__global__ void __launch_bounds__(block_threads,
                                  HD == 64 && !Dropping ? ZERO_ATTENTION_DQ_BLOCKS_PER_SM : 1)
    backward_dq_kernel(T* dqkv, float* delta, const T* dout, const T* qkv, const float* lse, int Tn,
                       int C, int NH, float scale, cpu::DropoutMask dropout, bool overwrite) {
  constexpr int KT = stream_rows<HD, true>, LD = HD + row_pad;
  extern __shared__ __align__(16) unsigned char shared[];
  T* q_s = reinterpret_cast<T*>(shared);
  T* do_s = q_s + block_rows * LD;
  T* k_buf = do_s + block_rows * LD;  // two K tiles, then two V tiles
  T* v_buf = k_buf + 2 * KT * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
  const int q0 =
      causal_row_tile_in_work_order(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y)) *
      block_rows;
  const int row0 = q0 + warp * 16 + lane / 4;
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * HD;
  const T* dout_head = dout + static_cast<std::int64_t>(b) * Tn * C + h * HD;
  constexpr bool dropping = Dropping;
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;
  const float scale_log2 = scale * log2e;

  load_tile_async<T, HD>(q_s, LD, head, stride, q0, block_rows, Tn);
  load_tile_async<T, HD>(do_s, LD, dout_head, C, q0, block_rows, Tn);
  wait_all_async();
  __syncthreads();
  std::uint32_t qf[HD / 16][4], dof[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    load_a(qf[kk], q_s, LD, warp * 16, kk * 16, lane);
    load_a(dof[kk], do_s, LD, warp * 16, kk * 16, lane);
  }
  float lse_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + r * 8;
    lse_r[r] = row < Tn ? lse[static_cast<std::int64_t>(bh) * Tn + row] * log2e : 0.0f;  // base 2
  }
  const int last_key = q0 + warp * 16 + 15;
  const int kv_end = min(q0 + block_rows, Tn);

  // P and dP (through the dropout mask) of the tile at k0, in p and dp; false when the warp
  // sees no key of it.
  auto scores = [&](const T* k_s, const T* v_s, int k0, float(&p)[KT / 8][4],
                    float(&dp)[KT / 8][4]) {
    // None for a tile after the warp's rows (head size 128: 32-key tiles, and warps 0 and 1 see
    // no key of the block's last one).
    const int slices = visible_slices<KT>(last_key, k0);
#pragma unroll
    for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[nt][e] = dp[nt][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < KT / 16; ++j) {
        if (j >= slices) break;
        mma_by_rows<T>(p, qf[kk], k_s, LD, j, kk * 16, lane);
        mma_by_rows<T>(dp, dof[kk], v_s, LD, j, kk * 16, lane);
      }
    }
    with_causal_mask(causal_tile_whole(q0 + warp * 16, 16, k0, KT, Tn), [&](auto whole) {
#pragma unroll
      for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + (e >> 1) * 8, key = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
          bool visible = true;
          if constexpr (!decltype(whole)::value) visible = key <= row && key < Tn && row < Tn;
          p[nt][e] = exp2_approx(visible ? fmaf(p[nt][e], scale_log2, -lse_r[e >> 1]) : -INFINITY);
          if (!visible) {
            dp[nt][e] = 0.0f;
          } else if (dropping) {
            dp[nt][e] *= cpu::DropoutMask::factor(
                dropout.keep(detail::attention_entry(bh, row, key, Tn)), drop_scale);
          }
        }
      }
    });
    return slices > 0;
  };

  float delta_r[2];
  if constexpr (GivenDelta) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + r * 8;
      delta_r[r] = row < Tn ? delta[static_cast<std::int64_t>(bh) * Tn + row] : 0.0f;
    }
  } else {
    float delta_part[2] = {0.0f, 0.0f};
    stream_tiles<T, HD>(k_buf, v_buf, LD, head + C, stride, head + 2 * C, stride, 0, kv_end, KT, Tn,
                        [&](const T* k_s, const T* v_s, int k0, int) {  // pass 1: delta
                          float p[KT / 8][4], dp[KT / 8][4];
                          if (!scores(k_s, v_s, k0, p, dp)) return;
#pragma unroll
                          for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) delta_part[e >> 1] += p[nt][e] * dp[nt][e];
                          }
                        });
    delta_r[0] = quad_sum(delta_part[0]);
    delta_r[1] = quad_sum(delta_part[1]);
  }

  float dq[HD / 8][4] = {};
  stream_tiles<T, HD>(k_buf, v_buf, LD, head + C, stride, head + 2 * C, stride, 0, kv_end, KT, Tn,
                      [&](const T* k_s, const T* v_s, int k0, int) {  // pass 2: dq
                        float p[KT / 8][4], dp[KT / 8][4];
                        if (!scores(k_s, v_s, k0, p, dp)) return;
#pragma unroll
                        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
                          for (int e = 0; e < 4; ++e)
                            p[nt][e] = p[nt][e] * (dp[nt][e] - delta_r[e >> 1]) * scale;
                        }
                        const int slices = visible_slices<KT>(last_key, k0);
#pragma unroll
                        for (int j = 0; j < KT / 16; ++j) {
                          if (j >= slices) break;
                          std::uint32_t da[4];
                          accumulators_as_a<T>(da, p, j);
#pragma unroll
                          for (int dp2 = 0; dp2 < HD / 16; ++dp2) {
                            mma_by_cols<T>(dq, da, k_s, LD, j * 16, dp2, lane);
                          }
                        }
                      });
  add_rows<T, HD>(dqkv + static_cast<std::int64_t>(b) * Tn * stride + h * HD, stride, dq, row0, Tn,
                  lane, overwrite);
  if (!GivenDelta && (lane & 3) == 0) {
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + r * 8;
      if (row < Tn) delta[static_cast<std::int64_t>(bh) * Tn + row] = delta_r[r];
    }
  }
}

// ---- backward: dk, dv ---------------------------------------------------------------------------

/// Block (blockIdx.x: b * NH + h; blockIdx.y: 64 key rows, the first of every head first): over
/// the query tiles from the block's first key on, dv += P^T dO and dk += dS^T Q, into dqkv (=,
/// dqkv not read, when overwrite).
/// FuseDq (head size 64): the block also adds its keys' share of dq, dS K, into dq_accum
/// ([B, T, C] floats, zeroed before; finish_dq rounds it into dqkv): each query tile's dS goes
/// through shared memory ([64 keys][QT queries], rounded to T as the dq kernel rounds it), each
/// warp takes 16 of the tile's queries over the block's 64 keys and adds its 16 x HD sums with
/// float atomics (FlashAttention-2's backward: one pass over the scores instead of the dq
/// kernel's second one; the order of the atomic adds, so dq's last bits, vary run to run).
template <class T, int HD, bool Dropping, bool FuseDq = false>
__global__ void __launch_bounds__(block_threads)
    backward_dkdv_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* delta,
                         int Tn, int C, int NH, float scale, cpu::DropoutMask dropout,
                         bool overwrite, float* dq_accum) {
  constexpr int QT = stream_rows<HD, true>, LD = HD + row_pad;
  extern __shared__ __align__(16) unsigned char shared[];
  T* k_s = reinterpret_cast<T*>(shared);
  T* v_s = k_s + block_rows * LD;
  T* q_buf = v_s + block_rows * LD;  // two Q tiles, then two dO tiles
  T* do_buf = q_buf + 2 * QT * LD;
  // two tiles' lse (times log2 e), then delta
  float* lse_buf = reinterpret_cast<float*>(do_buf + 2 * QT * LD);
  float* delta_buf = lse_buf + 2 * QT;
  static_assert(!FuseDq || (HD == 64 && QT == block_rows), "FuseDq: 4 warps of 16 queries a tile");
  constexpr int LDS = QT + row_pad;  // FuseDq: the tile's dS, [block_rows keys][QT queries]
  T* ds_s = reinterpret_cast<T*>(delta_buf + 2 * QT);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
  const int j0 =
      causal_key_tile_in_work_order(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y)) *
      block_rows;
  const int key0 = j0 + warp * 16 + lane / 4;  // this lane's key rows: key0 and key0 + 8
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * HD;
  const T* dout_head = dout + static_cast<std::int64_t>(b) * Tn * C + h * HD;
  const float* lse_head = lse + static_cast<std::int64_t>(bh) * Tn;
  const float* delta_head = delta + static_cast<std::int64_t>(bh) * Tn;
  constexpr bool dropping = Dropping;
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;
  const float scale_log2 = scale * log2e;

  load_tile_async<T, HD>(k_s, LD, head + C, stride, j0, block_rows, Tn);
  load_tile_async<T, HD>(v_s, LD, head + 2 * C, stride, j0, block_rows, Tn);
  wait_all_async();
  __syncthreads();
  std::uint32_t kf[HD / 16][4], vf[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    load_a(kf[kk], k_s, LD, warp * 16, kk * 16, lane);
    load_a(vf[kk], v_s, LD, warp * 16, kk * 16, lane);
  }
  const int first_key = j0 + warp * 16;
  float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
  // lse and delta of the first tile; each step stores the next tile's beside it (plain loads,
  // visible after stream_tiles' barrier).
  auto load_rows_stats = [&](int q0, int buffer) {
    if (threadIdx.x < QT) {
      const int row = q0 + static_cast<int>(threadIdx.x);
      lse_buf[buffer * QT + threadIdx.x] = row < Tn ? lse_head[row] * log2e : 0.0f;  // base 2
      delta_buf[buffer * QT + threadIdx.x] = row < Tn ? delta_head[row] : 0.0f;
    }
  };
  load_rows_stats(j0, 0);
  stream_tiles<T, HD>(
      q_buf, do_buf, LD, head, stride, dout_head, C, j0, Tn, QT, Tn,
      [&](const T* q_s, const T* do_s, int q0, int cur) {
        if (q0 + QT < Tn) load_rows_stats(q0 + QT, cur ^ 1);
        const float* lse_s = lse_buf + cur * QT;
        const float* delta_s = delta_buf + cur * QT;
        // Every query of the tile is before the warp's keys: its part is zero. Never with FuseDq
        // (QT == block_rows and the tiles start at the block's first key, so every warp sees
        // every tile): no warp leaves before the barrier of the dq product below.
        if (q0 + QT - 1 < first_key) return;
        float p[QT / 8][4] = {}, dp[QT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
          for (int j = 0; j < QT / 16; ++j) {
            mma_by_rows<T>(p, kf[kk], q_s, LD, j, kk * 16, lane);
            mma_by_rows<T>(dp, vf[kk], do_s, LD, j, kk * 16, lane);
          }
        }
        // p becomes dropout(P^T) for dV, dp becomes dS^T for dK.
        with_causal_mask(causal_tile_whole(q0, QT, first_key, 16, Tn), [&](auto whole) {
#pragma unroll
          for (int nt = 0; nt < QT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + (e >> 1) * 8, qi = nt * 8 + 2 * (lane & 3) + (e & 1);
              const int query = q0 + qi;
              bool visible = true;
              if constexpr (!decltype(whole)::value) {
                visible = query >= key && query < Tn && key < Tn;
              }
              // 2^-inf is 0: no branch around the exponential for masked entries.
              const float prob =
                  exp2_approx(visible ? fmaf(p[nt][e], scale_log2, -lse_s[qi]) : -INFINITY);
              // Masked entries are 0 (their dp may be anything); a dropped one is multiplied by
              // 0, so a NaN or infinite dp stays NaN (DropoutMask::factor).
              const float factor =
                  !dropping ? drop_scale
                  : visible
                      ? cpu::DropoutMask::factor(
                            dropout.keep(detail::attention_entry(bh, query, key, Tn)), drop_scale)
                      : 0.0f;
              p[nt][e] = prob * factor;
              // A masked entry's dS^T is 0, as the host's above the diagonal: 0 * (dp - delta)
              // is NaN for a query whose delta is not finite, which reached later keys' dK.
              dp[nt][e] = visible ? prob * (dp[nt][e] * factor - delta_s[qi]) * scale : 0.0f;
            }
          }
        });
#pragma unroll
        for (int j = 0; j < QT / 16; ++j) {
          std::uint32_t pa[4], sa[4];
          accumulators_as_a<T>(pa, p, j);
          accumulators_as_a<T>(sa, dp, j);
#pragma unroll
          for (int d2 = 0; d2 < HD / 16; ++d2) {
            mma_by_cols<T>(dv, pa, do_s, LD, j * 16, d2, lane);
            mma_by_cols<T>(dk, sa, q_s, LD, j * 16, d2, lane);
          }
        }
        // FuseDq: the warp's 16 key rows of dS (dS^T in its accumulators) into ds_s, rounded to T
        // as sa, then the block's dq product.
        if constexpr (FuseDq) {
#pragma unroll
          for (int nt = 0; nt < QT / 8; ++nt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              *reinterpret_cast<std::uint32_t*>(ds_s + (warp * 16 + lane / 4 + half * 8) * LDS +
                                                nt * 8 + 2 * (lane & 3)) =
                  pack2<T>(dp[nt][2 * half], dp[nt][2 * half + 1]);
            }
          }
          __syncthreads();  // every warp's rows of dS are in ds_s (no warp returned, above)
          // dq of the warp's 16 queries (rows warp * 16 of the tile) over the block's keys up to
          // its last query; the keys after it have dS = 0.
          const int first_query = q0 + warp * 16;
          float dq[HD / 8][4] = {};
#pragma unroll
          for (int kk = 0; kk < block_rows / 16; ++kk) {
            if (j0 + kk * 16 > first_query + 15) break;
            std::uint32_t da[4];
            load_a_trans(da, ds_s, LDS, warp * 16, kk * 16, lane);
#pragma unroll
            for (int d2 = 0; d2 < HD / 16; ++d2) mma_by_cols<T>(dq, da, k_s, LD, kk * 16, d2, lane);
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int query = first_query + lane / 4 + half * 8;
            if (query >= Tn) continue;
            float* row = dq_accum + (static_cast<std::int64_t>(b) * Tn + query) * C + h * HD +
                         2 * (lane & 3);
#pragma unroll
            for (int nt = 0; nt < HD / 8; ++nt) {
              atomicAdd(row + nt * 8, dq[nt][2 * half]);
              atomicAdd(row + nt * 8 + 1, dq[nt][2 * half + 1]);
            }
          }
        }
      });
  T* g = dqkv + static_cast<std::int64_t>(b) * Tn * stride + h * HD;
  add_rows<T, HD>(g + C, stride, dk, key0, Tn, lane, overwrite);
  add_rows<T, HD>(g + 2 * C, stride, dv, key0, Tn, lane, overwrite);
}

/// FuseDq's last step: dqkv's q columns = dq_accum rounded to T (added into them unless
/// overwrite), one thread per 16-byte pack of dqkv (C is whole packs: heads of 64; dqkv 16-byte
/// aligned, as the tensor-core kernels require).
template <class T>
__global__ void finish_dq_kernel(T* dqkv, const float* dq_accum, std::int64_t rows, int C,
                                 bool overwrite) {
  constexpr int P = pack_size<T>;
  const int packs = C / P;
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * packs) return;
  const std::int64_t row = i / packs;
  const std::int64_t c = (i - row * packs) * P;
  auto* dst = reinterpret_cast<Pack<T>*>(dqkv + row * 3 * C + c);
  const float* src = dq_accum + row * C + c;
  Pack<T> q;
  if (!overwrite) q = *dst;
#pragma unroll
  for (int j = 0; j < P; ++j) q.v[j] = store<T>(overwrite ? src[j] : load(q.v[j]) + src[j]);
  *dst = q;
}

// ---- launchers ----------------------------------------------------------------------------------

/// Shared bytes of each kernel: its own block's rows, and two buffers of each streamed tile.
template <class T, int HD, int RowTiles>
constexpr std::size_t forward_shared_bytes() {
  return static_cast<std::size_t>(forward_block_rows<RowTiles> + 4 * stream_rows<HD, false>) *
         (HD + row_pad) * sizeof(T);
}
template <class T, int HD>
constexpr std::size_t dq_shared_bytes() {
  return static_cast<std::size_t>(2 * block_rows + 4 * stream_rows<HD, true>) * (HD + row_pad) *
         sizeof(T);
}
template <class T, int HD, bool FuseDq = false>
constexpr std::size_t dkdv_shared_bytes() {
  constexpr int QT = stream_rows<HD, true>;
  return dq_shared_bytes<T, HD>() + 4 * QT * sizeof(float) +
         (FuseDq ? static_cast<std::size_t>(block_rows) * (QT + row_pad) * sizeof(T) : 0);
}

/// True when the tensor-core kernels take this call: bf16 or f16, head size 64 or 128, and every
/// pointer 16-byte aligned (rows are read 16 bytes at a time).
template <class T>
bool takes(std::int64_t hs, std::initializer_list<const void*> pointers) {
  if constexpr (!has_mma<T>) {
    return false;
  } else {
    if (hs != 64 && hs != 128) return false;
    for (const void* p : pointers) {
      if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
    }
    return true;
  }
}

/// Every kernel's grid: x the head (b * NH + h), y the tile of block_rows rows, so blocks start
/// tile by tile across all heads in the kernel's work order (the heaviest tile of every head
/// before the next tile of any).
/// Throws ShapeError where the tiles pass gridDim.y's 65535 (T above about 4 million rows).
inline dim3 grid_of(int B, int Tn, int NH, int rows = block_rows) {
  const int tiles = (Tn + rows - 1) / rows;
  expect<ShapeError>(tiles <= 65535, "attention: T = ", Tn, " needs ", tiles, " tiles of ", rows,
                     " rows, past the grid's 65535 in y");
  return dim3(static_cast<unsigned>(B * NH), static_cast<unsigned>(tiles));
}

/// Launches kernel with bytes of dynamic shared memory, raising the kernel's limit first where
/// it passes the default 48 KiB.
template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, std::size_t bytes, cudaStream_t stream, Args... args) {
  if (bytes > 48 * 1024) {
    ZERO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
  }
  kernel<<<grid, block_threads, bytes, stream>>>(args...);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// fn(std::bool_constant<dropout.active()>{}): each kernel is compiled with and without dropout.
template <class Fn>
void with_dropout(const cpu::DropoutMask& dropout, Fn&& fn) {
  if (dropout.active()) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

/// The forward with RowTiles m16 row tiles a warp (forward_row_tiles by default).
template <class T, int HD, int RowTiles = forward_row_tiles<HD>>
void forward(T* out, float* lse, const T* qkv, int B, int Tn, int C, int NH, float scale,
             const cpu::DropoutMask& dropout, cudaStream_t stream) {
  const dim3 grid = grid_of(B, Tn, NH, forward_block_rows<RowTiles>);
  with_dropout(dropout, [&](auto dropping) {
    launch(forward_kernel<T, HD, decltype(dropping)::value, RowTiles>, grid,
           forward_shared_bytes<T, HD, RowTiles>(), stream, out, lse, qkv, Tn, C, NH, scale,
           dropout);
  });
}

/// The backward's three launches, each alone (kernel_bench times them apart): delta =
/// rowsum(dout * out) into B*NH*T floats; dq (delta read when given_delta, else computed from
/// the probabilities and written); dk and dv (delta read). dqkv is added into, or written when
/// overwrite.
template <class T, int HD>
void backward_delta(float* delta, const T* out, const T* dout, int B, int Tn, int NH,
                    cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * Tn * NH;
  delta_kernel<T, HD>
      <<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(delta, out, dout, B, Tn, NH);
  ZERO_CUDA_CHECK(cudaGetLastError());
}
template <class T, int HD>
void backward_dq(T* dqkv, float* delta, bool given_delta, const T* dout, const T* qkv,
                 const float* lse, int B, int Tn, int C, int NH, float scale,
                 const cpu::DropoutMask& dropout, bool overwrite, cudaStream_t stream) {
  const dim3 grid = grid_of(B, Tn, NH);
  with_dropout(dropout, [&](auto dropping) {
    if (given_delta) {
      launch(backward_dq_kernel<T, HD, true, decltype(dropping)::value>, grid,
             dq_shared_bytes<T, HD>(), stream, dqkv, delta, dout, qkv, lse, Tn, C, NH, scale,
             dropout, overwrite);
    } else {
      launch(backward_dq_kernel<T, HD, false, decltype(dropping)::value>, grid,
             dq_shared_bytes<T, HD>(), stream, dqkv, delta, dout, qkv, lse, Tn, C, NH, scale,
             dropout, overwrite);
    }
  });
}
template <class T, int HD>
void backward_dkdv(T* dqkv, const float* delta, const T* dout, const T* qkv, const float* lse,
                   int B, int Tn, int C, int NH, float scale, const cpu::DropoutMask& dropout,
                   bool overwrite, cudaStream_t stream) {
  const dim3 grid = grid_of(B, Tn, NH);
  with_dropout(dropout, [&](auto dropping) {
    launch(backward_dkdv_kernel<T, HD, decltype(dropping)::value>, grid, dkdv_shared_bytes<T, HD>(),
           stream, dqkv, dout, qkv, lse, delta, Tn, C, NH, scale, dropout, overwrite,
           static_cast<float*>(nullptr));
  });
}

/// The backward into dqkv (added, or written when overwrite); delta is B*NH*T floats of scratch.
/// out (the forward's output, may be null) gives delta as rowsum(dout * out) and dq one pass over
/// the keys.
template <class T, int HD>
void backward(T* dqkv, float* delta, const T* dout, const T* qkv, const T* out, const float* lse,
              int B, int Tn, int C, int NH, float scale, const cpu::DropoutMask& dropout,
              bool overwrite, cudaStream_t stream) {
  if (out != nullptr) backward_delta<T, HD>(delta, out, dout, B, Tn, NH, stream);
  backward_dq<T, HD>(dqkv, delta, out != nullptr, dout, qkv, lse, B, Tn, C, NH, scale, dropout,
                     overwrite, stream);
  backward_dkdv<T, HD>(dqkv, delta, dout, qkv, lse, B, Tn, C, NH, scale, dropout, overwrite,
                       stream);
}

/// The backward with dq fused into the dk/dv kernel (FuseDq, head size 64; delta from the
/// forward's output, which it needs): delta, then one pass over the scores adding each key
/// block's dq into dq_accum (B*T*C floats of scratch, zeroed here) with float atomics, then
/// dq_accum rounded into dqkv. kernel_bench times it beside backward(); it is no launcher's
/// default, since dq's last bits vary run to run with the atomics' order.
template <class T, int HD>
void backward_fused_dq(T* dqkv, float* delta, float* dq_accum, const T* dout, const T* qkv,
                       const T* out, const float* lse, int B, int Tn, int C, int NH, float scale,
                       const cpu::DropoutMask& dropout, bool overwrite, cudaStream_t stream) {
  static_assert(HD == 64, "backward_fused_dq: head size 64");
  const std::int64_t rows = static_cast<std::int64_t>(B) * Tn;
  ZERO_CUDA_CHECK(
      cudaMemsetAsync(dq_accum, 0, static_cast<std::size_t>(rows * C) * sizeof(float), stream));
  backward_delta<T, HD>(delta, out, dout, B, Tn, NH, stream);
  const dim3 grid = grid_of(B, Tn, NH);
  with_dropout(dropout, [&](auto dropping) {
    launch(backward_dkdv_kernel<T, HD, decltype(dropping)::value, true>, grid,
           dkdv_shared_bytes<T, HD, true>(), stream, dqkv, dout, qkv, lse,
           static_cast<const float*>(delta), Tn, C, NH, scale, dropout, overwrite, dq_accum);
  });
  const std::int64_t n = rows * C / pack_size<T>;
  finish_dq_kernel<T><<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      dqkv, dq_accum, rows, C, overwrite);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mma
}  // namespace zero::ops::cuda
