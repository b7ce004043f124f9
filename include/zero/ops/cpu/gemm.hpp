#pragma once
// Row-major GEMM for host kernels, C = alpha * op(A) * op(B) + beta * C, in fixed tiles (the
// determinism rule, for_each_tile). Each path below is used only when a run-time check on exact
// integer data (check_gemm_kernel) finds it equal to the float GEMM.
// f32: oneDNN's matmul when zero::dnnl is linked (dnnl_gemm.hpp; faster than OpenBLAS's sgemm on
// the CPUs measured), else CBLAS (OpenBLAS) when zero::blas is linked, else a row-parallel loop;
// float_gemm_path() says which. f64: CBLAS, else the loop.
// bf16/f16 operands: the product accumulates in float and C is rounded to the storage type once.
// bf16 takes the first usable of: oneDNN's matmul (AMX or AVX512-BF16 where the CPU has them),
// OpenBLAS's cblas_sbgemm when the loaded OpenBLAS exports it (cblas.h always declares it, but
// builds without BUILD_BFLOAT16, Debian 12's among them, lack the symbol, so it is looked up at
// run time); otherwise, and for f16, A and B are widened to float and go through the f32 path.
// half_gemm_path<T>() says which.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

// oneDNN's headers are host code that nvcc's front end does not parse (an internal error), so
// a CUDA translation unit that includes this header (ops/cuda/gemm.cuh does, for Trans) sees the
// other bf16 paths only.
#if defined(ZERO_WITH_DNNL) && !defined(__CUDACC__)
#define ZERO_OPS_CPU_DNNL 1
#include <zero/ops/cpu/dnnl_gemm.hpp>
#endif

#if defined(ZERO_WITH_BLAS)
#include <cblas.h>
#include <dlfcn.h>

#include <cstring>
#endif

namespace zero::ops::cpu {

/// Whether an operand is used as stored or transposed.
enum class Trans : bool { no = false, yes = true };

/// True when zero::blas (CBLAS) is linked: f64 GEMM, and f32 where oneDNN is not usable, run on
/// it rather than the loop fallback.
constexpr bool gemm_uses_blas() {
#if defined(ZERO_WITH_BLAS)
  return true;
#else
  return false;
#endif
}

/// Makes BLAS single-threaded: call it before a parallel region whose iterations call
/// gemm_serial (the OpenMP threads are the only ones, and the result does not depend on them).
inline void blas_single_threaded() {
#if defined(ZERO_WITH_BLAS)
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
#endif
}

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

/// The fixed split of C into the tiles single-threaded BLAS calls compute: C is cut along its
/// longer side (rows when M >= N, else columns) into an even number of equal blocks (one block
/// when the side is under 2 gemm_min_block) of at least gemm_min_block, at most gemm_max_tiles,
/// each a multiple of 16. The split depends on the shape only, never on the thread count:
/// OpenBLAS's own threading changes its kernel path (and so the rounding) with the thread count,
/// this split does not. Cutting the longer side keeps the other operand whole in every call; a
/// call repacks that whole operand, which costs about 18 / side of the call's time whatever
/// the other sizes (the former fixed 64-row blocks lost a third of the GEMM time to it), hence
/// the minimum. An even count keeps 2 and 4 threads evenly loaded.
struct GemmTiles {
  bool by_rows = true;     ///< the tiles are row blocks (else column blocks)
  std::int64_t size = 0;   ///< rows (or columns) per tile; the last may be shorter
  std::int64_t count = 0;  ///< number of tiles
};

/// Smallest side of a tile (see GemmTiles).
inline constexpr std::int64_t gemm_min_block = 256;
/// Most tiles of one GEMM.
inline constexpr std::int64_t gemm_max_tiles = 32;

/// The tiles of an M x N result (see GemmTiles).
inline GemmTiles gemm_tiles(std::int64_t M, std::int64_t N) {
  GemmTiles tiles;
  tiles.by_rows = M >= N;
  const std::int64_t side = tiles.by_rows ? M : N;
  std::int64_t blocks = std::clamp<std::int64_t>(side / gemm_min_block, 1, gemm_max_tiles);
  if (blocks > 1) blocks -= blocks % 2;
  tiles.size = ((side + blocks - 1) / blocks + 15) / 16 * 16;
  tiles.count = (side + tiles.size - 1) / tiles.size;
  return tiles;
}

/// One f32 or f64 GEMM on the calling thread, C = alpha op(A) op(B) + beta C: a single BLAS
/// call, or the loop without BLAS. For kernels that parallelise over independent products
/// themselves (attention over its heads), after blas_single_threaded().
template <class T>
void gemm_serial(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
                 const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                 std::int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "gemm_serial multiplies float or double");
  if (M == 0 || N == 0) return;
#if defined(ZERO_WITH_BLAS)
  const auto op_a = ta == Trans::yes ? CblasTrans : CblasNoTrans;
  const auto op_b = tb == Trans::yes ? CblasTrans : CblasNoTrans;
  const auto m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, op_a, op_b, m, n, k, alpha, A, static_cast<int>(lda), B,
                static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, op_a, op_b, m, n, k, alpha, A, static_cast<int>(lda), B,
                static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
  }
