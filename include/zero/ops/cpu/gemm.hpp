#pragma once
// Row-major GEMM for host kernels: CBLAS (OpenBLAS) for f32/f64 when zero::blas is linked,
// a row-parallel loop otherwise. C = alpha * op(A) * op(B) + beta * C.
// bf16/f16 operands: the product accumulates in float and C is rounded to the storage type once.
// bf16 uses OpenBLAS's cblas_sbgemm (bf16 A and B, float C) when the loaded OpenBLAS exports it
// (cblas.h always declares it, but builds without BUILD_BFLOAT16, Debian 12's among them, lack
// the symbol, so it is looked up at run time) and a run-time check on exact integer data shows it
// agrees with sgemm; otherwise, and for f16, A and B are widened to float and go through the f32
// path.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#include <dlfcn.h>

#include <cstring>
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

#if defined(ZERO_WITH_BLAS)
/// The type of OpenBLAS's cblas_sbgemm.
using SbgemmFn = decltype(&cblas_sbgemm);

namespace detail {

// cblas_sbgemm from the loaded libraries, or null where the OpenBLAS build lacks it.
inline SbgemmFn find_sbgemm() {
  void* symbol = dlsym(RTLD_DEFAULT, "cblas_sbgemm");
  SbgemmFn fn = nullptr;
  static_assert(sizeof fn == sizeof symbol);
  std::memcpy(&fn, &symbol, sizeof fn);  // object to function pointer without a cast warning
  return fn;
}

}  // namespace detail

/// Whether sbgemm computes what sgemm computes on widened inputs. The data are bf16 small
/// integers, so every product and partial sum is an exact float and a correct sbgemm must equal
/// sgemm exactly. Covers the four transposes, padded leading dimensions, alpha != 1, beta = 1 and
/// more than one kernel tile in every dimension.
inline bool check_sbgemm(SbgemmFn sbgemm) {
  const int M = 70, N = 37, K = 45, pad = 3;
  for (Trans ta : {Trans::no, Trans::yes}) {
    for (Trans tb : {Trans::no, Trans::yes}) {
      const int lda = (ta == Trans::no ? K : M) + pad, ldb = (tb == Trans::no ? N : K) + pad;
      const int rows_a = ta == Trans::no ? M : K, rows_b = tb == Trans::no ? K : N;
      std::vector<bf16> a16(static_cast<std::size_t>(rows_a * lda));
      std::vector<bf16> b16(static_cast<std::size_t>(rows_b * ldb));
      std::vector<float> a32(a16.size()), b32(b16.size());
      for (std::size_t i = 0; i < a16.size(); ++i) {
        a32[i] = static_cast<float>(static_cast<int>((i * 7 + 3) % 17) - 8);
        a16[i] = bf16(a32[i]);
      }
      for (std::size_t i = 0; i < b16.size(); ++i) {
        b32[i] = static_cast<float>(static_cast<int>((i * 5 + 1) % 13) - 6);
        b16[i] = bf16(b32[i]);
      }
      std::vector<float> c16(static_cast<std::size_t>(M * N)), c32(c16.size());
      for (std::size_t i = 0; i < c16.size(); ++i) c16[i] = c32[i] = static_cast<float>(i % 11);
      const auto op_a = ta == Trans::yes ? CblasTrans : CblasNoTrans;
      const auto op_b = tb == Trans::yes ? CblasTrans : CblasNoTrans;
      sbgemm(CblasRowMajor, op_a, op_b, M, N, K, 0.5f,
             reinterpret_cast<const bfloat16*>(a16.data()), lda,
             reinterpret_cast<const bfloat16*>(b16.data()), ldb, 1.0f, c16.data(), N);
      cblas_sgemm(CblasRowMajor, op_a, op_b, M, N, K, 0.5f, a32.data(), lda, b32.data(), ldb, 1.0f,
                  c32.data(), N);
      if (c16 != c32) return false;
    }
  }
  return true;
}

/// The cblas_sbgemm bf16 GEMM uses, or null: null when the loaded OpenBLAS does not export it or
/// when check_sbgemm finds it wrong (some builds compute sbgemm wrongly on some CPUs); bf16 GEMM
/// then widens to float and calls sgemm. Looked up and checked once per process.
inline SbgemmFn usable_sbgemm() {
  static const SbgemmFn fn = [] {  // a fact about the loaded library, computed once
    const SbgemmFn found = detail::find_sbgemm();
    if (found == nullptr) return SbgemmFn{nullptr};
    if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
    return check_sbgemm(found) ? found : SbgemmFn{nullptr};
  }();
  return fn;
}

/// True when bf16 GEMM runs on cblas_sbgemm.
inline bool sbgemm_usable() {
  return usable_sbgemm() != nullptr;
}
#endif

