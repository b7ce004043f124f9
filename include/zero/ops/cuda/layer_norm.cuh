#pragma once
// zero-requires: cuda
// LayerNorm over the last dimension on the GPU; the twin of zero/ops/cpu/layer_norm.hpp (eps
// 1e-5, biased variance, mean and rstd saved in float for the backward pass):
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
// Rows whose 16-byte packs fit 32 lanes' registers (C up to 2048 bf16 or 1024 float, C a whole
// number of packs, every row 16-byte aligned: GPT-2's rows) go one warp per row: the row is read
// from memory once, 16 bytes at a time, into registers, and the sums are warp shuffles. Other rows
// go one block per row, sums through cub::BlockReduce. Either way the mean comes first, then the
// centred variance, as the host does (no E[x^2] - E[x]^2 cancellation). The backward of such rows
// is one fused kernel: each block of 8 warps takes 32 rows, reads x and dy once for dinp and for
// its share of dweight and dbias, and leaves per-block partials that a second kernel adds in block
// order. Other rows take column_sums for the parameter gradients. Both reduce in a fixed order, so
// they are deterministic and need no atomics. dnorm = weight * dy is rounded before anything adds
// to it (__fmul_rn, not a product nvcc may contract into the next add), as the host rounds it:
// dnorm - mean(dnorm) is then exactly 0 at C = 1, where rstd is large. The input gradient is
// written as start + its value: start null (written without a read), dinp (added into) or another
// buffer, a residual's skip gradient (layer_norm_backward_from), which saves the copy of the skip
// gradient into dinp first. Reference: llm.c layernorm_forward/backward (dev/cuda/layernorm_*.cu).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/layer_norm.cuh needs nvcc; host-only code includes zero/ops/cpu/layer_norm.hpp"
#endif

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/column_sum.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

/// Threads per row of the LayerNorm row kernels.
inline constexpr int layer_norm_threads = 256;

// ---- kernels ------------------------------------------------------------------------------------

/// One block per row n: mean, centred variance, then the normalised row.
template <class T>
__global__ void __launch_bounds__(layer_norm_threads)
    layer_norm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                              const T* bias, int C, float eps) {
  const std::int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  float sum = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) sum += load(x[c]);
  const float m = block_all_reduce<layer_norm_threads>(sum, SumOp{}) / static_cast<float>(C);
  float sq = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = load(x[c]) - m;
    sq += d * d;
  }
  const float v = block_all_reduce<layer_norm_threads>(sq, SumOp{}) / static_cast<float>(C);
  const float s = 1.0f / sqrtf(v + eps);
  T* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    o[c] = store<T>((load(x[c]) - m) * s * load(weight[c]) + load(bias[c]));
  }
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

/// One block per row n: dinp[n] = start[n] + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) *
/// rstd, start null (dinp written, not read), dinp itself (added into) or another buffer (a
/// residual's skip gradient).
template <class T>
__global__ void __launch_bounds__(layer_norm_threads)
    layer_norm_backward_input_kernel(T* dinp, const T* start, const T* dout, const T* inp,
                                     const T* weight, const float* mean, const float* rstd, int C) {
  const std::int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  const T* dy = dout + n * C;
  const float m = mean[n], s = rstd[n];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(x[c]) - m) * s;
    const float dnorm = __fmul_rn(load(weight[c]), load(dy[c]));
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean =
      block_all_reduce<layer_norm_threads>(dnorm_sum, SumOp{}) / static_cast<float>(C);
  const float dnorm_norm_mean =
      block_all_reduce<layer_norm_threads>(dnorm_norm_sum, SumOp{}) / static_cast<float>(C);
  T* dx = dinp + n * C;
  const T* from = start != nullptr ? start + n * C : nullptr;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(x[c]) - m) * s;
    const float dnorm = __fmul_rn(load(weight[c]), load(dy[c]));
    const float g = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    dx[c] = store<T>(from == nullptr ? g : load(from[c]) + g);
  }
}