#else
  gemm_reference(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

namespace detail {

// Small-integer operands of an M x N x K product for each of the four transposes, with padded
// leading dimensions: check(ta, tb, a, a32, lda, b, b32, ldb) gets them in T and in float and
// returns whether the kernel it tries agrees; true when every case does. Every product and
// partial sum of such data is an exact float, so a correct kernel equals the float GEMM exactly
// whatever its order of summation.
template <class T, class Check>
bool all_exact_gemm_cases(int M, int N, int K, Check&& check) {
  const int pad = 3;
  for (Trans ta : {Trans::no, Trans::yes}) {
    for (Trans tb : {Trans::no, Trans::yes}) {
      const int lda = (ta == Trans::no ? K : M) + pad, ldb = (tb == Trans::no ? N : K) + pad;
      const int rows_a = ta == Trans::no ? M : K, rows_b = tb == Trans::no ? K : N;
      std::vector<T> a(static_cast<std::size_t>(rows_a * lda));
      std::vector<T> b(static_cast<std::size_t>(rows_b * ldb));
      std::vector<float> a32(a.size()), b32(b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        a32[i] = static_cast<float>(static_cast<int>((i * 7 + 3) % 17) - 8);
        a[i] = T(a32[i]);
      }
      for (std::size_t i = 0; i < b.size(); ++i) {
        b32[i] = static_cast<float>(static_cast<int>((i * 5 + 1) % 13) - 6);
        b[i] = T(b32[i]);
      }
      if (!check(ta, tb, a.data(), a32.data(), lda, b.data(), b32.data(), ldb)) return false;
    }
  }
  return true;
}

}  // namespace detail

/// Whether a library GEMM kernel on T operands (float or bf16) computes what gemm_serial<float>
/// computes on the same values in float. accumulate(ta, tb, M, N, K, alpha, A, lda, B, ldb, C,
/// ldc) must add alpha op(A) op(B) to the float C. On small integers (all_exact_gemm_cases) a
/// correct kernel must equal the float GEMM exactly. Covers the four transposes, padded leading
/// dimensions, alpha != 1, accumulation into a nonzero C and more than one kernel tile in every
/// dimension.
template <class T, class Accumulate>
bool check_gemm_kernel(Accumulate&& accumulate) {
  const int M = 70, N = 37, K = 45;
  return detail::all_exact_gemm_cases<T>(
      M, N, K,
      [&](Trans ta, Trans tb, const T* a, const float* a32, int lda, const T* b, const float* b32,
          int ldb) {
        std::vector<float> c(static_cast<std::size_t>(M * N)), c32(c.size());
        for (std::size_t i = 0; i < c.size(); ++i) c[i] = c32[i] = static_cast<float>(i % 11);
        accumulate(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, c.data(), N);
        gemm_serial<float>(ta, tb, M, N, K, 0.5f, a32, lda, b32, ldb, 1.0f, c32.data(), N);
        return c == c32;
      });
}

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

// C += alpha op(A) op(B) through sbgemm.
inline void sbgemm_accumulate(SbgemmFn sbgemm, Trans ta, Trans tb, int M, int N, int K, float alpha,
                              const bf16* A, int lda, const bf16* B, int ldb, float* C, int ldc) {
  sbgemm(CblasRowMajor, ta == Trans::yes ? CblasTrans : CblasNoTrans,
         tb == Trans::yes ? CblasTrans : CblasNoTrans, M, N, K, alpha,
         reinterpret_cast<const bfloat16*>(A), lda, reinterpret_cast<const bfloat16*>(B), ldb, 1.0f,
         C, ldc);
}

}  // namespace detail

