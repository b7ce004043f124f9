#pragma once
// bf16: the upper 16 bits of an IEEE binary32 (1 sign, 8 exponent, 7 mantissa bits).
// Host conversion rounds to nearest, ties to even; NaN stays NaN (quiet), infinities and
// overflow to infinity follow IEEE rules; denormals are kept (bf16 shares float's exponent range).
// On CUDA the same bits are __nv_bfloat16 (see zero/core/cuda_types.cuh).

#include <bit>
#include <cstdint>

#include <zero/core/macros.hpp>

namespace zero {

/// Brain floating point: 16-bit storage, computed in float.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  /// Rounds value to the nearest bf16, ties to even.
  ZERO_HOST_DEVICE explicit bf16(float value) : bits(round_nearest_even(value)) {}
  /// Exact widening to float.
  ZERO_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  /// The bf16 whose bit pattern is b.
  ZERO_HOST_DEVICE static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 r{};
    r.bits = b;
    return r;
  }

  /// Bits of a NaN value as bf16: its sign and top mantissa bits, forced quiet.
  ZERO_HOST_DEVICE static constexpr std::uint16_t nan_bits(float value) {
    return static_cast<std::uint16_t>((std::bit_cast<std::uint32_t>(value) >> 16) | 0x0040u);
  }

  /// Bits of value rounded to nearest, ties to even.
  ZERO_HOST_DEVICE static constexpr std::uint16_t round_nearest_even(float value) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return nan_bits(value);
    // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry out of the mantissa
    // bumps the exponent, and past the largest finite value it lands exactly on infinity.
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
  }

  /// Bits of value rounded stochastically: rounds up with probability equal to the discarded
  /// fraction, given 16 uniformly random bits in random16 (the low 16 bits are used).
  ZERO_HOST_DEVICE static constexpr std::uint16_t round_stochastic(float value,
                                                                   std::uint32_t random16) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return round_nearest_even(value);  // Inf and NaN
    u += random16 & 0xffffu;
    return static_cast<std::uint16_t>(u >> 16);
  }

  /// Exact float value of the bit pattern b.
  ZERO_HOST_DEVICE static constexpr float to_float(std::uint16_t b) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
  }

  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2);

}  // namespace zero
