#pragma once
// zero-requires: cuda
// The plain causal attention on the GPU: cuBLAS strided-batched GEMMs around a causal softmax
// kernel, materialising att [B, NH, T, T] exactly as the host's cpu::attention_forward saves it.
// It is the reference the flash kernels (attention.cuh) are measured against in
// benchmarks/cuda/kernel_bench, and a second device implementation for the tests.
//   permute qkv [B, T, 3, NH, hs] -> q, k, v [B, NH, T, hs]
//   att = softmax_causal(q k^T * scale)           (cublasGemmStridedBatchedEx + a row kernel)
//   y = att v, out = unpermute(y)                 [B, T, C]
// Backward from the saved att: datt = dy v^T, dv = att^T dy, dpre = att (datt - rowsum(att datt))
// * scale, dq = dpre k, dk = dpre^T q, all accumulated into dqkv. No dropout (p must be 0).
// Intermediates (q, k, v, att, datt) are stored in T: for bf16 they round where the flash
// kernels keep float, so the reference is looser than the flash path in bf16.
// Reference: llm.c attention_forward/backward (train_gpt2.cu before its cuDNN path).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/attention_reference.cuh needs nvcc; host-only code includes zero/ops/cpu/attention.hpp"
#endif

#include <cmath>
#include <cstdint>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/error.hpp>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/gemm.cuh>

namespace zero::ops::cuda {

/// Threads per row of the reference path's softmax kernels.
inline constexpr int reference_softmax_threads = 256;

// ---- kernels ------------------------------------------------------------------------------------

/// q, k, v [B, NH, T, hs] from qkv [B, T, 3C]; one thread per element of q.
template <class T>
__global__ void attention_permute_kernel(T* q, T* k, T* v, const T* qkv, int B, int Tn, int NH,
                                         int hs) {
  const std::int64_t total = static_cast<std::int64_t>(B) * NH * Tn * hs;
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = e % hs, t = (e / hs) % Tn, h = (e / hs / Tn) % NH, b = e / hs / Tn / NH;
    const std::int64_t src = (b * Tn + t) * 3 * C + h * hs + d;
    q[e] = qkv[src];
    k[e] = qkv[src + C];
    v[e] = qkv[src + 2 * C];
  }
}

/// dy [B, NH, T, hs] from dout [B, T, C].
template <class T>
__global__ void attention_permute_grad_kernel(T* dy, const T* dout, int B, int Tn, int NH, int hs) {
  const std::int64_t total = static_cast<std::int64_t>(B) * NH * Tn * hs;
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = e % hs, t = (e / hs) % Tn, h = (e / hs / Tn) % NH, b = e / hs / Tn / NH;
    dy[e] = dout[(b * Tn + t) * C + h * hs + d];
  }
}

/// out [B, T, C] = y [B, NH, T, hs] unpermuted (accumulate: out += y, rounded once).
template <class T, bool Accumulate>
__global__ void attention_unpermute_kernel(T* out, std::int64_t out_row_stride, const T* y, int B,
                                           int Tn, int NH, int hs) {
  const std::int64_t total = static_cast<std::int64_t>(B) * NH * Tn * hs;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = e % hs, t = (e / hs) % Tn, h = (e / hs / Tn) % NH, b = e / hs / Tn / NH;
    T& o = out[(b * Tn + t) * out_row_stride + h * hs + d];
    o = Accumulate ? store<T>(load(o) + load(y[e])) : y[e];
  }
}

/// One block per row (bh, t) of att, in place: the host's causal softmax (max, sum of exp, scale
/// by 1/sum) over t2 <= t, zeros above the diagonal.
template <class T>
__global__ void __launch_bounds__(reference_softmax_threads) causal_softmax_kernel(T* att, int Tn) {
  const int t = blockIdx.x % Tn;
  T* row = att + static_cast<std::int64_t>(blockIdx.x) * Tn;
  float m = -INFINITY;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) m = fmaxf(m, load(row[t2]));
  const float maxval = block_all_reduce<reference_softmax_threads>(m, MaxOp{});
  float s = 0.0f;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) s += expf(load(row[t2]) - maxval);
  const float inv = 1.0f / block_all_reduce<reference_softmax_threads>(s, SumOp{});
  for (int t2 = threadIdx.x; t2 < Tn; t2 += blockDim.x) {
    row[t2] = store<T>(t2 <= t ? expf(load(row[t2]) - maxval) * inv : 0.0f);
  }
}

