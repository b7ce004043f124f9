#pragma once
// zero-requires: cuda
// Flash-style causal multi-head attention on the GPU; the device twin of
// zero/ops/cpu/attention.hpp on the same packed qkv [B, T, 3C] layout (head h in channels
// [h*hs, (h+1)*hs) of q, k and v) and the same dropout mask on the probabilities. Instead of the
// host's att [B, NH, T, T] the forward saves the log-sum-exp per row, lse [B, NH, T] (float), and
// the backward recomputes the probabilities from it: p[t, t2] = exp(q_t.k_t2 * scale - lse[t]).
//
// Forward (online softmax, Dao et al., "FlashAttention", 2022): a block holds 8 query rows of one
// (b, h), one warp per row; key/value tiles of 32 rows go through shared memory as float (bf16
// and f16 are widened on load, all arithmetic is float). In a tile lane j scores key j, the warp
// finds the tile maximum, rescales its running sum and output, and adds p_j * v_j with lane d
// owning output channels d, d + 32, ...; keys after the row (causal) and past T are masked.
//
// Backward (no atomics, so deterministic): delta[t] = sum_t2 p * dp is the host's
// sum_j att[j] dp[j] (computed from the probabilities here; the tensor-core kernels take it from
// dout . out instead when the caller passes the forward's output, see attention_mma.cuh), then
//   dq kernel:   warp per query row, over key tiles: ds = p (dp - delta) scale, dq += ds k
//   dkdv kernel: warp per key row, over query tiles: dv += dropout(p) dout, dk += ds q
// Each gradient element is owned by one lane, which adds into dqkv (+=, rounded once), or writes
// it when the caller asks (overwrite_dqkv: dqkv not read, no zeroing first).
//
// These kernels use CUDA cores: they serve f32 and the head sizes the tensor-core kernels do not
// take. bf16 and f16 at head size 64 or 128 (16-byte aligned pointers) run attention_mma.cuh's
// mma.sync kernels behind the same launchers, with the same contracts.
// Any head size up to 128: the kernels are compiled for capacities HD = 32, 64 and 128 (the
// template parameter), and a smaller head is padded with zero channels in shared memory, which
// add exact zeros to every dot product; larger heads throw ShapeError.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/attention.cuh needs nvcc; host-only code includes zero/ops/cpu/attention.hpp"
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/error.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cuda/attention_mma.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

using cpu::DropoutMask;

/// Query (forward, dq) or key (dkdv) rows per block: one warp each.
inline constexpr int flash_rows = 8;

/// How the tensor-core backward at head size 64, given the forward's output, takes dq:
/// ZERO_ATTENTION_BACKWARD unset, empty or "two_kernels" (a dq kernel and a dk/dv kernel: every
/// element one lane's, the same bits run to run; the default), or "fused_dq"
/// (mma::backward_fused_dq: dq in the dk/dv kernel with float atomics, FlashAttention-2's
/// backward, dq's last bits varying run to run); anything else a ConfigError naming the value.
/// Read at each call; nn::CudaKernels also reads it when it is made, so an engine refuses a bad
/// value before its first step.
inline bool attention_backward_fuses_dq() {
  const char* value = std::getenv("ZERO_ATTENTION_BACKWARD");
  const std::string_view v = value != nullptr ? value : "";
  if (v.empty() || v == "two_kernels") return false;
  expect<ConfigError>(v == "fused_dq", "ZERO_ATTENTION_BACKWARD=", v,
                      ": expected \"two_kernels\" (the default) or \"fused_dq\"");
  return true;
}
/// Rows of the tile streamed through shared memory: one per lane.
inline constexpr int flash_tile = 32;

