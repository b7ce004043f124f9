#pragma once
// zero-requires: cuda
// Row-major GEMM on the GPU through cuBLASLt; the twin of zero/ops/cpu/gemm.hpp:
//   C[M,N] = alpha * op(A) * op(B) + beta * C   (+ bias[N], then GELU, when an epilogue asks)
// f32, bf16 and f16 operands, always with f32 accumulation (CUBLAS_COMPUTE_32F: no TF32, so f32
// results match the host's to rounding). cuBLASLt is column-major; a row-major C is the
// column-major C^T = op(B)^T op(A)^T, so the call swaps A and B and M and N, and a row-major bias
// over C's columns is cuBLASLt's bias over D's rows.
// A GemmContext owns the cuBLASLt and cuBLAS handles, a workspace from the device pool and the
// algorithm heuristic cached per shape (dtype, transposes, sizes, leading dimensions, epilogue,
// pointer alignment), so each shape asks cuBLASLt once. One context serves one stream at a time
// (the workspace is shared by its calls); give each concurrent stream its own.
// Reference: llm.c matmul_cublaslt (llmc/matmul.cuh), cuBLASLt's LtSgemm sample.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/gemm.cuh needs nvcc; host-only code includes zero/ops/cpu/gemm.hpp"
#endif

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/ops/cpu/gemm.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

using cpu::Trans;

// ---- status checks ------------------------------------------------------------------------------

/// Throws CudaError naming the cuBLAS call when status is not CUBLAS_STATUS_SUCCESS.
inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    raise<CudaError>(call, " failed: ", cublasGetStatusString(status), " (status ",
                     static_cast<int>(status), ") at ", file, ":", line);
  }
}

}  // namespace zero::ops::cuda

/// Checks a cuBLAS or cuBLASLt call; the macro exists only to capture the call text and place.
#define ZERO_CUBLAS_CHECK(call) ::zero::ops::cuda::check_cublas((call), #call, __FILE__, __LINE__)

namespace zero::ops::cuda {

// ---- types --------------------------------------------------------------------------------------

/// cuBLAS's data type for element type T.
template <class T>
constexpr cudaDataType_t cuda_data_type() {
  if constexpr (std::is_same_v<T, float>) {
    return CUDA_R_32F;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return CUDA_R_16BF;
  } else {
    static_assert(std::is_same_v<T, f16>, "ops::cuda GEMM takes float, bf16 or f16");
    return CUDA_R_16F;
  }
}

/// What cuBLASLt does to the product before it stores C.
enum class Epilogue : int {
  none,       ///< C = alpha op(A) op(B) + beta C
  bias,       ///< ... + bias[n] (per column of the row-major C)
  gelu_bias,  ///< GELU(... + bias[n]), cuBLASLt's GELU (tanh approximation)
};

// ---- the context --------------------------------------------------------------------------------

/// cuBLASLt/cuBLAS handles, a workspace and the per-shape algorithm cache.
class GemmContext {
 public:
  /// Default workspace: 32 MiB, what cuBLAS recommends for Hopper.
  static constexpr std::size_t default_workspace_bytes = std::size_t{32} << 20;

  /// Creates the handles and takes the workspace from the device's pool on stream (and waits for
  /// it, so GEMMs on any stream may use it).
  explicit GemmContext(cudaStream_t stream = nullptr,
                       std::size_t workspace_bytes = default_workspace_bytes)
      : workspace_bytes_(workspace_bytes), stream_(stream) {
    ZERO_CUBLAS_CHECK(cublasLtCreate(&lt_));
    ZERO_CUBLAS_CHECK(cublasCreate(&blas_));
    // Default math: f32 GEMMs with CUBLAS_COMPUTE_32F never use TF32, and bf16 ones still get
    // tensor cores (pedantic mode would slow the reference path the benchmark compares against).
    ZERO_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
    if (workspace_bytes_ != 0) {
      ZERO_CUDA_CHECK(cudaMallocAsync(&workspace_, workspace_bytes_, stream));
      ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));  // allocated before any stream uses it
    }
  }
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;
  /// Waits for the device (no GEMM may still use the workspace), then frees the workspace on the
  /// stream it was allocated on, which must still exist.
  ~GemmContext() {
    if (workspace_ != nullptr) {
      cudaDeviceSynchronize();
      cudaFreeAsync(workspace_, stream_);
    }
    cublasDestroy(blas_);
    cublasLtDestroy(lt_);
  }

  /// The cuBLASLt handle.
  cublasLtHandle_t lt() const { return lt_; }
  /// The cuBLAS handle (for batched GEMMs cuBLASLt has no simple form of); set its stream first.
  cublasHandle_t blas() const { return blas_; }
  /// The cuBLASLt workspace (device memory) and its size.
  void* workspace() const { return workspace_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }

  /// Everything the choice of algorithm depends on.
  struct Key {
    int dtype, ta, tb;
    std::int64_t m, n, k, lda, ldb, ldc;
    int epilogue, beta_zero, align_a, align_b, align_c;
    friend bool operator<(const Key& x, const Key& y) {
      return std::tie(x.dtype, x.ta, x.tb, x.m, x.n, x.k, x.lda, x.ldb, x.ldc, x.epilogue,
                      x.beta_zero, x.align_a, x.align_b, x.align_c) <
             std::tie(y.dtype, y.ta, y.tb, y.m, y.n, y.k, y.lda, y.ldb, y.ldc, y.epilogue,
                      y.beta_zero, y.align_a, y.align_b, y.align_c);
    }
  };

  /// The cached algorithm for key, or asks make() once and caches its answer.
  template <class Make>
  cublasLtMatmulAlgo_t algorithm(const Key& key, Make&& make) {
    std::lock_guard lock(mutex_);
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, make()).first;
    return it->second;
  }
  /// Shapes whose algorithm is cached.
  std::size_t cached_shapes() const {
    std::lock_guard lock(mutex_);
    return cache_.size();
  }

 private:
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_;
  cudaStream_t stream_;
  mutable std::mutex mutex_;
  std::map<Key, cublasLtMatmulAlgo_t> cache_;
};