/// Whether sbgemm computes what sgemm computes on widened inputs (check_gemm_kernel).
inline bool check_sbgemm(SbgemmFn sbgemm) {
  return check_gemm_kernel<bf16>([&](Trans ta, Trans tb, int M, int N, int K, float alpha,
                                     const bf16* A, int lda, const bf16* B, int ldb, float* C,
                                     int ldc) {
    detail::sbgemm_accumulate(sbgemm, ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
  });
}

/// The cblas_sbgemm bf16 GEMM uses, or null: null when the loaded OpenBLAS does not export it or
/// when check_sbgemm finds it wrong (some builds compute sbgemm wrongly on some CPUs). Looked up
/// and checked once per process.
inline SbgemmFn usable_sbgemm() {
  static const SbgemmFn fn = [] {  // a fact about the loaded library, computed once
    const SbgemmFn found = detail::find_sbgemm();
    if (found == nullptr) return SbgemmFn{nullptr};
    blas_single_threaded();
    return check_sbgemm(found) ? found : SbgemmFn{nullptr};
  }();
  return fn;
}

/// True when cblas_sbgemm is usable (bf16 GEMM runs on it unless oneDNN is usable too).
inline bool sbgemm_usable() {
  return usable_sbgemm() != nullptr;
}
#endif

/// True when gemm<T> (T float or bf16) runs on oneDNN's matmul: zero::dnnl is linked, oneDNN can
/// run a matmul of T operands on this CPU, and check_gemm_kernel agrees. Decided once per process
/// and type.
template <class T>
bool onednn_gemm_usable() {
#if defined(ZERO_OPS_CPU_DNNL)
  static const bool usable = [] {  // a fact about the CPU and the library, computed once
    try {
      return check_gemm_kernel<T>([](Trans ta, Trans tb, int M, int N, int K, float alpha,
                                     const T* A, int lda, const T* B, int ldb, float* C, int ldc) {
        onednn_gemm<T>(ta == Trans::yes, tb == Trans::yes, M, N, K, alpha, A, lda, B, ldb, 1.0f, C,
                       ldc);
      });
    } catch (const dnnl::error&) {
      return false;  // no such matmul on this CPU: the other paths
    }
  }();
  return usable;
#else
  return false;
#endif
}

/// True when gemm_bias<float> adds the bias inside oneDNN's matmul (onednn_gemm_bias): gemm<float>
/// runs on oneDNN and, on small integers with a padded C, the bias primitive equals C filled
/// with the bias plus the float GEMM exactly, for the four transposes. Decided once per process.
inline bool onednn_gemm_bias_usable() {
#if defined(ZERO_OPS_CPU_DNNL)
  static const bool usable = [] {
    if (!onednn_gemm_usable<float>()) return false;
    try {
      const int M = 37, N = 29, K = 45, ldc = N + 3;
      std::vector<float> bias(static_cast<std::size_t>(N));
      for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(int(i % 9) - 4);
      return detail::all_exact_gemm_cases<float>(
          M, N, K,
          [&](Trans ta, Trans tb, const float* a, const float*, int lda, const float* b,
              const float*, int ldb) {
            std::vector<float> got(static_cast<std::size_t>(M * ldc), -7.0f), want = got;
            for (int m = 0; m < M; ++m) std::copy_n(bias.data(), N, want.data() + m * ldc);
            onednn_gemm_bias<float>(ta == Trans::yes, tb == Trans::yes, M, N, K, a, lda, b, ldb,
                                    bias.data(), got.data(), ldc);
            gemm_serial<float>(ta, tb, M, N, K, 1.0f, a, lda, b, ldb, 1.0f, want.data(), ldc);
            return got == want;  // padding included: it must stay untouched
          });
    } catch (const dnnl::error&) {
      return false;  // no bias matmul on this CPU: fill C with the bias, then accumulate
    }
  }();
  return usable;
#else
  return false;
#endif
}

/// The kernel behind gemm<float> (and the widened half types): "onednn", "sgemm" or "loop".
inline const char* float_gemm_path() {
  if (onednn_gemm_usable<float>()) return "onednn";
  return gemm_uses_blas() ? "sgemm" : "loop";
}

/// The kernel behind gemm<T> for a half type: "onednn", "sbgemm", or the float path on widened
/// copies: "widen+onednn", "widen+sgemm" or "widen+loop".
template <class T>
const char* half_gemm_path() {
  if constexpr (std::is_same_v<T, bf16>) {
    if (onednn_gemm_usable<bf16>()) return "onednn";
#if defined(ZERO_WITH_BLAS)
    if (sbgemm_usable()) return "sbgemm";
#endif
  }
  if (onednn_gemm_usable<float>()) return "widen+onednn";
  return gemm_uses_blas() ? "widen+sgemm" : "widen+loop";
}

template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          compute_type_t<T> alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
          compute_type_t<T> beta, T* C, std::int64_t ldc);

