#pragma once
// f16: IEEE binary16 (1 sign, 5 exponent, 10 mantissa bits; max 65504; smallest subnormal 2^-24).
// Host conversion rounds to nearest, ties to even, with subnormals produced and read exactly,
// overflow to infinity (from 65520 up, the midpoint past 65504), NaN kept quiet with its sign.
// On CUDA the same bits are __half (see zero/core/cuda_types.cuh).

#include <bit>
#include <cstdint>

#include <zero/core/macros.hpp>

namespace zero {

/// IEEE half precision: 16-bit storage, computed in float.
struct f16 {
  std::uint16_t bits;

  f16() = default;
  /// Rounds value to the nearest f16, ties to even.
  ZERO_HOST_DEVICE explicit f16(float value) : bits(round_nearest_even(value)) {}
  /// Exact widening to float.
  ZERO_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  /// The f16 whose bit pattern is b.
  ZERO_HOST_DEVICE static constexpr f16 from_bits(std::uint16_t b) {
    f16 r{};
    r.bits = b;
    return r;
  }

  /// Bits of a NaN value as f16: its sign and top mantissa bits, forced quiet.
  ZERO_HOST_DEVICE static constexpr std::uint16_t nan_bits(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x03ffu));
  }

  /// Bits of value rounded to nearest, ties to even.
  ZERO_HOST_DEVICE static constexpr std::uint16_t round_nearest_even(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return nan_bits(value);  // NaN: keep the top mantissa bits, force quiet
    if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: Inf
    if (a < 0x38800000u) {                     // below 2^-14: an f16 subnormal or zero
      if (a <= 0x33000000u) return sign;       // <= 2^-25, half the smallest subnormal: ties to 0
      const std::uint32_t exponent = a >> 23;  // 102..112
      const std::uint32_t mantissa = (a & 0x007fffffu) | 0x00800000u;
      const std::uint32_t shift = 126u - exponent;  // 14..24; value = mantissa >> shift ulps
      std::uint32_t result = mantissa >> shift;
      const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
      const std::uint32_t half = 1u << (shift - 1u);
      if (rest > half || (rest == half && (result & 1u))) ++result;
      return static_cast<std::uint16_t>(sign | result);
    }
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits; a carry
    // propagates into the exponent, which is the correct result (65520 and above were cut).
    std::uint32_t result = ((a - 0x38000000u) >> 13);
    const std::uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }

  /// Exact float value of the bit pattern b.
  ZERO_HOST_DEVICE static constexpr float to_float(std::uint16_t b) {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x8000u) << 16;
    const std::uint32_t exponent = (b >> 10) & 0x1fu;
    std::uint32_t mantissa = b & 0x03ffu;
    if (exponent == 0x1fu) {  // Inf or NaN
      return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
    }
    if (exponent == 0) {
      if (mantissa == 0) return std::bit_cast<float>(sign);
      // Subnormal: normalise; every f16 subnormal is a normal float.
      std::uint32_t e = 113;  // 127 - 14
      while ((mantissa & 0x0400u) == 0) {
        mantissa <<= 1;
        --e;
      }
      return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x03ffu) << 13));
    }
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }

  friend constexpr bool operator==(f16 a, f16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(f16) == 2 && alignof(f16) == 2);

}  // namespace zero
