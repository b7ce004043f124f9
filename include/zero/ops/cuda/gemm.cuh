#pragma once
// zero-requires: cuda
// Row-major GEMM on the GPU through cuBLASLt; the twin of zero/ops/cpu/gemm.hpp:
//   C[M,N] = alpha * op(A) * op(B) + beta * C   (+ bias[N], then GELU, when an epilogue asks)
// (gemm_from reads the beta term from another matrix laid out as C: a residual's skip path)
// f32, bf16 and f16 operands, always with f32 accumulation (CUBLAS_COMPUTE_32F: no TF32, so f32
// results match the host's to rounding). cuBLASLt is column-major; a row-major C is the
// column-major C^T = op(B)^T op(A)^T, so the call swaps A and B and M and N, and a row-major bias
// over C's columns is cuBLASLt's bias over D's rows.
// A GemmContext owns the cuBLASLt and cuBLAS handles, a workspace from the device pool and the
// algorithm chosen per shape (dtype, transposes, sizes, leading dimensions, epilogue, pointer
// alignment), so each shape is decided once. One context serves one stream at a time (the
// workspace is shared by its calls); give each concurrent stream its own.
// How a shape's algorithm is chosen (GemmTuning): cuBLASLt's first heuristic answer by default,
// or, measured (ZERO_GEMM_TUNING=measured, or set_tuning), the fastest of its first candidates
// timed on the shape's first call, on that call's operands (into scratch where beta reads C; at
// beta 0 into the output, which the chosen algorithm writes last), as PyTorch's TunableOp does
// for its GEMMs. A measured
// choice can differ from run to run (timings vary), and algorithms may split the sum over K
// differently, so runs are then reproducible within a process but not bit for bit across them.
// Reference: llm.c matmul_cublaslt (llmc/matmul.cuh), cuBLASLt's LtSgemm sample.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/gemm.cuh needs nvcc; host-only code includes zero/ops/cpu/gemm.hpp"
#endif

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
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
  none,           ///< C = alpha op(A) op(B) + beta C
  bias,           ///< ... + bias[n] (per column of the row-major C)
  gelu_bias,      ///< GELU(... + bias[n]), cuBLASLt's GELU (tanh approximation)
  gelu_aux,       ///< GELU(...), the GELU's input also stored (aux, laid out as C)
  gelu_aux_bias,  ///< GELU(... + bias[n]), the GELU's input also stored (aux)
  dgelu,          ///< ... times GELU'(aux): the gradient through a GELU whose input aux holds
};

/// How a GemmContext chooses the algorithm of each shape (see the file comment).
enum class GemmTuning : int {
  heuristic,  ///< cuBLASLt's first heuristic answer: the same algorithm in every run
  measured,   ///< the fastest of the heuristic's first candidates, timed once per shape
};

/// The tuning ZERO_GEMM_TUNING asks for: unset or empty is heuristic; "heuristic" or "measured";
/// anything else a ConfigError naming the value.
inline GemmTuning gemm_tuning_from_environment() {
  const char* value = std::getenv("ZERO_GEMM_TUNING");
  const std::string_view v = value != nullptr ? value : "";
  if (v.empty() || v == "heuristic") return GemmTuning::heuristic;
  expect<ConfigError>(v == "measured", "ZERO_GEMM_TUNING=", v,
                      ": expected \"heuristic\" (the default) or \"measured\"");
  return GemmTuning::measured;
}

// ---- the context --------------------------------------------------------------------------------

/// cuBLASLt/cuBLAS handles, a workspace and the per-shape algorithm cache.
class GemmContext {
 public:
  /// Default workspace: 32 MiB, what cuBLAS recommends for Hopper.
  static constexpr std::size_t default_workspace_bytes = std::size_t{32} << 20;

  /// The most candidates a measured tuning times per shape.
  static constexpr int max_candidates = 16;