namespace detail {

/// The determinism rule of every library GEMM path: C is split into the fixed tiles of
/// gemm_tiles, each multiplied on one thread inside parallel_for, so the result does not
/// depend on the thread count. fn(first row, rows, first column, columns, op(A) at that row,
/// op(B) at that column).
template <class T, class Fn>
void for_each_tile(Trans ta, Trans tb, std::int64_t M, std::int64_t N, const T* A, std::int64_t lda,
                   const T* B, std::int64_t ldb, Fn&& fn) {
  blas_single_threaded();
  const GemmTiles tiles = gemm_tiles(M, N);
  parallel_for(tiles.count, [&](std::int64_t t) {
    const std::int64_t first = t * tiles.size;
    const std::int64_t extent = std::min(tiles.size, (tiles.by_rows ? M : N) - first);
    if (tiles.by_rows) {
      fn(first, static_cast<int>(extent), std::int64_t{0}, static_cast<int>(N),
         ta == Trans::no ? A + first * lda : A + first, B);
    } else {
      fn(std::int64_t{0}, static_cast<int>(M), first, static_cast<int>(extent), A,
         tb == Trans::no ? B + first : B + first * ldb);
    }
  });
}

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

// Half-type GEMM: C32 = beta * C in float (or, with a bias [N], every row of C32 = the bias),
// C32 += alpha op(A) op(B) in float (oneDNN or sbgemm on bf16, else the f32 path on widened
// copies, all in the fixed tiles), then C = round(C32) once.
template <class T>
void gemm_half(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
               const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
               std::int64_t ldc, const T* bias = nullptr) {
  auto c32 = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(M * N));
  float* acc = c32.get();
  parallel_for(M, [&](std::int64_t m) {
    for (std::int64_t n = 0; n < N; ++n) {
      acc[m * N + n] = bias != nullptr ? load(bias[n])
                       : beta == 0.0f  ? 0.0f
                                       : beta * load(C[m * ldc + n]);
    }
  });
  // A bf16 kernel over the tiles: kernel(ta, tb, rows, cols, K, alpha, a, lda, b, ldb, c, ldc).
  [[maybe_unused]] const auto over_tiles = [&](auto&& kernel) {
    for_each_tile(
        ta, tb, M, N, A, lda, B, ldb,
        [&](std::int64_t m0, int rows, std::int64_t n0, int cols, const T* a, const T* b) {
          kernel(ta, tb, rows, cols, static_cast<int>(K), alpha, a, static_cast<int>(lda), b,
                 static_cast<int>(ldb), acc + m0 * N + n0, static_cast<int>(N));
        });
  };
  bool done = K == 0;  // an empty sum adds nothing (and oneDNN refuses K = 0)
  if constexpr (std::is_same_v<T, bf16>) {
#if defined(ZERO_OPS_CPU_DNNL)
    if (!done && onednn_gemm_usable<bf16>()) {
      over_tiles([](Trans a_t, Trans b_t, int rows, int cols, int k, float s, const bf16* a,
                    int a_ld, const bf16* b, int b_ld, float* c, int c_ld) {
        onednn_gemm<bf16>(a_t == Trans::yes, b_t == Trans::yes, rows, cols, k, s, a, a_ld, b, b_ld,
                          1.0f, c, c_ld);
      });
      done = true;
    }
#endif
#if defined(ZERO_WITH_BLAS)
    if (const SbgemmFn sbgemm = usable_sbgemm(); !done && sbgemm != nullptr) {
      over_tiles([&](Trans a_t, Trans b_t, int rows, int cols, int k, float s, const bf16* a,
                     int a_ld, const bf16* b, int b_ld, float* c, int c_ld) {
        sbgemm_accumulate(sbgemm, a_t, b_t, rows, cols, k, s, a, a_ld, b, b_ld, c, c_ld);
      });
      done = true;
    }
#endif
  }
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
#if defined(ZERO_OPS_CPU_DNNL)
  if constexpr (std::is_same_v<T, float>) {
    if (K > 0 && onednn_gemm_usable<float>()) {  // one oneDNN matmul per tile
      detail::for_each_tile(ta, tb, M, N, A, lda, B, ldb,
                            [&](std::int64_t m0, int rows, std::int64_t n0, int cols,
                                const float* a, const float* b) {
                              onednn_gemm<float>(ta == Trans::yes, tb == Trans::yes, rows, cols,
                                                 static_cast<int>(K), alpha, a,
                                                 static_cast<int>(lda), b, static_cast<int>(ldb),
                                                 beta, C + m0 * ldc + n0, static_cast<int>(ldc));
                            });
      return;
    }
  }
#endif
  if constexpr (!is_half_type<T>) {  // one BLAS call per tile (the loop without BLAS: the same)
    detail::for_each_tile(
        ta, tb, M, N, A, lda, B, ldb,
        [&](std::int64_t m0, int rows, std::int64_t n0, int cols, const T* a, const T* b) {
          gemm_serial<T>(ta, tb, rows, cols, K, alpha, a, lda, b, ldb, beta, C + m0 * ldc + n0,
                         ldc);
        });
  }
}

