#pragma once
// One-lane float arithmetic for the optimizer update rules, identical on host and device.
//
// Why explicit operations: the rules are written once (update_rules.hpp) and run as scalar C++,
// as AVX2/AVX-512 vectors and as CUDA threads. For all of them to produce the same bits, every
// multiply-add that should be fused is an explicit fma, and no rule ever feeds a plain product
// into a plain add or subtract. Then a compiler that contracts a*b+c into an FMA (GCC's default
// -ffp-contract=fast, nvcc's --fmad=true) finds nothing to contract, and the only operations
// left (+ - * / sqrt fma) are correctly rounded IEEE operations on every path. On the device the
// _rn intrinsics additionally forbid contraction.

#include <cmath>
#include <cstdint>

#include <zero/core/macros.hpp>
#include <zero/core/rng.hpp>

namespace zero::optim {

/// Scalar float operations in the vocabulary the update rules use (host and device).
struct ScalarOps {
  using V = float;
  static constexpr int width = 1;

  /// Broadcast of a constant (identity for one lane).
  ZERO_HOST_DEVICE static float set1(float x) { return x; }
  /// a + b, correctly rounded.
  ZERO_HOST_DEVICE static float add(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
  }
  /// a - b, correctly rounded.
  ZERO_HOST_DEVICE static float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
  }
  /// a * b, correctly rounded (never contracted on the device).
  ZERO_HOST_DEVICE static float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  /// a / b, correctly rounded.
  ZERO_HOST_DEVICE static float div(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
  /// a * b + c with one rounding.
  ZERO_HOST_DEVICE static float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
  /// c - a * b with one rounding.
  ZERO_HOST_DEVICE static float fnma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(-a, b, c);
#else
    return std::fma(-a, b, c);
#endif
  }
  /// Correctly rounded square root.
  ZERO_HOST_DEVICE static float sqrt(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
  }
  /// +1 for positive, -1 for negative, x itself for zeros and NaN (as torch.sign).
  ZERO_HOST_DEVICE static float sign(float x) {
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
  }
};

/// Elements that share one Philox call's 128 bits of rounding bits (16 bits each).
inline constexpr int rounding_group = 8;

/// The 128 random bits of stochastic-rounding group group (elements [8 group, 8 group + 8)) at
/// step step under key.
ZERO_HOST_DEVICE Philox4x32::Counter rounding_words(std::uint64_t key, std::uint32_t step,
                                                    std::uint64_t group) {
  return CounterRng(key).words(group, step);
}

/// Element index's 16 bits out of its group's words (rounding_words of index / 8).
ZERO_HOST_DEVICE std::uint32_t rounding_bits_in(const Philox4x32::Counter& words,
                                                std::uint64_t index) {
  const std::uint32_t word = words[(index >> 1) & 3u];
  return (index & 1u) != 0 ? (word >> 16) : (word & 0xffffu);
}

/// 16 random bits for stochastic rounding of element index at step step under key: one Philox
/// call yields 128 bits, shared by 8 consecutive elements, so a vector of 8 needs one call and
/// every path (scalar, SIMD, CUDA) gets the same bits for the same element.
ZERO_HOST_DEVICE std::uint32_t rounding_bits(std::uint64_t key, std::uint32_t step,
                                             std::uint64_t index) {
  return rounding_bits_in(rounding_words(key, step, index / rounding_group), index);
}

}  // namespace zero::optim