  /// Creates the handles and takes the workspace from the device's pool on stream (and waits for
  /// it, so GEMMs on any stream may use it). The tuning is ZERO_GEMM_TUNING's (heuristic unless
  /// it says measured).
  explicit GemmContext(cudaStream_t stream = nullptr,
                       std::size_t workspace_bytes = default_workspace_bytes)
      : workspace_bytes_(workspace_bytes),
        stream_(stream),
        tuning_(gemm_tuning_from_environment()) {
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

  /// How shapes not yet cached choose their algorithm; candidates (1..max_candidates) is how many
  /// of the heuristic's answers a measured tuning times. Shapes already cached keep theirs.
  void set_tuning(GemmTuning tuning, int candidates = 8) {
    expect<ConfigError>(candidates >= 1 && candidates <= max_candidates,
                        "GemmContext::set_tuning: candidates = ", candidates, " (1..",
                        max_candidates, ")");
    std::lock_guard lock(mutex_);
    tuning_ = tuning;
    candidates_ = candidates;
  }
  /// The tuning of shapes not yet cached.
  GemmTuning tuning() const {
    std::lock_guard lock(mutex_);
    return tuning_;
  }

  /// Everything the choice of algorithm depends on (align_c: the least alignment of C, its
  /// source, the bias and aux, which cuBLASLt's heuristic reads from the descriptor too).
  struct Key {
    int dtype, ta, tb;
    std::int64_t m, n, k, lda, ldb, ldc, ld_aux;
    int epilogue, beta_zero, align_a, align_b, align_c;
    friend bool operator<(const Key& x, const Key& y) {
      return std::tie(x.dtype, x.ta, x.tb, x.m, x.n, x.k, x.lda, x.ldb, x.ldc, x.ld_aux, x.epilogue,
                      x.beta_zero, x.align_a, x.align_b, x.align_c) <
             std::tie(y.dtype, y.ta, y.tb, y.m, y.n, y.k, y.lda, y.ldb, y.ldc, y.ld_aux, y.epilogue,
                      y.beta_zero, y.align_a, y.align_b, y.align_c);
    }
  };

  /// A shape's algorithm (none: cuBLASLt has none for it, a refusal cached as well), and
  /// whether timing chose another than the heuristic's first.
  struct Choice {
    std::optional<cublasLtMatmulAlgo_t> algo;
    bool retuned = false;
  };
  /// The cached algorithm for key, or calls make(tuning, candidates) once (under the context's
  /// lock) and caches its Choice; nullopt when cuBLASLt has none.
  template <class Make>
  std::optional<cublasLtMatmulAlgo_t> algorithm(const Key& key, Make&& make) {
    std::lock_guard lock(mutex_);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      it = cache_.emplace(key, make(tuning_, tuning_ == GemmTuning::measured ? candidates_ : 1))
               .first;
    }
    return it->second.algo;
  }
  /// Shapes whose algorithm is cached.
  std::size_t cached_shapes() const {
    std::lock_guard lock(mutex_);
    return cache_.size();
  }
  /// Cached shapes whose measured tuning chose another algorithm than the heuristic's first.
  std::size_t retuned_shapes() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& [key, choice] : cache_) n += choice.retuned ? 1 : 0;
    return n;
  }

 private:
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_;
  cudaStream_t stream_;
  mutable std::mutex mutex_;
  GemmTuning tuning_;
  int candidates_ = 8;
  std::map<Key, Choice> cache_;
};

namespace detail {

/// The largest power of two up to 256 that divides p's address (cuBLASLt's alignment classes).
inline int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % static_cast<std::uintptr_t>(align) != 0) align /= 2;
  return align;
}

/// The least alignment_of the pointers given (null ones do not count): what cuBLASLt's heuristic
/// may assume of C, the matrix its beta term reads, the bias and the aux together.
inline int least_alignment(std::initializer_list<const void*> pointers) {
  int align = 256;
  for (const void* p : pointers) {
    if (p != nullptr) align = std::min(align, alignment_of(p));
  }
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

/// The fastest of candidates for the call d describes (output = alpha op(A) op(B) + beta C, rows
/// rows of ldc elements): each runs once to warm up, then three times between two events on
/// stream. At beta != 0 they all write a scratch copy of the output's shape, so C (which may be
/// the output) is read but never written; at beta 0 nothing reads the output, so they write it
/// in place (no scratch: the LM head's would be its whole logits) and the call's own run, after
/// these, writes it last, as it does an aux output (the gelu_aux epilogues). A candidate
/// cuBLASLt refuses at run time is skipped; the heuristic's first answer stands when every other
/// is refused or slower.
template <class T>
GemmContext::Choice fastest_algorithm(GemmContext& ctx, const LtDescriptors& d,
                                      std::span<const cublasLtMatmulHeuristicResult_t> candidates,
                                      float alpha, const T* A, const T* B, float beta, const T* C,
                                      T* output, std::int64_t rows, std::int64_t ldc,
                                      cudaStream_t stream) {
  constexpr int timed_runs = 3;
  const bool in_place = beta == 0.0f;
  const DeviceScratch scratch(in_place ? 0 : static_cast<std::size_t>(rows * ldc) * sizeof(T),
                              stream);
  T* const out = in_place ? output : scratch.as<T>();
  const CudaEvent start = CudaEvent::timed(), stop = CudaEvent::timed();
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(ctx.lt(), d.op, &alpha, B, d.a, A, d.b, &beta, C, d.c, out, d.c, &algo,
                          ctx.workspace(), ctx.workspace_bytes(), stream);
  };
  float best_ms = 0;
  std::size_t best = candidates.size();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].state != CUBLAS_STATUS_SUCCESS ||
        candidates[i].workspaceSize > ctx.workspace_bytes() ||
        run(candidates[i].algo) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    ZERO_CUDA_CHECK(cudaEventRecord(start.native(), stream));
    bool ran = true;
    for (int r = 0; r < timed_runs && ran; ++r) {
      ran = run(candidates[i].algo) == CUBLAS_STATUS_SUCCESS;
    }
    ZERO_CUDA_CHECK(cudaEventRecord(stop.native(), stream));
    stop.synchronize();
    const float ms = stop.elapsed_ms(start);
    if (ran && (best == candidates.size() || ms < best_ms)) {
      best = i;
      best_ms = ms;
    }
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
  if (best == candidates.size()) best = 0;
  return GemmContext::Choice{candidates[best].algo, best != 0};
}