namespace detail {

/// Dot product of two float rows of length HD in shared memory.
template <int HD>
__device__ __forceinline__ float dot_row(const float* a, const float* b) {
  float sum = 0.0f;
#pragma unroll 16
  for (int d = 0; d < HD; ++d) sum += a[d] * b[d];
  return sum;
}

/// Loads rows [first, first + count) of one head of hs channels (base points at the head's q, k
/// or v in row 0 of qkv, row_stride 3C; or into a [B, T, C] tensor, row_stride C) into
/// dst[count][ld] as float, HD >= hs wide; rows past Tn and channels from hs on become zero.
template <class T, int HD>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* base,
                                          std::int64_t row_stride, int first, int count, int Tn,
                                          int hs) {
  for (int i = threadIdx.x; i < count * HD; i += blockDim.x) {
    const int r = i / HD, d = i % HD, row = first + r;
    dst[r * ld + d] = row < Tn && d < hs ? load(base[row * row_stride + d]) : 0.0f;
  }
}

}  // namespace detail

// ---- forward ------------------------------------------------------------------------------------

/// Block (blockIdx.x: 8 query rows, blockIdx.y: b * NH + h): out rows and their lse.
template <class T, int HD>
__global__ void __launch_bounds__(flash_rows * 32)
    flash_attention_forward_kernel(T* out, float* lse, const T* qkv, int Tn, int C, int NH, int hs,
                                   float scale, DropoutMask dropout) {
  constexpr int per_lane = HD / 32;
  __shared__ float q_s[flash_rows][HD];
  __shared__ float k_s[flash_tile][HD + 1];  // +1: lane j reads row j without bank conflicts
  __shared__ float v_s[flash_tile][HD + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int t0 = blockIdx.x * flash_rows, t = t0 + warp;
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * hs;
  detail::load_rows<T, HD>(&q_s[0][0], HD, head, stride, t0, flash_rows, Tn, hs);
  const bool dropping = dropout.active();
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;

  float m = -INFINITY, l = 0.0f, acc[per_lane];
#pragma unroll
  for (int r = 0; r < per_lane; ++r) acc[r] = 0.0f;
  const int last = min(t0 + flash_rows, Tn) - 1;  // the block's last query row
  for (int k0 = 0; k0 <= last; k0 += flash_tile) {
    __syncthreads();  // the previous tile is consumed (and q_s is loaded)
    detail::load_rows<T, HD>(&k_s[0][0], HD + 1, head + C, stride, k0, flash_tile, Tn, hs);
    detail::load_rows<T, HD>(&v_s[0][0], HD + 1, head + 2 * C, stride, k0, flash_tile, Tn, hs);
    __syncthreads();
    if (t < Tn && k0 <= t) {  // uniform over the warp: shuffles see all 32 lanes
      const int key = k0 + lane;
      const bool visible = key <= t;  // key <= t < Tn
      const float s = visible ? detail::dot_row<HD>(q_s[warp], k_s[lane]) * scale : -INFINITY;
      const float m_new = fmaxf(m, warp_max(s));  // finite: key k0 <= t is visible
      const float p = visible ? expf(s - m_new) : 0.0f;
      const float correction = expf(m - m_new);  // 0 on the first tile (m = -inf)
      l = l * correction + warp_sum(p);
      float p_used = p;
      if (dropping && visible) {
        p_used = p * DropoutMask::factor(dropout.keep(detail::attention_entry(bh, t, key, Tn)),
                                         drop_scale);
      }
#pragma unroll
      for (int r = 0; r < per_lane; ++r) acc[r] *= correction;
      for (int j = 0; j < flash_tile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p_used, j);
#pragma unroll
        for (int r = 0; r < per_lane; ++r) acc[r] += pj * v_s[j][lane + 32 * r];
      }
      m = m_new;
    }
  }
  if (t < Tn) {
    const float inv = 1.0f / l;
    T* o = out + (static_cast<std::int64_t>(b) * Tn + t) * C + h * hs;
#pragma unroll
    for (int r = 0; r < per_lane; ++r) {
      if (lane + 32 * r < hs) o[lane + 32 * r] = store<T>(acc[r] * inv);
    }
    if (lane == 0) lse[static_cast<std::int64_t>(bh) * Tn + t] = m + logf(l);
  }
}

// ---- backward -----------------------------------------------------------------------------------

