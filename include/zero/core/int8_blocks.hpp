#pragma once
// Block-wise symmetric int8 quantization, the packing ZeRO++'s quantized weights (qwZ) gather:
// a run of n values is cut into blocks of int8_block elements (the last one maybe shorter); a
// block keeps one fp32 scale, its largest magnitude / 127, and each value as the int8 code
// q = round(x / scale) (nearest, ties to even), clamped to [-127, 127], read back as q * scale.
// A packed run is its n codes, padded to 4 bytes, then its scales in block order. The rules are
// __host__ __device__ helpers, so the host's loops (ops/cpu/int8_blocks.hpp) and the device's
// kernels (ops/cuda/int8_blocks.cuh) give the same bits.

#include <cmath>
#include <cstdint>

#include <zero/core/macros.hpp>

namespace zero::quant {

/// Values a block of one scale covers.
inline constexpr std::int64_t int8_block = 256;

/// Blocks of a run of n values.
constexpr std::int64_t int8_blocks(std::int64_t n) {
  return (n + int8_block - 1) / int8_block;
}
/// Where a packed run's scales start: its n codes, padded to 4 bytes.
constexpr std::int64_t int8_scales_offset(std::int64_t n) {
  return (n + 3) / 4 * 4;
}
/// Bytes a packed run of n values takes.
constexpr std::int64_t int8_packed_bytes(std::int64_t n) {
  return int8_scales_offset(n) + 4 * int8_blocks(n);
}

/// A block's scale from its largest magnitude.
ZERO_HOST_DEVICE float int8_scale(float absmax) {
  return absmax / 127.0f;
}
/// x's code under scale (0 for a block of zeros).
ZERO_HOST_DEVICE std::int8_t int8_code(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float q = rintf(x / scale);
  return static_cast<std::int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
}
/// The value a code stands for under scale.
ZERO_HOST_DEVICE float int8_value(std::int8_t q, float scale) {
  return static_cast<float>(q) * scale;
}

}  // namespace zero::quant