/// Rows per block of the warp-per-row kernels.
inline constexpr int layer_norm_warps = 4;

/// One warp per row n, the row in registers (Packs 16-byte packs per lane): mean, centred
/// variance, then the normalised row.
template <class T, int Packs>
__global__ void __launch_bounds__(32 * layer_norm_warps)
    layer_norm_forward_warp_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                                   const T* bias, int N, int C, float eps) {
  constexpr int P = pack_size<T>;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t n =
      static_cast<std::int64_t>(blockIdx.x) * layer_norm_warps + threadIdx.x / 32;
  if (n >= N) return;  // a whole warp leaves: the shuffles below see full warps only
  const int packs = C / P;
  const auto* x = reinterpret_cast<const Pack<T>*>(inp + n * C);
  float v[Packs][P];
  float sum = 0.0f;
  for_lane_packs<Packs>(lane, packs, [&](int k, int i) {
    const Pack<T> p = x[i];
#pragma unroll
    for (int j = 0; j < P; ++j) {
      v[k][j] = load(p.v[j]);
      sum += v[k][j];
    }
  });
  const float m = warp_sum(sum) / static_cast<float>(C);
  float sq = 0.0f;
  for_lane_packs<Packs>(lane, packs, [&](int k, int) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const float d = v[k][j] - m;
      sq += d * d;
    }
  });
  const float s = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + eps);
  const auto* w = reinterpret_cast<const Pack<T>*>(weight);
  const auto* b = reinterpret_cast<const Pack<T>*>(bias);
  auto* o = reinterpret_cast<Pack<T>*>(out + n * C);
  for_lane_packs<Packs>(lane, packs, [&](int k, int i) {
    const Pack<T> wp = w[i], bp = b[i];
    Pack<T> r;
#pragma unroll
    for (int j = 0; j < P; ++j)
      r.v[j] = store<T>((v[k][j] - m) * s * load(wp.v[j]) + load(bp.v[j]));
    o[i] = r;
  });
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

/// Warps per block and rows per block of the fused warp-per-row backward.
inline constexpr int layer_norm_backward_warps = 8;
inline constexpr int layer_norm_backward_rows = 32;

/// The fused backward's shared sums hold element j of a row's pack i at word j * stride + i:
/// stride is the least count >= packs that is 32 / P more than a multiple of 32 (P elements a
/// pack). The row loop's lanes take consecutive packs at one j (consecutive words); the column
/// loop's 32 threads take 32 consecutive columns, 32 / P packs' P elements, at banks i + (32 / P)
/// j, all different (with stride = packs, a multiple of 32 at C = 768 in bf16, the 8 elements of a
/// pack fell in one bank).
template <class T>
__host__ __device__ constexpr int layer_norm_sum_stride(int packs) {
  constexpr int skew = 32 / pack_size<T>;
  return skew + (packs - skew + 31) / 32 * 32;
}

/// True when layer_norm_sum_stride keeps every 32 consecutive columns of rows of packs in distinct
/// banks (checked below for every row a warp takes).
template <class T>
constexpr bool layer_norm_sums_conflict_free(int packs) {
  constexpr int P = pack_size<T>;
  const int stride = layer_norm_sum_stride<T>(packs);
  if (stride < packs) return false;
  for (int c0 = 0; c0 < packs * P; c0 += 32) {
    unsigned banks = 0;
    for (int c = c0; c < c0 + 32; ++c) banks |= 1u << (((c % P) * stride + c / P) % 32);
    if (banks != 0xffffffffu) return false;
  }
  return true;
}

template <class T>
constexpr bool layer_norm_sums_conflict_free_up_to(int max_packs) {
  for (int packs = 1; packs <= max_packs; ++packs) {
    if (!layer_norm_sums_conflict_free<T>(packs)) return false;
  }
  return true;
}
static_assert(layer_norm_sums_conflict_free_up_to<bf16>(256) &&
              layer_norm_sums_conflict_free_up_to<float>(256));