/// C[i, j] = beta * source[i, j] + bias[j] over M rows of N (source not read at beta 0; bias may
/// be null), rounded once: what a product over K = 0 leaves, as the host twin computes it.
template <class T>
__global__ void empty_product_kernel(T* C, const T* source, std::int64_t ldc, float beta,
                                     const T* bias, std::int64_t M, std::int64_t N) {
  const std::int64_t total = M * N;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / N, j = e % N;
    float value = beta == 0.0f ? 0.0f : beta * load(source[i * ldc + j]);
    if (bias != nullptr) value += load(bias[j]);
    C[i * ldc + j] = store<T>(value);
  }
}

}  // namespace detail

// ---- GEMM ---------------------------------------------------------------------------------------

/// C[M,N] = epilogue(alpha*op(A)*op(B) + beta*source), row-major, leading dimensions lda, ldb,
/// ldc (device pointers); source is laid out as C and may be C itself (beta 0: not read); bias
/// (length N) is read by the bias epilogues only; aux [M, ld_aux] (ld_aux a multiple of 8, at
/// least N) receives the GELU's input under the gelu_aux epilogues and is read (only) under
/// dgelu. Each element of C is rounded once. Ordered on stream. Returns false, having run
/// nothing, when cuBLASLt has no algorithm for the call (a fused epilogue it lacks at this
/// shape, type or alignment; remembered per shape, so it is asked once): a caller with another
/// way to compute the same values takes it; gemm_from throws instead.
template <class T>
[[nodiscard]] bool try_gemm_from(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M,
                                 std::int64_t N, std::int64_t K, float alpha, const T* A,
                                 std::int64_t lda, const T* B, std::int64_t ldb, float beta,
                                 const T* source, T* C, std::int64_t ldc, Epilogue epilogue,
                                 const T* bias, T* aux, std::int64_t ld_aux, cudaStream_t stream) {
  if (M == 0 || N == 0) return true;
  expect<ShapeError>(K >= 0, "ops::cuda::gemm: K = ", K, " (M=", M, " N=", N, ") is negative");
  const bool biased = epilogue == Epilogue::bias || epilogue == Epilogue::gelu_bias ||
                      epilogue == Epilogue::gelu_aux_bias;
  const bool auxed = epilogue == Epilogue::gelu_aux || epilogue == Epilogue::gelu_aux_bias ||
                     epilogue == Epilogue::dgelu;
  expect<ShapeError>(!biased || bias != nullptr, "ops::cuda::gemm: epilogue ",
                     static_cast<int>(epilogue), " needs a bias pointer");
  expect<ShapeError>(!auxed || (aux != nullptr && ld_aux >= N && ld_aux % 8 == 0),
                     "ops::cuda::gemm: the gelu_aux and dgelu epilogues need an aux pointer and "
                     "a leading dimension that is a multiple of 8 and at least N (N=",
                     N, ", ld_aux=", ld_aux, ")");
  if (K == 0) {
    // An empty product adds nothing (cuBLASLt has no K = 0 shape): C = beta * source (+ bias), as
    // on the host, where a batch of no rows leaves a weight gradient as it was.
    expect<ShapeError>(epilogue == Epilogue::none || epilogue == Epilogue::bias,
                       "ops::cuda::gemm: K = 0 (M=", M, " N=", N, ") with GELU epilogue ",
                       static_cast<int>(epilogue), "; only none and bias take an empty product");
    if (beta == 1.0f && source == C && !biased) return true;
    detail::empty_product_kernel<T><<<grid_for(M * N), elementwise_threads, 0, stream>>>(
        C, source, ldc, beta, biased ? bias : nullptr, M, N);
    ZERO_CUDA_CHECK(cudaGetLastError());
    return true;
  }
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
  const cublasLtEpilogue_t lt_epilogue = [&] {
    switch (epilogue) {
      case Epilogue::none:
        break;
      case Epilogue::bias:
        return CUBLASLT_EPILOGUE_BIAS;
      case Epilogue::gelu_bias:
        return CUBLASLT_EPILOGUE_GELU_BIAS;
      case Epilogue::gelu_aux:
        return CUBLASLT_EPILOGUE_GELU_AUX;
      case Epilogue::gelu_aux_bias:
        return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
      case Epilogue::dgelu:
        return CUBLASLT_EPILOGUE_DGELU;
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
  }();
  ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                   &lt_epilogue, sizeof lt_epilogue));
  if (biased) {
    ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof bias));
  }
  if (auxed) {  // aux is laid out as D: column-major [N, M] with leading dimension ld_aux
    void* aux_pointer = aux;
    ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_pointer, sizeof aux_pointer));
    ZERO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                     &ld_aux, sizeof ld_aux));
  }
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, type, first_rows, first_cols, ldb));
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, type, second_rows, second_cols, lda));
  ZERO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, type, static_cast<std::uint64_t>(N),
                                               static_cast<std::uint64_t>(M), ldc));

  const GemmContext::Key key{
      static_cast<int>(type),
      static_cast<int>(ta),
      static_cast<int>(tb),
      M,
      N,
      K,
      lda,
      ldb,
      ldc,
      auxed ? ld_aux : 0,
      static_cast<int>(epilogue),
      beta == 0.0f,
      detail::alignment_of(A),
      detail::alignment_of(B),
      detail::least_alignment({C, source, auxed ? aux : nullptr, biased ? bias : nullptr})};
  const auto algo = ctx.algorithm(key, [&](GemmTuning tuning, int candidates) {
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
    std::array<cublasLtMatmulHeuristicResult_t, GemmContext::max_candidates> results{};
    int found = 0;
    // cuBLASLt answers NOT_SUPPORTED, or no result, when it has no algorithm for the call.
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        ctx.lt(), d.op, d.a, d.b, d.c, d.c, d.pref, candidates, results.data(), &found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
      return GemmContext::Choice{std::nullopt, false};
    }
    ZERO_CUBLAS_CHECK(status);
    if (tuning == GemmTuning::heuristic || found == 1) {
      return GemmContext::Choice{results[0].algo, false};
    }
    return detail::fastest_algorithm(ctx, d, std::span(results.data(), found), alpha, A, B, beta,
                                     source, C, M, ldc, stream);
  });
  if (!algo) return false;
  ZERO_CUBLAS_CHECK(cublasLtMatmul(ctx.lt(), d.op, &alpha, B, d.a, A, d.b, &beta, source, d.c, C,
                                   d.c, &*algo, ctx.workspace(), ctx.workspace_bytes(), stream));
  return true;
}

