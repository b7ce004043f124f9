#pragma once
// Block-wise symmetric int8 quantization, the packing ZeRO++'s quantized weights (qwZ) gather
// and its quantized gradients (qgZ) exchange: a run of n values is cut into blocks of int8_block
// elements (the last one maybe shorter); a block keeps one fp32 scale, its largest magnitude / 127,
// and each value as the int8 code q = round(x / scale) (nearest, ties to even), clamped to [-127,
// 127], read back as q * scale. A packed run is its n codes, padded to 4 bytes, then its scales in
// block order; runs of the same n follow each other (every packed size is a multiple of 4, so each
// run's scales stay aligned). A sum of runs (qgZ's reduction) adds their values in f32 in run
// order, each with one fused multiply-add (int8_add_value). The rules are __host__ __device__
// helpers, so the host's loops (ops/cpu/int8_blocks.hpp) and the device's kernels
// (ops/cuda/int8_blocks.cuh) give the same bits; the size checks are the host's and the device
// backend's alike (int8_run_values, int8_sum_values).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include <zero/core/error.hpp>
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

/// A packed run's scale of its block b (the run holding n values).
inline float int8_scale_at(const std::uint8_t* run, std::int64_t n, std::int64_t b) {
  float scale;
  std::memcpy(&scale, run + int8_scales_offset(n) + 4 * b, 4);
  return scale;
}

namespace detail {

// The checks of int8_run_values and its int4 twin: `packed` gives a run's bytes, `as` names the
// width in the message (empty for int8).
inline std::int64_t packed_run_values(const char* op, std::int64_t values, std::int64_t runs,
                                      std::int64_t bytes, std::int64_t columns,
                                      std::int64_t (*packed)(std::int64_t), const char* as) {
  expect<ShapeError>(runs > 0 && values % runs == 0, op, ": ", values, " values do not split into ",
                     runs, " equal runs");
  expect<ShapeError>(columns > 0 && runs % columns == 0, op, ": ", runs, " runs are not rows of ",
                     columns);
  const std::int64_t n = values / runs;
  expect<ShapeError>(bytes == runs * packed(n), op, ": ", values, " values",
                     runs == 1 ? std::string() : " in " + std::to_string(runs) + " runs", " pack",
                     as, " into ", runs * packed(n), " bytes, not ", bytes);
  return n;
}

// The checks of int8_sum_values and its int4 twin.
inline std::int64_t packed_sum_values(const char* op, std::int64_t values, std::int64_t outputs,
                                      std::int64_t bytes, std::int64_t (*packed)(std::int64_t),
                                      const char* as) {
  expect<ShapeError>(outputs > 0 && values % outputs == 0, op, ": ", values,
                     " values do not split into ", outputs, " equal runs");
  const std::int64_t n = values / outputs;
  const std::int64_t block = outputs * packed(n);
  expect<ShapeError>(
      block > 0 ? bytes > 0 && bytes % block == 0 : bytes == 0, op, ": ", bytes,
      " bytes are not whole", as, " runs of ", n, " values (", packed(n), " bytes each)",
      outputs == 1 ? std::string() : " in blocks of " + std::to_string(outputs) + " runs");
  return n;
}

}  // namespace detail

/// Checks that `values` values cut into `runs` equal runs (rows of `columns` runs, for a packing
/// column by column) pack into `bytes` bytes, with a ShapeError naming op otherwise; returns a
/// run's values.
inline std::int64_t int8_run_values(const char* op, std::int64_t values, std::int64_t runs,
                                    std::int64_t bytes, std::int64_t columns = 1) {
  return detail::packed_run_values(op, values, runs, bytes, columns, &int8_packed_bytes, "");
}

/// Checks that `values` values in `outputs` runs are summed from `bytes` bytes of whole blocks of
/// `outputs` packed runs (at least one block), with a ShapeError naming op otherwise; returns a
/// run's values.
inline std::int64_t int8_sum_values(const char* op, std::int64_t values, std::int64_t outputs,
                                    std::int64_t bytes) {
  return detail::packed_sum_values(op, values, outputs, bytes, &int8_packed_bytes, "");
}

/// The source run that packed run j takes when `runs` runs, rows of `columns`, are packed
/// column by column (columns 1: run j).
ZERO_HOST_DEVICE constexpr std::int64_t int8_source_run(std::int64_t j, std::int64_t runs,
                                                        std::int64_t columns) {
  const std::int64_t rows = runs / columns;
  return (j % rows) * columns + j / rows;
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
/// sum + the value of code q under scale, rounded once: an explicit fused multiply-add on the host
/// and the device alike, so no compiler's contraction makes a sum of runs differ between them.
ZERO_HOST_DEVICE float int8_add_value(float sum, std::int8_t q, float scale) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(static_cast<float>(q), scale, sum);
#else
  return std::fma(static_cast<float>(q), scale, sum);
#endif
}

}  // namespace zero::quant