/// Shared memory of the fused backward: each warp's parameter-gradient sums, 2 P stride floats a
/// warp (2 C and the padding).
template <class T>
std::size_t layer_norm_backward_shared_bytes(std::int64_t C) {
  const auto packs = static_cast<int>(C / pack_size<T>);
  return static_cast<std::size_t>(layer_norm_backward_warps) * 2 * pack_size<T> *
         static_cast<std::size_t>(layer_norm_sum_stride<T>(packs)) * sizeof(float);
}

/// The fused backward of the rows [32 b, 32 b + 32) of block b, one warp per row (warp w takes
/// rows w, w + 8, ...), the row's x and dy in registers: dinp[n] = start[n] + (dnorm - mean(dnorm)
/// - norm * mean(dnorm * norm)) * rstd (start as layer_norm_backward_input_kernel's), and the
/// block's parameter-gradient sums into partials [2][blocks][C] (norm * dy, then dy). Each warp
/// adds its rows' terms, in row order, into its own slice of shared memory (warp_sums
/// [warps][2][P stride], element j of pack i at j * stride + i, layer_norm_sum_stride);
/// then each column's warp sums are added in warp order. Kept in registers, those sums took 194
/// registers a thread at C = 768 in bf16 (one block of 8 warps an SM); in shared memory the warps
/// of several blocks hide each other's loads. The partials go to
/// column_sum_detail::finish_column_sums, so the whole is deterministic.
template <class T, int Packs>
__global__ void __launch_bounds__(32 * layer_norm_backward_warps,
                                  Packs <= 2 ? 3 : (Packs == 4 ? 2 : 1))
    layer_norm_backward_warp_kernel(T* dinp, float* partials, const T* start, const T* dout,
                                    const T* inp, const T* weight, const float* mean,
                                    const float* rstd, int N, int C) {
  constexpr int P = pack_size<T>;
  extern __shared__ float warp_sums[];  // [warps][2][P stride]
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int packs = C / P;
  const int stride = layer_norm_sum_stride<T>(packs);
  const int sums = P * stride;  // a warp's dweight sums, then as many of dbias
  const auto* w = reinterpret_cast<const Pack<T>*>(weight);
  float* dweight = warp_sums + static_cast<std::int64_t>(warp) * 2 * sums;
  float* dbias = dweight + sums;
  for_lane_packs<Packs>(lane, packs, [&](int, int i) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      dweight[j * stride + i] = 0.0f;
      dbias[j * stride + i] = 0.0f;
    }
  });
  // Rows in 64 bits: N may come within a block's rows of 2^31.
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * layer_norm_backward_rows;
  const std::int64_t last = min(static_cast<std::int64_t>(N), first + layer_norm_backward_rows);
  for (std::int64_t row = first + warp; row < last; row += layer_norm_backward_warps) {
    const int n = static_cast<int>(row);
    const auto* x = reinterpret_cast<const Pack<T>*>(inp + static_cast<std::int64_t>(n) * C);
    const auto* dy = reinterpret_cast<const Pack<T>*>(dout + static_cast<std::int64_t>(n) * C);
    const float m = mean[n], s = rstd[n];
    auto* dx = reinterpret_cast<Pack<T>*>(dinp + static_cast<std::int64_t>(n) * C);
    const auto* from =
        start != nullptr
            ? reinterpret_cast<const Pack<T>*>(start + static_cast<std::int64_t>(n) * C)
            : nullptr;
    Pack<T> xs[Packs], dys[Packs], dxs[Packs];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for_lane_packs<Packs>(lane, packs, [&](int k, int i) {
      xs[k] = x[i];
      dys[k] = dy[i];
      if (from != nullptr) dxs[k] = from[i];  // read with x and dy: one round trip per row
    });
    for_lane_packs<Packs>(lane, packs, [&](int k, int i) {
      const Pack<T> wp = w[i];
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const float norm = (load(xs[k].v[j]) - m) * s;
        const float g = load(dys[k].v[j]);
        const float dnorm = __fmul_rn(load(wp.v[j]), g);
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * norm;
        dweight[j * stride + i] += norm * g;
        dbias[j * stride + i] += g;
      }
    });
    const float dnorm_mean = warp_sum(dnorm_sum) / static_cast<float>(C);
    const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / static_cast<float>(C);
    for_lane_packs<Packs>(lane, packs, [&](int k, int i) {
      const Pack<T> wp = w[i];
      Pack<T> r;  // dxs[k] is read (and was loaded) only when starting from something
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const float norm = (load(xs[k].v[j]) - m) * s;
        const float dnorm = __fmul_rn(load(wp.v[j]), load(dys[k].v[j]));
        const float g = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        r.v[j] = store<T>(from == nullptr ? g : load(dxs[k].v[j]) + g);
      }
      dx[i] = r;
    });
  }
  __syncthreads();
  const std::int64_t chunks = gridDim.x;
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const int slot = (c % P) * stride + c / P;
    float dw = 0.0f, db = 0.0f;
    for (int v = 0; v < layer_norm_backward_warps; ++v) {
      dw += warp_sums[static_cast<std::int64_t>(v) * 2 * sums + slot];
      db += warp_sums[static_cast<std::int64_t>(v) * 2 * sums + sums + slot];
    }
    partials[static_cast<std::int64_t>(blockIdx.x) * C + c] = dw;
    partials[(chunks + blockIdx.x) * C + c] = db;
  }
}

