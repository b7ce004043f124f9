#pragma once
// Row-major GEMM for host kernels: CBLAS (OpenBLAS) for f32/f64 when zero::blas is linked,
// a row-parallel loop otherwise. C = alpha * op(A) * op(B) + beta * C.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <zero/ops/cpu/parallel_for.hpp>

#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#endif

namespace zero::ops::cpu {

/// Whether an operand is used as stored or transposed.
enum class Trans : bool { no = false, yes = true };

/// The loop GEMM used without BLAS (and as the test reference): C[M,N] = alpha*op(A)*op(B) +
/// beta*C with op(A) of shape [M,K] and op(B) of shape [K,N]; rows of C are independent.
template <class T>
void gemm_reference(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
                    const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                    std::int64_t ldc) {
  parallel_for(M, [&](std::int64_t m) {
    T* c = C + m * ldc;
    for (std::int64_t n = 0; n < N; ++n) c[n] = beta == T(0) ? T(0) : beta * c[n];
    for (std::int64_t k = 0; k < K; ++k) {
      const T a = alpha * (ta == Trans::no ? A[m * lda + k] : A[k * lda + m]);
      if (tb == Trans::no) {
        const T* b = B + k * ldb;
        for (std::int64_t n = 0; n < N; ++n) c[n] += a * b[n];
      } else {
        for (std::int64_t n = 0; n < N; ++n) c[n] += a * B[n * ldb + k];
      }
    }
  });
}

/// Rows of C each BLAS call computes. The split is fixed, never derived from the thread count,
/// and OpenBLAS runs single-threaded inside each block: OpenBLAS's own threading changes its
/// kernel path (and so the rounding) with the thread count, this split does not.
inline constexpr std::int64_t gemm_row_block = 64;

/// C[M,N] = alpha*op(A)*op(B) + beta*C, row-major, with leading dimensions lda, ldb, ldc.
/// Bit-identical results for any number of threads.
template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
#if defined(ZERO_WITH_BLAS)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
    const auto op_a = ta == Trans::yes ? CblasTrans : CblasNoTrans;
    const auto op_b = tb == Trans::yes ? CblasTrans : CblasNoTrans;
    const std::int64_t blocks = (M + gemm_row_block - 1) / gemm_row_block;
    parallel_for(blocks, [&](std::int64_t blk) {
      const std::int64_t m0 = blk * gemm_row_block;
      const int rows = static_cast<int>(std::min(gemm_row_block, M - m0));
      const T* a = ta == Trans::no ? A + m0 * lda : A + m0;  // rows of op(A)
      T* c = C + m0 * ldc;
      if constexpr (std::is_same_v<T, float>) {
        cblas_sgemm(CblasRowMajor, op_a, op_b, rows, static_cast<int>(N), static_cast<int>(K),
                    alpha, a, static_cast<int>(lda), B, static_cast<int>(ldb), beta, c,
                    static_cast<int>(ldc));
      } else {
        cblas_dgemm(CblasRowMajor, op_a, op_b, rows, static_cast<int>(N), static_cast<int>(K),
                    alpha, a, static_cast<int>(lda), B, static_cast<int>(ldb), beta, c,
                    static_cast<int>(ldc));
      }
    });
    return;
  }
#endif
  gemm_reference(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/// True when gemm runs on a BLAS library rather than the loop fallback.
constexpr bool gemm_uses_blas() {
#if defined(ZERO_WITH_BLAS)
  return true;
#else
  return false;
#endif
}

}  // namespace zero::ops::cpu