/// One block per row (bh, t), in place on datt: dpre = att (datt - sum(att datt)) * scale for
/// t2 <= t, zero above the diagonal.
template <class T>
__global__ void __launch_bounds__(reference_softmax_threads)
    causal_softmax_backward_kernel(T* datt, const T* att, int Tn, float scale) {
  const int t = blockIdx.x % Tn;
  const std::int64_t offset = static_cast<std::int64_t>(blockIdx.x) * Tn;
  float part = 0.0f;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
    part += load(att[offset + t2]) * load(datt[offset + t2]);
  }
  const float dot = block_all_reduce<reference_softmax_threads>(part, SumOp{});
  for (int t2 = threadIdx.x; t2 < Tn; t2 += blockDim.x) {
    const float g =
        t2 <= t ? load(att[offset + t2]) * (load(datt[offset + t2]) - dot) * scale : 0.0f;
    datt[offset + t2] = store<T>(g);
  }
}

// ---- batched GEMM -------------------------------------------------------------------------------

/// Row-major C_i = alpha op(A_i) op(B_i) + beta C_i for batch matrices at fixed strides, f32
/// accumulation (cuBLAS strided batched, operands swapped as in gemm.cuh).
template <class T>
void batched_gemm(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N,
                  std::int64_t K, float alpha, const T* A, std::int64_t lda, std::int64_t stride_a,
                  const T* B, std::int64_t ldb, std::int64_t stride_b, float beta, T* C,
                  std::int64_t ldc, std::int64_t stride_c, std::int64_t batch,
                  cudaStream_t stream) {
  constexpr cudaDataType_t type = cuda_data_type<T>();
  ZERO_CUBLAS_CHECK(cublasSetStream(ctx.blas(), stream));
  ZERO_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      ctx.blas(), tb == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N,
      ta == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
      static_cast<int>(K), &alpha, B, type, static_cast<int>(ldb), stride_b, A, type,
      static_cast<int>(lda), stride_a, &beta, C, type, static_cast<int>(ldc), stride_c,
      static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// ---- launchers ----------------------------------------------------------------------------------

namespace detail {

/// Checks the reference path's shapes and returns the head size.
inline std::int64_t reference_head_size(std::int64_t B, std::int64_t Tn, std::int64_t C,
                                        std::int64_t NH, const char* op) {
  expect<ShapeError>(NH > 0 && C % NH == 0, op, ": channels C=", C,
                     " must split evenly over NH=", NH, " heads");
  expect_int_range(B * NH * Tn, op);  // softmax rows are blocks
  expect_int_range(Tn, op);
  expect_int_range(C, op);
  return C / NH;
}

}  // namespace detail

/// Writes out [B, T, C] and att [B, NH, T, T] (the host's saved probabilities) from qkv;
/// uses 4*B*T*C elements of stream-ordered scratch.
template <class T>
void attention_forward_reference(GemmContext& ctx, T* out, T* att, const T* qkv, std::int64_t B,
                                 std::int64_t Tn, std::int64_t C, std::int64_t NH,
                                 cudaStream_t stream) {
  if (B == 0 || Tn == 0) return;
  const std::int64_t hs = detail::reference_head_size(B, Tn, C, NH, "attention_forward_reference");
  const std::int64_t n = B * Tn * C;
  DeviceScratch scratch(4 * static_cast<std::size_t>(n) * sizeof(T), stream);
  T* q = scratch.as<T>();
  T *k = q + n, *v = k + n, *y = v + n;
  const int Bi = static_cast<int>(B), Ti = static_cast<int>(Tn), NHi = static_cast<int>(NH),
            hsi = static_cast<int>(hs);
  attention_permute_kernel<T>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(q, k, v, qkv, Bi, Ti, NHi, hsi);
  ZERO_CUDA_CHECK(cudaGetLastError());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  batched_gemm<T>(ctx, Trans::no, Trans::yes, Tn, Tn, hs, scale, q, hs, Tn * hs, k, hs, Tn * hs,
                  0.0f, att, Tn, Tn * Tn, B * NH, stream);
  causal_softmax_kernel<T>
      <<<static_cast<unsigned>(B * NH * Tn), reference_softmax_threads, 0, stream>>>(att, Ti);
  ZERO_CUDA_CHECK(cudaGetLastError());
  batched_gemm<T>(ctx, Trans::no, Trans::no, Tn, hs, Tn, 1.0f, att, Tn, Tn * Tn, v, hs, Tn * hs,
                  0.0f, y, hs, Tn * hs, B * NH, stream);
  attention_unpermute_kernel<T, false>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(out, C, y, Bi, Ti, NHi, hsi);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// Accumulates dqkv [B, T, 3C] from dout, qkv and the saved att; uses 7*B*T*C + B*NH*T*T
/// elements of stream-ordered scratch.
template <class T>
void attention_backward_reference(GemmContext& ctx, T* dqkv, const T* dout, const T* qkv,
                                  const T* att, std::int64_t B, std::int64_t Tn, std::int64_t C,
                                  std::int64_t NH, cudaStream_t stream) {
  if (B == 0 || Tn == 0) return;
  const std::int64_t hs = detail::reference_head_size(B, Tn, C, NH, "attention_backward_reference");
  const std::int64_t n = B * Tn * C, nt = B * NH * Tn * Tn;
  DeviceScratch scratch(
      (7 * static_cast<std::size_t>(n) + static_cast<std::size_t>(nt)) * sizeof(T), stream);
  T* q = scratch.as<T>();
  T *k = q + n, *v = k + n, *dy = v + n, *dq = dy + n, *dk = dq + n, *dv = dk + n, *datt = dv + n;
  const int Bi = static_cast<int>(B), Ti = static_cast<int>(Tn), NHi = static_cast<int>(NH),
            hsi = static_cast<int>(hs);
  attention_permute_kernel<T>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(q, k, v, qkv, Bi, Ti, NHi, hsi);
  ZERO_CUDA_CHECK(cudaGetLastError());
  attention_permute_grad_kernel<T>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(dy, dout, Bi, Ti, NHi, hsi);
  ZERO_CUDA_CHECK(cudaGetLastError());
  const std::int64_t sh = Tn * hs, st = Tn * Tn, batch = B * NH;
  // datt = dy v^T; dv = att^T dy
  batched_gemm<T>(ctx, Trans::no, Trans::yes, Tn, Tn, hs, 1.0f, dy, hs, sh, v, hs, sh, 0.0f, datt,
                  Tn, st, batch, stream);
  batched_gemm<T>(ctx, Trans::yes, Trans::no, Tn, hs, Tn, 1.0f, att, Tn, st, dy, hs, sh, 0.0f, dv,
                  hs, sh, batch, stream);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  causal_softmax_backward_kernel<T>
      <<<static_cast<unsigned>(batch * Tn), reference_softmax_threads, 0, stream>>>(datt, att, Ti,
                                                                                    scale);
  ZERO_CUDA_CHECK(cudaGetLastError());
  // dq = dpre k; dk = dpre^T q
  batched_gemm<T>(ctx, Trans::no, Trans::no, Tn, hs, Tn, 1.0f, datt, Tn, st, k, hs, sh, 0.0f, dq,
                  hs, sh, batch, stream);
  batched_gemm<T>(ctx, Trans::yes, Trans::no, Tn, hs, Tn, 1.0f, datt, Tn, st, q, hs, sh, 0.0f, dk,
                  hs, sh, batch, stream);
  const std::int64_t row = 3 * C;
  attention_unpermute_kernel<T, true>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(dqkv, row, dq, Bi, Ti, NHi, hsi);
  attention_unpermute_kernel<T, true>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(dqkv + C, row, dk, Bi, Ti, NHi, hsi);
  attention_unpermute_kernel<T, true>
      <<<grid_for(n), elementwise_threads, 0, stream>>>(dqkv + 2 * C, row, dv, Bi, Ti, NHi, hsi);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