/// C[M,N] = op(A) op(B) + bias, the bias [N] added to every row (null: no bias); C is written,
/// never read. The values are those of filling C's rows with the bias and calling gemm with
/// beta 1 (which is what runs without a fused path); f32 on oneDNN adds the bias inside the
/// matmul (onednn_gemm_bias_usable) and half types start their float accumulator from it, so
/// neither writes C twice. Bit-identical results for any number of threads.
template <class T>
void gemm_bias(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A,
               std::int64_t lda, const T* B, std::int64_t ldb, const T* bias, T* C,
               std::int64_t ldc) {
  using S = compute_type_t<T>;
  if (M == 0 || N == 0) return;
  if (bias == nullptr) {
    gemm<T>(ta, tb, M, N, K, S(1), A, lda, B, ldb, S(0), C, ldc);
    return;
  }
  if constexpr (is_half_type<T>) {
    detail::gemm_half(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, bias);
    return;
  }
#if defined(ZERO_OPS_CPU_DNNL)
  if constexpr (std::is_same_v<T, float>) {
    if (K > 0 && onednn_gemm_bias_usable()) {
      detail::for_each_tile(ta, tb, M, N, A, lda, B, ldb,
                            [&](std::int64_t m0, int rows, std::int64_t n0, int cols,
                                const float* a, const float* b) {
                              onednn_gemm_bias<float>(ta == Trans::yes, tb == Trans::yes, rows,
                                                      cols, static_cast<int>(K), a,
                                                      static_cast<int>(lda), b,
                                                      static_cast<int>(ldb), bias + n0,
                                                      C + m0 * ldc + n0, static_cast<int>(ldc));
                            });
      return;
    }
  }
#endif
  if constexpr (!is_half_type<T>) {
    // A copy per row (no arithmetic), then accumulate.
    const std::int64_t rows = std::max<std::int64_t>(1, 16384 / N);
    parallel_chunks(M, rows, M * N, [&](std::int64_t m0, std::int64_t m1) {
      for (std::int64_t m = m0; m < m1; ++m) std::copy_n(bias, N, C + m * ldc);
    });
    gemm<T>(ta, tb, M, N, K, S(1), A, lda, B, ldb, S(1), C, ldc);
  }
}

}  // namespace zero::ops::cpu