namespace detail {

/// The largest power of two up to 256 that divides p's address (cuBLASLt's alignment classes).
inline int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % static_cast<std::uintptr_t>(align) != 0) align /= 2;
  return align;
}

/// RAII holders for the cuBLASLt descriptors of one call.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace detail

// ---- GEMM ---------------------------------------------------------------------------------------

/// C[M,N] = epilogue(alpha*op(A)*op(B) + beta*C), row-major, leading dimensions lda, ldb, ldc
/// (device pointers); bias (length N) is read by the bias epilogues only. Ordered on stream.
template <class T>
void gemm(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          float alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
          std::int64_t ldc, Epilogue epilogue, const T* bias, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  expect<ShapeError>(K > 0, "ops::cuda::gemm: K = ", K, " (M=", M, " N=", N,
                     "); an empty product is not a cuBLASLt shape");
  expect<ShapeError>(epilogue == Epilogue::none || bias != nullptr, "ops::cuda::gemm: the ",
                     epilogue == Epilogue::bias ? "bias" : "gelu_bias",
                     " epilogue needs a bias pointer");
  constexpr cudaDataType_t type = cuda_data_type<T>();
  // Column-major view: D^T[N, M] = op(B)^T [N, K] * op(A)^T [K, M].
  const cublasOperation_t op_first = tb == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = ta == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  const std::uint64_t first_rows = tb == Trans::no ? N : K, first_cols = tb == Trans::no ? K : N;
  const std::uint64_t second_rows = ta == Trans::no ? K : M, second_cols = ta == Trans::no ? M : K;

  detail::LtDescriptors d;
  ZERO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                   sizeof op_first));
  ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                   sizeof op_second));
  const cublasLtEpilogue_t lt_epilogue = epilogue == Epilogue::bias ? CUBLASLT_EPILOGUE_BIAS
                                         : epilogue == Epilogue::gelu_bias
                                             ? CUBLASLT_EPILOGUE_GELU_BIAS
                                             : CUBLASLT_EPILOGUE_DEFAULT;
  ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                   &lt_epilogue, sizeof lt_epilogue));
  if (epilogue != Epilogue::none) {
    ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof bias));
  }
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, type, first_rows, first_cols, ldb));
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, type, second_rows, second_cols, lda));
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, type, static_cast<std::uint64_t>(N),
                                               static_cast<std::uint64_t>(M), ldc));

  const GemmContext::Key key{static_cast<int>(type),
                             static_cast<int>(ta),
                             static_cast<int>(tb),
                             M,
                             N,
                             K,
                             lda,
                             ldb,
                             ldc,
                             static_cast<int>(epilogue),
                             beta == 0.0f,
                             detail::alignment_of(A),
                             detail::alignment_of(B),
                             detail::alignment_of(C)};
  const cublasLtMatmulAlgo_t algo = ctx.algorithm(key, [&] {
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
    const std::size_t ws = ctx.workspace_bytes();
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    // The swapped operands: cuBLASLt's A is our B and its B our A.
    const std::uint32_t align_first = static_cast<std::uint32_t>(key.align_b);
    const std::uint32_t align_second = static_cast<std::uint32_t>(key.align_a);
    const std::uint32_t align_c = static_cast<std::uint32_t>(key.align_c);
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first, sizeof align_first));
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second, sizeof align_second));
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
    ZERO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ZERO_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.lt(), d.op, d.a, d.b, d.c, d.c, d.pref, 1,
                                                     &result, &found));
    expect<CudaError>(found > 0, "ops::cuda::gemm: cuBLASLt has no algorithm for M=", M, " N=", N,
                      " K=", K, " lda=", lda, " ldb=", ldb, " ldc=", ldc,
                      " epilogue=", static_cast<int>(epilogue), " (pointer alignments ",
                      key.align_a, "/", key.align_b, "/", key.align_c, " bytes)");
    return result.algo;
  });
  ZERO_CUBLAS_CHECK(cublasLtMatmul(ctx.lt(), d.op, &alpha, B, d.a, A, d.b, &beta, C, d.c, C, d.c,
                                   &algo, ctx.workspace(), ctx.workspace_bytes(), stream));
}

/// gemm without an epilogue.
template <class T>
void gemm(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          float alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
          std::int64_t ldc, cudaStream_t stream) {
  gemm<T>(ctx, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, Epilogue::none, nullptr,
          stream);
}

}  // namespace zero::ops::cuda
