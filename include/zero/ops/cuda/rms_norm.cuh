#pragma once
// zero-requires: cuda
// RMSNorm on the GPU (Llama's), the twin of zero/ops/cpu/rms_norm.hpp:
//   out = x * rstd * weight,  rstd = 1 / sqrt(mean(x^2) + eps), saved per row (float);
//   dx += rstd * (w*dy - x * rstd^2 * mean_c(w*dy*x)),  dweight += sum_n x * rstd * dy.
// One warp per row: the lanes read the row (as 16-byte packs when it is a whole number of them
// and every pointer is aligned), a warp sum gives the row's sum of squares (forward) or of
// w*dy*x (backward), and the lanes write the row. The weight gradient is a deterministic column
// sum (column_sum.cuh), so it repeats bit for bit. Each element is computed in float with the
// host's operations, fused where the host's vector kernels fuse them ((x * rstd) * w; w*dy
// rounded, then fma(rstd, fma(-x, k, w*dy), dx)); the row sums and the weight gradient's column
// sums run in another order than the host's (and the column sums' products may be contracted
// into fused multiply-adds), so f32 agrees with the host within float rounding, not bit for bit.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/rms_norm.cuh needs nvcc; host-only code includes zero/ops/cpu/rms_norm.hpp"
#endif

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/column_sum.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// Rows per block of the warp-per-row kernels.
inline constexpr int rms_norm_warps = 8;

namespace rms_norm_detail {

/// Calls fn(c, value as float) for each element c of row x this lane reads (lanes 32 apart; as
/// whole 16-byte packs when Packed).
template <class T, bool Packed, class Fn>
__device__ __forceinline__ void for_lane_elements(const T* x, int C, int lane, Fn&& fn) {
  if constexpr (Packed) {
    constexpr int P = pack_size<T>;
    const auto* packs = reinterpret_cast<const Pack<T>*>(x);
    for (int i = lane; i < C / P; i += 32) {
      const Pack<T> p = packs[i];
#pragma unroll
      for (int j = 0; j < P; ++j) fn(i * P + j, load(p.v[j]));
    }
  } else {
    for (int c = lane; c < C; c += 32) fn(c, load(x[c]));
  }
}

/// out[c] = value(c, in[c] as float) rounded to T, for the elements of a row this lane takes
/// (the same lanes and packs as for_lane_elements).
template <class T, bool Packed, class Value>
__device__ __forceinline__ void write_lane_elements(T* out, const T* in, int C, int lane,
                                                    Value&& value) {
  if constexpr (Packed) {
    constexpr int P = pack_size<T>;
    const auto* src = reinterpret_cast<const Pack<T>*>(in);
    auto* dst = reinterpret_cast<Pack<T>*>(out);
    for (int i = lane; i < C / P; i += 32) {
      const Pack<T> p = src[i];
      Pack<T> r;
#pragma unroll
      for (int j = 0; j < P; ++j) r.v[j] = store<T>(value(i * P + j, load(p.v[j])));
      dst[i] = r;
    }
  } else {
    for (int c = lane; c < C; c += 32) out[c] = store<T>(value(c, load(in[c])));
  }
}

}  // namespace rms_norm_detail

/// Warp per row n: rstd[n] and out's row.
template <class T, bool Packed>
__global__ void __launch_bounds__(32 * rms_norm_warps)
    rms_norm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight, int N, int C,
                            float eps) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * rms_norm_warps + threadIdx.x / 32;
  if (n >= N) return;  // a whole warp leaves: the shuffles below see full warps only
  const T* x = inp + n * C;
  float ss = 0.0f;
  rms_norm_detail::for_lane_elements<T, Packed>(x, C, lane,
                                                [&](int, float v) { ss = fmaf(v, v, ss); });
  const float s = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(C) + eps);
  rms_norm_detail::write_lane_elements<T, Packed>(
      out + n * C, x, C, lane, [&](int c, float v) { return v * s * load(weight[c]); });
  if (lane == 0) rstd[n] = s;
}