/// Packs per lane the warp-per-row kernels need for rows of C (1, 2, 4 or 8), or 0 when the rows
/// go one block per row: C not a whole number of packs, a pointer not 16-byte aligned, or a row
/// over 8 packs per lane.
template <class T>
int layer_norm_lane_packs(std::int64_t C, std::initializer_list<const void*> pointers) {
  if (C % pack_size<T> != 0 || !aligned16(pointers)) return 0;
  return lane_packs_for(C / pack_size<T>, 32);
}

/// LayerNorm's parameter-gradient terms of row n, column c: (x - mean) rstd dy and dy.
template <class T>
struct LayerNormParamTerms {
  const T* dout;
  const T* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float (&v)[2]) const {
    const std::int64_t i = static_cast<std::int64_t>(n) * C + c;
    const float dy = load(dout[i]);
    v[0] = (load(inp[i]) - mean[n]) * rstd[n] * dy;
    v[1] = dy;
  }
};

// ---- launchers ----------------------------------------------------------------------------------

/// Normalises N rows of C; writes out [N, C], mean [N], rstd [N] (device pointers).
template <class T>
void layer_norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                        const T* bias, std::int64_t N, std::int64_t C, float eps,
                        cudaStream_t stream) {
  expect_int_range(N, "layer_norm_forward");
  expect_int_range(C, "layer_norm_forward");
  if (N == 0) return;
  const auto rows = static_cast<int>(N);
  const auto cols = static_cast<int>(C);
  const auto warp_grid = static_cast<unsigned>((N + layer_norm_warps - 1) / layer_norm_warps);
  const bool warp_rows =
      with_lane_packs(layer_norm_lane_packs<T>(C, {out, inp, weight, bias}), [&](auto packs) {
        layer_norm_forward_warp_kernel<T, decltype(packs)::value>
            <<<warp_grid, 32 * layer_norm_warps, 0, stream>>>(out, mean, rstd, inp, weight, bias,
                                                              rows, cols, eps);
      });
  if (!warp_rows) {
    layer_norm_forward_kernel<T><<<static_cast<unsigned>(N), layer_norm_threads, 0, stream>>>(
        out, mean, rstd, inp, weight, bias, cols, eps);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// layer_norm_forward with the host's default eps 1e-5.
template <class T>
void layer_norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                        const T* bias, std::int64_t N, std::int64_t C, cudaStream_t stream) {
  layer_norm_forward(out, mean, rstd, inp, weight, bias, N, C, 1e-5f, stream);
}

/// dinp = start + LayerNorm's input gradient (start: null to write dinp without reading it, dinp
/// to add into it, or another [N, C] buffer, such as a residual's skip gradient, which may not
/// overlap dinp otherwise); dweight, dbias accumulated; from dout and the saved mean/rstd.
template <class T>
void layer_norm_backward_from(T* dinp, const T* start, T* dweight, T* dbias, const T* dout,
                              const T* inp, const T* weight, const float* mean, const float* rstd,
                              std::int64_t N, std::int64_t C, cudaStream_t stream) {
  expect_int_range(N, "layer_norm_backward");
  expect_int_range(C, "layer_norm_backward");
  if (N == 0 || C == 0) return;
  const auto rows = static_cast<int>(N);
  const auto cols = static_cast<int>(C);
  const std::int64_t chunks = (N + layer_norm_backward_rows - 1) / layer_norm_backward_rows;
  const std::size_t shared = layer_norm_backward_shared_bytes<T>(C);
  // The fused kernel's sums need shared memory by row width: the default 48 KiB holds rows up
  // to C = 544 in bf16 (GPT-2's 768 takes 50 KiB), the widest a warp takes (2048 in bf16)
  // 130 KiB, which sm_80 (163) and sm_90 (227) allow and sm_86/sm_89 (99) do not: there the
  // rows go to the block-per-row kernels.
  const int packs = shared > shared_bytes_optin()
                        ? 0
                        : layer_norm_lane_packs<T>(
                              C, {dinp, start != nullptr ? static_cast<const void*>(start) : dinp,
                                  dout, inp, weight});
  if (packs != 0) {
    // Fused: one read of x and dy for all three gradients.
    DeviceScratch partials(static_cast<std::size_t>(2 * chunks * C) * sizeof(float), stream);
    with_lane_packs(packs, [&](auto lane_packs) {
      const auto kernel = layer_norm_backward_warp_kernel<T, decltype(lane_packs)::value>;
      if (shared > 48 * 1024) {
        ZERO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared)));
      }
      kernel<<<static_cast<unsigned>(chunks), 32 * layer_norm_backward_warps, shared, stream>>>(
          dinp, partials.as<float>(), start, dout, inp, weight, mean, rstd, rows, cols);
    });
    ZERO_CUDA_CHECK(cudaGetLastError());
    column_sum_detail::finish_column_sums<T, 2>({{dweight, dbias}}, partials.as<float>(), chunks, C,
                                                stream);
    return;
  }
  layer_norm_backward_input_kernel<T><<<static_cast<unsigned>(N), layer_norm_threads, 0, stream>>>(
      dinp, start, dout, inp, weight, mean, rstd, cols);
  ZERO_CUDA_CHECK(cudaGetLastError());
  column_sums<T, 2>({{dweight, dbias}},
                    LayerNormParamTerms<T>{dout, inp, mean, rstd, static_cast<int>(C)}, N, C,
                    "layer_norm_backward", stream);
}

/// Accumulates dinp (writes it, without reading it, when overwrite_dinp), dweight, dbias from
/// dout and the saved mean/rstd.
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const float* mean, const float* rstd, std::int64_t N,
                         std::int64_t C, bool overwrite_dinp, cudaStream_t stream) {
  layer_norm_backward_from<T>(dinp, overwrite_dinp ? nullptr : dinp, dweight, dbias, dout, inp,
                              weight, mean, rstd, N, C, stream);
}

/// Accumulates dinp, dweight, dbias from dout and the saved mean/rstd.
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const float* mean, const float* rstd, std::int64_t N,
                         std::int64_t C, cudaStream_t stream) {
  layer_norm_backward<T>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, false, stream);
}

}  // namespace zero::ops::cuda