/// Warp per query row t: delta[t] = sum_t2 p dp, then dq_t += sum_t2 ds k_t2 into dqkv (=, dqkv
/// not read, when overwrite).
template <class T, int HD>
__global__ void __launch_bounds__(flash_rows * 32)
    flash_attention_backward_dq_kernel(T* dqkv, float* delta, const T* dout, const T* qkv,
                                       const float* lse, int Tn, int C, int NH, int hs, float scale,
                                       DropoutMask dropout, bool overwrite) {
  constexpr int per_lane = HD / 32;
  __shared__ float q_s[flash_rows][HD];
  __shared__ float do_s[flash_rows][HD];
  __shared__ float k_s[flash_tile][HD + 1];
  __shared__ float v_s[flash_tile][HD + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int t0 = blockIdx.x * flash_rows, t = t0 + warp;
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * hs;
  const T* dout_head = dout + static_cast<std::int64_t>(b) * Tn * C + h * hs;
  detail::load_rows<T, HD>(&q_s[0][0], HD, head, stride, t0, flash_rows, Tn, hs);
  detail::load_rows<T, HD>(&do_s[0][0], HD, dout_head, C, t0, flash_rows, Tn, hs);
  const bool dropping = dropout.active();
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;
  const float lse_t = t < Tn ? lse[static_cast<std::int64_t>(bh) * Tn + t] : 0.0f;
  const int last = min(t0 + flash_rows, Tn) - 1;

  // p and dp (the probability's gradient through the dropout mask) of key k0 + lane.
  auto probability = [&](int key, float& p, float& dp) {
    const float s = detail::dot_row<HD>(q_s[warp], k_s[key % flash_tile]) * scale;
    p = expf(s - lse_t);
    const float d = detail::dot_row<HD>(do_s[warp], v_s[key % flash_tile]);
    dp = !dropping ? d
                   : d * DropoutMask::factor(dropout.keep(detail::attention_entry(bh, t, key, Tn)),
                                             drop_scale);
  };

  float delta_part = 0.0f;
  for (int k0 = 0; k0 <= last; k0 += flash_tile) {  // pass 1: delta
    __syncthreads();
    detail::load_rows<T, HD>(&k_s[0][0], HD + 1, head + C, stride, k0, flash_tile, Tn, hs);
    detail::load_rows<T, HD>(&v_s[0][0], HD + 1, head + 2 * C, stride, k0, flash_tile, Tn, hs);
    __syncthreads();
    const int key = k0 + lane;
    if (t < Tn && key <= t) {
      float p, dp;
      probability(key, p, dp);
      delta_part += p * dp;
    }
  }
  const float delta_t = warp_sum(delta_part);

  float dq[per_lane];
#pragma unroll
  for (int r = 0; r < per_lane; ++r) dq[r] = 0.0f;
  for (int k0 = 0; k0 <= last; k0 += flash_tile) {  // pass 2: dq
    __syncthreads();
    detail::load_rows<T, HD>(&k_s[0][0], HD + 1, head + C, stride, k0, flash_tile, Tn, hs);
    detail::load_rows<T, HD>(&v_s[0][0], HD + 1, head + 2 * C, stride, k0, flash_tile, Tn, hs);
    __syncthreads();
    if (t < Tn && k0 <= t) {
      const int key = k0 + lane;
      float ds = 0.0f;
      if (key <= t) {
        float p, dp;
        probability(key, p, dp);
        ds = p * (dp - delta_t) * scale;
      }
      for (int j = 0; j < flash_tile; ++j) {
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
        for (int r = 0; r < per_lane; ++r) dq[r] += dsj * k_s[j][lane + 32 * r];
      }
    }
  }
  if (t < Tn) {
    T* g = dqkv + (static_cast<std::int64_t>(b) * Tn + t) * stride + h * hs;
#pragma unroll
    for (int r = 0; r < per_lane; ++r) {
      if (lane + 32 * r < hs) {
        g[lane + 32 * r] = store<T>(overwrite ? dq[r] : load(g[lane + 32 * r]) + dq[r]);
      }
    }
    if (lane == 0) delta[static_cast<std::int64_t>(bh) * Tn + t] = delta_t;
  }
}

/// Warp per key row j: over the query tiles from j's on, dv_j += dropout(p) dout_t and
/// dk_j += ds q_t, into dqkv (=, dqkv not read, when overwrite).
template <class T, int HD>
__global__ void __launch_bounds__(flash_rows * 32)
    flash_attention_backward_dkdv_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                                         const float* delta, int Tn, int C, int NH, int hs,
                                         float scale, DropoutMask dropout, bool overwrite) {
  constexpr int per_lane = HD / 32;
  __shared__ float k_s[flash_rows][HD];
  __shared__ float v_s[flash_rows][HD];
  __shared__ float q_s[flash_tile][HD + 1];
  __shared__ float do_s[flash_tile][HD + 1];
  __shared__ float lse_s[flash_tile];
  __shared__ float delta_s[flash_tile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int j0 = blockIdx.x * flash_rows, j = j0 + warp;
  const std::int64_t stride = 3LL * C;
  const T* head = qkv + static_cast<std::int64_t>(b) * Tn * stride + h * hs;
  const T* dout_head = dout + static_cast<std::int64_t>(b) * Tn * C + h * hs;
  const float* lse_head = lse + static_cast<std::int64_t>(bh) * Tn;
  const float* delta_head = delta + static_cast<std::int64_t>(bh) * Tn;
  detail::load_rows<T, HD>(&k_s[0][0], HD, head + C, stride, j0, flash_rows, Tn, hs);
  detail::load_rows<T, HD>(&v_s[0][0], HD, head + 2 * C, stride, j0, flash_rows, Tn, hs);
  const bool dropping = dropout.active();
  const float drop_scale = dropping ? dropout.scale<float>() : 1.0f;

  float dk[per_lane], dv[per_lane];
#pragma unroll
  for (int r = 0; r < per_lane; ++r) dk[r] = dv[r] = 0.0f;
  for (int q0 = j0 - j0 % flash_tile; q0 < Tn; q0 += flash_tile) {
    __syncthreads();
    detail::load_rows<T, HD>(&q_s[0][0], HD + 1, head, stride, q0, flash_tile, Tn, hs);
    detail::load_rows<T, HD>(&do_s[0][0], HD + 1, dout_head, C, q0, flash_tile, Tn, hs);
    if (threadIdx.x < flash_tile) {
      const int row = q0 + threadIdx.x;
      lse_s[threadIdx.x] = row < Tn ? lse_head[row] : 0.0f;
      delta_s[threadIdx.x] = row < Tn ? delta_head[row] : 0.0f;
    }
    __syncthreads();
    if (j < Tn) {  // uniform over the warp
      const int query = q0 + lane;
      float p_used = 0.0f, ds = 0.0f;
      if (query < Tn && query >= j) {
        const float s = detail::dot_row<HD>(q_s[lane], k_s[warp]) * scale;
        const float p = expf(s - lse_s[lane]);
        const float d = detail::dot_row<HD>(do_s[lane], v_s[warp]);
        const bool kept = !dropping || dropout.keep(detail::attention_entry(bh, query, j, Tn));
        const float factor = DropoutMask::factor(kept, drop_scale);
        p_used = !dropping ? p : p * factor;
        const float dp = !dropping ? d : d * factor;
        ds = p * (dp - delta_s[lane]) * scale;
      }
      for (int i = 0; i < flash_tile; ++i) {
        const float pi = __shfl_sync(0xffffffffu, p_used, i);
        const float dsi = __shfl_sync(0xffffffffu, ds, i);
#pragma unroll
        for (int r = 0; r < per_lane; ++r) {
          dv[r] += pi * do_s[i][lane + 32 * r];
          dk[r] += dsi * q_s[i][lane + 32 * r];
        }
      }
    }
  }
  if (j < Tn) {
    T* g = dqkv + (static_cast<std::int64_t>(b) * Tn + j) * stride + h * hs;
#pragma unroll
    for (int r = 0; r < per_lane; ++r) {
      const int d = lane + 32 * r;
      if (d >= hs) continue;
      g[C + d] = store<T>(overwrite ? dk[r] : load(g[C + d]) + dk[r]);
      g[2 * C + d] = store<T>(overwrite ? dv[r] : load(g[2 * C + d]) + dv[r]);
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------

namespace detail {

/// Checks the shapes the flash kernels take and returns the head size.
inline int flash_head_size(std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                           const char* op) {
  expect<ShapeError>(NH > 0 && C % NH == 0, op, ": channels C=", C,
                     " must split evenly over NH=", NH, " heads");
  const std::int64_t hs = C / NH;
  expect<ShapeError>(hs >= 1 && hs <= 128, op, ": head size ", hs,
                     " is not supported (the flash kernels take up to 128)");
  expect_int_range(B * NH, op);  // the tensor-core kernels' gridDim.x (up to 2^31 - 1)
  expect_int_range(Tn, op);      // rows are ints in the kernels; element offsets are 64-bit
  expect_int_range(3 * C, op);
  return static_cast<int>(hs);
}

/// The CUDA-core flash kernels' grid: x the tile of flash_rows rows, y the head (B*NH, at most
/// 65535 there).
inline dim3 flash_grid(std::int64_t B, std::int64_t Tn, std::int64_t NH, const char* op) {
  expect<ShapeError>(B * NH <= 65535, op, ": B*NH = ", B * NH,
                     " exceeds the CUDA-core kernels' 65535 blocks in y (the tensor-core kernels, "
                     "bf16/f16 with head size 64 or 128, take more)");
  return dim3(static_cast<unsigned>((Tn + flash_rows - 1) / flash_rows),
              static_cast<unsigned>(B * NH));
}

/// Calls launch(std::integral_constant<int, HD>) with the smallest kernel capacity HD (32, 64
/// or 128) that holds a head of hs channels.
template <class Launch>
void with_head_capacity(int hs, Launch&& launch) {
  if (hs <= 32) {
    launch(std::integral_constant<int, 32>{});
  } else if (hs <= 64) {
    launch(std::integral_constant<int, 64>{});
  } else {
    launch(std::integral_constant<int, 128>{});
  }
}

}  // namespace detail

/// Writes out [B, T, C] and lse [B, NH, T] (float) from qkv [B, T, 3C]; dropout (off by default)
/// applies to the probabilities multiplying v with the host's mask. Device pointers.
template <class T>
void attention_forward(T* out, float* lse, const T* qkv, std::int64_t B, std::int64_t Tn,
                       std::int64_t C, std::int64_t NH, const DropoutMask& dropout,
                       cudaStream_t stream) {
  if (B == 0 || Tn == 0) return;
  const int hs = detail::flash_head_size(B, Tn, C, NH, "attention_forward");
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int Ti = static_cast<int>(Tn), Ci = static_cast<int>(C), NHi = static_cast<int>(NH);
  if (mma::takes<T>(hs, {out, qkv})) {  // bf16/f16, head size 64 or 128: tensor cores
    if (hs == 64) {
      mma::forward<T, 64>(out, lse, qkv, static_cast<int>(B), Ti, Ci, NHi, scale, dropout, stream);
    } else {
      mma::forward<T, 128>(out, lse, qkv, static_cast<int>(B), Ti, Ci, NHi, scale, dropout, stream);
    }
    return;
  }
  const dim3 grid = detail::flash_grid(B, Tn, NH, "attention_forward");
  detail::with_head_capacity(hs, [&](auto capacity) {
    flash_attention_forward_kernel<T, decltype(capacity)::value>
        <<<grid, flash_rows * 32, 0, stream>>>(out, lse, qkv, Ti, Ci, NHi, hs, scale, dropout);
  });
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// attention_forward without dropout.
template <class T>
void attention_forward(T* out, float* lse, const T* qkv, std::int64_t B, std::int64_t Tn,
                       std::int64_t C, std::int64_t NH, cudaStream_t stream) {
  attention_forward(out, lse, qkv, B, Tn, C, NH, DropoutMask{}, stream);
}

/// Accumulates dqkv [B, T, 3C] (writes it, without reading it, when overwrite_dqkv) from dout
/// [B, T, C], the forward input qkv, its output out (may be null) and its lse; dropout must be
/// the forward's mask. Uses B*NH*T floats of stream-ordered scratch. Given out, the tensor-core
/// kernels take delta = rowsum(dout * out) from a small kernel instead of a first pass over the
/// keys (attention_mma.cuh); the CUDA-core kernels always make that pass. Every element of dqkv
/// is one lane's, so writing gives the values of adding into zeros (a zero's sign aside), unless
/// ZERO_ATTENTION_BACKWARD=fused_dq (attention_backward_fuses_dq) has dq taken with atomics.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                        std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                        const DropoutMask& dropout, bool overwrite_dqkv, cudaStream_t stream) {
  // Read first, so a bad value is an error whichever kernels the call takes.
  const bool fuse_dq = attention_backward_fuses_dq();
  if (B == 0 || Tn == 0) return;
  const int hs = detail::flash_head_size(B, Tn, C, NH, "attention_backward");
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // The CUDA-core kernels' grid, checked before the scratch below is allocated.
  const bool tensor_cores = mma::takes<T>(hs, {dqkv, dout, qkv, out});
  const dim3 grid = tensor_cores ? dim3() : detail::flash_grid(B, Tn, NH, "attention_backward");
  if (tensor_cores)
    (void)mma::grid_of(static_cast<int>(B), static_cast<int>(Tn), static_cast<int>(NH));
  DeviceScratch delta(static_cast<std::size_t>(B * NH * Tn) * sizeof(float), stream);
  const int Ti = static_cast<int>(Tn), Ci = static_cast<int>(C), NHi = static_cast<int>(NH);
  float* d = delta.as<float>();
  if (tensor_cores) {  // bf16/f16, head 64 or 128
    const int Bi = static_cast<int>(B);
    if (hs == 64 && out != nullptr && fuse_dq) {
      DeviceScratch dq(static_cast<std::size_t>(B * Tn * C) * sizeof(float), stream);
      mma::backward_fused_dq<T, 64>(dqkv, d, dq.as<float>(), dout, qkv, out, lse, Bi, Ti, Ci, NHi,
                                    scale, dropout, overwrite_dqkv, stream);
    } else if (hs == 64) {
      mma::backward<T, 64>(dqkv, d, dout, qkv, out, lse, Bi, Ti, Ci, NHi, scale, dropout,
                           overwrite_dqkv, stream);
    } else {
      mma::backward<T, 128>(dqkv, d, dout, qkv, out, lse, Bi, Ti, Ci, NHi, scale, dropout,
                            overwrite_dqkv, stream);
    }
    return;
  }
  detail::with_head_capacity(hs, [&](auto capacity) {
    constexpr int HD = decltype(capacity)::value;
    flash_attention_backward_dq_kernel<T, HD><<<grid, flash_rows * 32, 0, stream>>>(
        dqkv, d, dout, qkv, lse, Ti, Ci, NHi, hs, scale, dropout, overwrite_dqkv);
    ZERO_CUDA_CHECK(cudaGetLastError());
    flash_attention_backward_dkdv_kernel<T, HD><<<grid, flash_rows * 32, 0, stream>>>(
        dqkv, dout, qkv, lse, d, Ti, Ci, NHi, hs, scale, dropout, overwrite_dqkv);
  });
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// attention_backward accumulating into dqkv.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                        std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                        const DropoutMask& dropout, cudaStream_t stream) {
  attention_backward<T>(dqkv, dout, qkv, out, lse, B, Tn, C, NH, dropout, false, stream);
}

/// attention_backward without the forward's output: delta from the probabilities.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const float* lse, std::int64_t B,
                        std::int64_t Tn, std::int64_t C, std::int64_t NH,
                        const DropoutMask& dropout, cudaStream_t stream) {
  attention_backward<T>(dqkv, dout, qkv, nullptr, lse, B, Tn, C, NH, dropout, stream);
}

/// attention_backward without dropout.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const float* lse, std::int64_t B,
                        std::int64_t Tn, std::int64_t C, std::int64_t NH, cudaStream_t stream) {
  attention_backward<T>(dqkv, dout, qkv, nullptr, lse, B, Tn, C, NH, DropoutMask{}, stream);
}

}  // namespace zero::ops::cuda