/// The kernel behind gemm<T> for a half type: "sbgemm", "widen+sgemm" or "widen+loop".
template <class T>
const char* half_gemm_path() {
#if defined(ZERO_WITH_BLAS)
  if constexpr (std::is_same_v<T, bf16>) {
    if (sbgemm_usable()) return "sbgemm";
  }
  return "widen+sgemm";
#else
  return "widen+loop";
#endif
}

template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          compute_type_t<T> alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
          compute_type_t<T> beta, T* C, std::int64_t ldc);

namespace detail {

#if defined(ZERO_WITH_BLAS)
/// The determinism rule of every BLAS path: op(A)'s rows are split into fixed blocks of
/// gemm_row_block, each multiplied by single-threaded BLAS inside parallel_for, so the result
/// does not depend on the thread count. fn(first row, rows, A at that row of op(A)).
template <class T, class Fn>
void for_each_row_block(Trans ta, std::int64_t M, const T* A, std::int64_t lda, Fn&& fn) {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
  const std::int64_t blocks = (M + gemm_row_block - 1) / gemm_row_block;
  parallel_for(blocks, [&](std::int64_t blk) {
    const std::int64_t m0 = blk * gemm_row_block;
    const int rows = static_cast<int>(std::min(gemm_row_block, M - m0));
    fn(m0, rows, ta == Trans::no ? A + m0 * lda : A + m0);
  });
}
#endif

// Widens the [rows, cols] matrix at src (leading dimension ld) to float with the same layout.
template <class T>
std::unique_ptr<float[]> widen_matrix(const T* src, std::int64_t rows, std::int64_t cols,
                                      std::int64_t ld) {
  auto out = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(rows * ld));
  float* dst = out.get();
  parallel_for(rows, [&](std::int64_t r) {
    for (std::int64_t c = 0; c < cols; ++c) dst[r * ld + c] = load(src[r * ld + c]);
  });
  return out;
}

// Half-type GEMM: C32 = beta * C in float, C32 += alpha op(A) op(B) in float (sbgemm, or the
// f32 path on widened copies, both in the fixed 64-row blocks), then C = round(C32) once.
template <class T>
void gemm_half(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
               const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
               std::int64_t ldc) {
  auto c32 = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(M * N));
  float* acc = c32.get();
  parallel_for(M, [&](std::int64_t m) {
    for (std::int64_t n = 0; n < N; ++n) {
      acc[m * N + n] = beta == 0.0f ? 0.0f : beta * load(C[m * ldc + n]);
    }
  });
  bool done = false;
#if defined(ZERO_WITH_BLAS)
  if constexpr (std::is_same_v<T, bf16>) {
    if (const SbgemmFn sbgemm = usable_sbgemm(); sbgemm != nullptr) {
      const auto op_a = ta == Trans::yes ? CblasTrans : CblasNoTrans;
      const auto op_b = tb == Trans::yes ? CblasTrans : CblasNoTrans;
      for_each_row_block(ta, M, A, lda, [&](std::int64_t m0, int rows, const T* a) {
        sbgemm(CblasRowMajor, op_a, op_b, rows, static_cast<int>(N), static_cast<int>(K), alpha,
               reinterpret_cast<const bfloat16*>(a), static_cast<int>(lda),
               reinterpret_cast<const bfloat16*>(B), static_cast<int>(ldb), 1.0f, acc + m0 * N,
               static_cast<int>(N));
      });
      done = true;
    }
  }
#endif
  if (!done) {
    const auto a32 = widen_matrix(A, ta == Trans::no ? M : K, ta == Trans::no ? K : M, lda);
    const auto b32 = widen_matrix(B, tb == Trans::no ? K : N, tb == Trans::no ? N : K, ldb);
    gemm<float>(ta, tb, M, N, K, alpha, a32.get(), lda, b32.get(), ldb, 1.0f, acc, N);
  }
  parallel_for(M, [&](std::int64_t m) {
    for (std::int64_t n = 0; n < N; ++n) C[m * ldc + n] = store<T>(acc[m * N + n]);
  });
}

}  // namespace detail

/// C[M,N] = alpha*op(A)*op(B) + beta*C, row-major, with leading dimensions lda, ldb, ldc.
/// Bit-identical results for any number of threads.
/// Half types (bf16, f16): alpha and beta are float, the product accumulates in float.
template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          compute_type_t<T> alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
          compute_type_t<T> beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if constexpr (is_half_type<T>) {
    detail::gemm_half(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#if defined(ZERO_WITH_BLAS)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const auto op_a = ta == Trans::yes ? CblasTrans : CblasNoTrans;
    const auto op_b = tb == Trans::yes ? CblasTrans : CblasNoTrans;
    detail::for_each_row_block(ta, M, A, lda, [&](std::int64_t m0, int rows, const T* a) {
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
  if constexpr (!is_half_type<T>) {
    gemm_reference(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
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
