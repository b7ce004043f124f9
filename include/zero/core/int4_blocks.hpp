#pragma once
// Block-wise symmetric int4 quantization, the width DeepSpeed's ZeRO++ sends quantized gradients
// at (qgZ's hierarchical all-to-all): core/int8_blocks.hpp's blocks with 4-bit codes. A run of n
// values is cut into blocks of int4_block elements (the last one maybe shorter); a block keeps one
// fp32 scale, its largest magnitude / 7, and each value as the code q = round(x / scale)
// (nearest, ties to even), clamped to [-7, 7], read back as q * scale. Two codes share a byte,
// value 2k in its low nibble and 2k + 1 in its high one (4-bit two's complement); a run of odd n
// has 0 in its last byte's high nibble. A packed run is its (n + 1) / 2 code bytes, padded to 4
// bytes, then its scales in block order; runs of the same n follow each other. Sums of runs add
// the values as int8 runs do (quant::int8_add_value). The rules are __host__ __device__ helpers,
// so the host's kernels (ops/cpu/int4_blocks.hpp) and the device's (ops/cuda/int4_blocks.cuh)
// give the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>

#include <zero/core/int8_blocks.hpp>
#include <zero/core/macros.hpp>

namespace zero::quant {

/// Values a block of one scale covers (as int8's).
inline constexpr std::int64_t int4_block = int8_block;
/// The largest code's magnitude.
inline constexpr float int4_max_code = 7.0f;

/// Blocks of a run of n values.
constexpr std::int64_t int4_blocks(std::int64_t n) {
  return int8_blocks(n);
}
/// Where a packed run's scales start: its (n + 1) / 2 code bytes, padded to 4 bytes.
constexpr std::int64_t int4_scales_offset(std::int64_t n) {
  return ((n + 1) / 2 + 3) / 4 * 4;
}
/// Bytes a packed run of n values takes.
constexpr std::int64_t int4_packed_bytes(std::int64_t n) {
  return int4_scales_offset(n) + 4 * int4_blocks(n);
}

/// A block's scale from its largest magnitude.
ZERO_HOST_DEVICE float int4_scale(float absmax) {
  return absmax / int4_max_code;
}
/// x's code under scale (0 for a block of zeros; a NaN quotient gives -7, as fmaxf takes it).
ZERO_HOST_DEVICE std::int8_t int4_code(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float q = rintf(x / scale);
  return static_cast<std::int8_t>(fminf(fmaxf(q, -int4_max_code), int4_max_code));
}
/// The byte of two codes, even in the low nibble.
ZERO_HOST_DEVICE std::uint8_t int4_pair(std::int8_t even, std::int8_t odd) {
  return static_cast<std::uint8_t>((even & 0xf) | ((odd & 0xf) << 4));
}
/// Code i of a run's code bytes.
ZERO_HOST_DEVICE std::int8_t int4_code_at(const std::uint8_t* codes, std::int64_t i) {
  const int nibble = (codes[i >> 1] >> ((i & 1) * 4)) & 0xf;
  return static_cast<std::int8_t>((nibble ^ 8) - 8);
}

/// A packed run's scale of its block b (the run holding n values).
inline float int4_scale_at(const std::uint8_t* run, std::int64_t n, std::int64_t b) {
  float scale;
  std::memcpy(&scale, run + int4_scales_offset(n) + 4 * b, 4);
  return scale;
}

/// Checks that `values` values cut into `runs` equal runs (rows of `columns` runs, for a packing
/// column by column) pack as int4 into `bytes` bytes, with a ShapeError naming op otherwise;
/// returns a run's values.
inline std::int64_t int4_run_values(const char* op, std::int64_t values, std::int64_t runs,
                                    std::int64_t bytes, std::int64_t columns = 1) {
  return detail::packed_run_values(op, values, runs, bytes, columns, &int4_packed_bytes,
                                   " as int4");
}

/// Checks that `values` values in `outputs` runs are summed from `bytes` bytes of whole blocks of
/// `outputs` int4 packed runs (at least one block), with a ShapeError naming op otherwise; returns
/// a run's values.
inline std::int64_t int4_sum_values(const char* op, std::int64_t values, std::int64_t outputs,
                                    std::int64_t bytes) {
  return detail::packed_sum_values(op, values, outputs, bytes, &int4_packed_bytes, " int4");
}

}  // namespace zero::quant