/// try_gemm_from, or CudaError naming the call when cuBLASLt has no algorithm for it.
template <class T>
void gemm_from(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
               float alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta,
               const T* source, T* C, std::int64_t ldc, Epilogue epilogue, const T* bias, T* aux,
               std::int64_t ld_aux, cudaStream_t stream) {
  expect<CudaError>(try_gemm_from<T>(ctx, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, source, C,
                                     ldc, epilogue, bias, aux, ld_aux, stream),
                    "ops::cuda::gemm: cuBLASLt has no algorithm for M=", M, " N=", N, " K=", K,
                    " lda=", lda, " ldb=", ldb, " ldc=", ldc,
                    " epilogue=", static_cast<int>(epilogue), " (pointer alignments ",
                    detail::alignment_of(A), "/", detail::alignment_of(B), "/",
                    detail::least_alignment({C, source, aux, bias}),
                    " bytes: A, B, and the least of C, source, aux and bias)");
}

/// gemm_from without an aux output.
template <class T>
void gemm_from(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
               float alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta,
               const T* source, T* C, std::int64_t ldc, Epilogue epilogue, const T* bias,
               cudaStream_t stream) {
  gemm_from<T>(ctx, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, source, C, ldc, epilogue, bias,
               nullptr, 0, stream);
}

/// C[M,N] = epilogue(alpha*op(A)*op(B) + beta*C): gemm_from with C as its own source.
template <class T>
void gemm(GemmContext& ctx, Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
          float alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
          std::int64_t ldc, Epilogue epilogue, const T* bias, cudaStream_t stream) {
  gemm_from<T>(ctx, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, C, ldc, epilogue, bias,
               stream);
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
