#pragma once
// Gradient clipping by global L2 norm, and the inf/NaN check of fp16 loss scaling, in one pass.
//
// grad_stats reads a gradient shard once and returns the sum of squares in double plus whether
// every element is finite. The squares of floats are exact in double and cannot overflow
// (FLT_MAX^2 < DBL_MAX), so the sum is finite exactly when every element is: the overflow flag
// comes from the sum itself at no extra cost. The engine sums `sum_sq` over ranks (and ORs the
// flags), takes the root, and folds clip_coefficient(norm, max_norm) / loss_scale into the
// optimizer pass as FusedIo::grad_scale.
//
// Determinism: the shard is cut into fixed blocks; inside a block element i goes to accumulator
// i mod 8; accumulators and blocks are combined in a fixed order. Every ISA uses that same
// assignment and order and the same double additions, so the result is identical for any
// thread count and any instruction set.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#include <omp.h>
#endif

#include <optim/cpu/fused_driver.hpp>
#include <optim/cpu/isa.hpp>
#include <optim/cpu/vector_ops.hpp>
#include <optim/fused_io.hpp>
#include <zero/core/dtype.hpp>

namespace zero::optim {

/// Sum of squares and finiteness of a gradient shard.
struct GradStats {
  double sum_sq = 0.0;  ///< sum of g^2 over the shard (of the values as stored: still scaled)
  bool finite = true;   ///< false when any element is Inf or NaN

  /// Combines two shards' stats (what an all-reduce does across ranks).
  GradStats& operator+=(const GradStats& other) {
    sum_sq += other.sum_sq;
    finite = finite && other.finite;
    return *this;
  }
};

/// DeepSpeed's clip coefficient: min(1, max_norm / (norm + 1e-6)); 1 when clipping is off
/// (max_norm <= 0) or the norm is not finite (the step is skipped then anyway).
inline double clip_coefficient(double global_norm, double max_norm) {
  if (!(max_norm > 0.0) || !std::isfinite(global_norm)) return 1.0;
  const double c = max_norm / (global_norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

namespace detail {

/// Elements per block of the norm pass (a multiple of 16).
inline constexpr std::size_t norm_block_elems = 8192;
/// Accumulators per block; element i of a block adds into accumulator i % 8.
inline constexpr int norm_lanes = 8;

/// One element widened to float.
inline float widen(float x) {
  return x;
}
inline float widen(bf16 x) {
  return bf16::to_float(x.bits);
}
inline float widen(f16 x) {
  return f16::to_float(x.bits);
}

/// Folds the 8 accumulators in a fixed tree order.
inline double fold_lanes(const double* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/// Scalar block sum: accumulator i % 8, then the fixed fold.
template <class T>
double sum_sq_scalar(const T* g, std::size_t n) {
  double acc[norm_lanes] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const double x = widen(g[i]);
    acc[i % norm_lanes] += x * x;  // x*x is exact in double: contraction cannot change it
  }
  return fold_lanes(acc);
}

#if defined(ZERO_OPTIM_HAVE_X86)
/// AVX2 block sum with the same lane assignment: lanes 0-3 and 4-7 in two double vectors.
template <class T>
ZERO_OPTIM_TARGET_AVX2 __attribute__((flatten)) double sum_sq_avx2(const T* g, std::size_t n) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = Avx2Ops::load(g + i).v;
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
  }
  alignas(32) double acc[norm_lanes];
  _mm256_store_pd(acc, lo);
  _mm256_store_pd(acc + 4, hi);
  for (; i < n; ++i) {
    const double x = widen(g[i]);
    acc[i % norm_lanes] += x * x;
  }
  return fold_lanes(acc);
}

/// AVX-512 block sum: 16 floats per load, the upper 8 added after the lower 8 into the same
/// 8 accumulators, which is the scalar order.
template <class T>
ZERO_OPTIM_TARGET_AVX512 __attribute__((flatten)) double sum_sq_avx512(const T* g, std::size_t n) {
  __m512d acc8 = _mm512_setzero_pd();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // Two 8-float halves (AVX2 loads and conversions); zero-masked widening because GCC 12's
    // unmasked form trips -Wmaybe-uninitialized (see vector_ops.hpp).
    const __m512d a = _mm512_maskz_cvtps_pd(0xff, Avx2Ops::load(g + i).v);
    const __m512d b = _mm512_maskz_cvtps_pd(0xff, Avx2Ops::load(g + i + 8).v);
    acc8 = _mm512_add_pd(acc8, _mm512_mul_pd(a, a));
    acc8 = _mm512_add_pd(acc8, _mm512_mul_pd(b, b));
  }
  alignas(64) double acc[norm_lanes];
  _mm512_store_pd(acc, acc8);
  for (; i < n; ++i) {
    const double x = widen(g[i]);
    acc[i % norm_lanes] += x * x;
  }
  return fold_lanes(acc);
}
#endif

/// Stats of n elements of T.
template <class T>
GradStats grad_stats_typed(const T* g, std::size_t n, const StepOptions& options) {
  const std::size_t blocks = (n + norm_block_elems - 1) / norm_block_elems;
  std::vector<double> partial(blocks, 0.0);
  double (*block_sum)(const T*, std::size_t) = &sum_sq_scalar<T>;
#if defined(ZERO_OPTIM_HAVE_X86)
  switch (resolve_isa(options.isa)) {
    case Isa::avx512:
      block_sum = &sum_sq_avx512<T>;
      break;
    case Isa::avx2:
      block_sum = &sum_sq_avx2<T>;
      break;
    default:
      break;
  }
#else
  (void)resolve_isa(options.isa);
#endif
  const auto count = static_cast<std::int64_t>(blocks);
  [[maybe_unused]] const int threads = thread_count(options.threads);
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
  for (std::int64_t b = 0; b < count; ++b) {
    const std::size_t begin = static_cast<std::size_t>(b) * norm_block_elems;
    const std::size_t len = begin + norm_block_elems <= n ? norm_block_elems : n - begin;
    partial[static_cast<std::size_t>(b)] = block_sum(g + begin, len);
  }
  GradStats out;
  for (double p : partial) out.sum_sq += p;
  out.finite = std::isfinite(out.sum_sq);
  return out;
}

}  // namespace detail

/// Sum of squares and finiteness of a gradient shard of n elements of dtype (f32, bf16, f16).
inline GradStats grad_stats(const void* grad, DType dtype, std::size_t n,
                            const StepOptions& options = {}) {
  switch (dtype) {
    case DType::f32:
      return detail::grad_stats_typed(static_cast<const float*>(grad), n, options);
    case DType::bf16:
      return detail::grad_stats_typed(static_cast<const bf16*>(grad), n, options);
    case DType::f16:
      return detail::grad_stats_typed(static_cast<const f16*>(grad), n, options);
    default:
      raise<Error>("zero::optim::grad_stats: gradients must be f32, bf16 or f16, got ",
                   name_of(dtype));
  }
}

/// grad_stats of a typed span.
template <class T>
GradStats grad_stats(std::span<const T> grad, const StepOptions& options = {}) {
  return grad_stats(grad.data(), dtype_of<T>, grad.size(), options);
}

/// The global L2 norm of the unscaled gradient from the summed stats and the loss scale.
inline double global_norm(const GradStats& summed, double loss_scale = 1.0) {
  return std::sqrt(summed.sum_sq) / loss_scale;
}

}  // namespace zero::optim