/// Warp per row n: dinp's row += rstd * (w*dy - x * rstd^2 * mean(w*dy*x)).
template <class T, bool Packed>
__global__ void __launch_bounds__(32 * rms_norm_warps)
    rms_norm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                   const float* rstd, int N, int C) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * rms_norm_warps + threadIdx.x / 32;
  if (n >= N) return;
  const T* x = inp + n * C;
  const T* dy = dout + n * C;
  float dot = 0.0f;
  rms_norm_detail::for_lane_elements<T, Packed>(x, C, lane, [&](int c, float v) {
    dot = fmaf(__fmul_rn(load(weight[c]), load(dy[c])), v, dot);
  });
  const float s = rstd[n];
  const float k = s * s * warp_sum(dot) / static_cast<float>(C);
  T* dx = dinp + n * C;
  rms_norm_detail::write_lane_elements<T, Packed>(dx, dx, C, lane, [&](int c, float start) {
    const float wdy = __fmul_rn(load(weight[c]), load(dy[c]));
    return fmaf(s, fmaf(-load(x[c]), k, wdy), start);
  });
}

/// RMSNorm's weight-gradient term of row n, column c: x * rstd * dy.
template <class T>
struct RmsNormWeightTerm {
  const T* dout;
  const T* inp;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float (&v)[1]) const {
    const std::int64_t i = static_cast<std::int64_t>(n) * C + c;
    v[0] = load(inp[i]) * rstd[n] * load(dout[i]);
  }
};

// ---- launchers ----------------------------------------------------------------------------------

namespace rms_norm_detail {

/// Calls launch(std::bool_constant<Packed>) with Packed true when rows of C are whole 16-byte
/// packs and every pointer is aligned.
template <class T, class Launch>
void with_packing(std::int64_t C, std::initializer_list<const void*> pointers, Launch&& launch) {
  if (C % pack_size<T> == 0 && aligned16(pointers)) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

inline unsigned row_grid(std::int64_t N) {
  return static_cast<unsigned>((N + rms_norm_warps - 1) / rms_norm_warps);
}

}  // namespace rms_norm_detail

/// Normalises N rows of C; writes out [N, C] and rstd [N] (device pointers).
template <class T>
void rms_norm_forward(T* out, float* rstd, const T* inp, const T* weight, std::int64_t N,
                      std::int64_t C, float eps, cudaStream_t stream) {
  expect_int_range(N, "rms_norm_forward");
  expect_int_range(C, "rms_norm_forward");
  if (N == 0 || C == 0) return;
  rms_norm_detail::with_packing<T>(C, {out, inp, weight}, [&](auto packed) {
    rms_norm_forward_kernel<T, decltype(packed)::value>
        <<<rms_norm_detail::row_grid(N), 32 * rms_norm_warps, 0, stream>>>(
            out, rstd, inp, weight, static_cast<int>(N), static_cast<int>(C), eps);
  });
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// Accumulates dinp and dweight from dout, the input and the saved rstd.
template <class T>
void rms_norm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                       const float* rstd, std::int64_t N, std::int64_t C, cudaStream_t stream) {
  expect_int_range(N, "rms_norm_backward");
  expect_int_range(C, "rms_norm_backward");
  if (N == 0 || C == 0) return;
  rms_norm_detail::with_packing<T>(C, {dinp, dout, inp, weight}, [&](auto packed) {
    rms_norm_backward_input_kernel<T, decltype(packed)::value>
        <<<rms_norm_detail::row_grid(N), 32 * rms_norm_warps, 0, stream>>>(
            dinp, dout, inp, weight, rstd, static_cast<int>(N), static_cast<int>(C));
  });
  ZERO_CUDA_CHECK(cudaGetLastError());
  column_sums<T, 1>({{dweight}}, RmsNormWeightTerm<T>{dout, inp, rstd, static_cast<int>(C)}, N, C,
                    "rms_norm_backward", stream);
}

}  // namespace zero::ops::cuda
