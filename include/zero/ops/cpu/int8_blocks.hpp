#pragma once
// Block-wise int8 quantization on the host (ZeRO++'s quantized weights and gradients): packs runs
// of values as core/int8_blocks.hpp lays them out, reads packed runs back, and sums packed runs
// (the reduction of qgZ's exchange). The device's twins are in ops/cuda/int8_blocks.cuh, with the
// same rules and bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/int8_blocks.hpp>

namespace zero::ops::cpu {

namespace detail {

// Checks that `values` values in `runs` equal runs pack into `bytes` bytes; returns a run's values.
inline std::int64_t int8_run_values(const char* op, std::int64_t values, std::int64_t runs,
                                    std::int64_t bytes) {
  expect<ShapeError>(runs > 0 && values % runs == 0, op, ": ", values, " values do not split into ",
                     runs, " equal runs");
  const std::int64_t n = values / runs;
  expect<ShapeError>(bytes == runs * quant::int8_packed_bytes(n), op, ": ", values, " values",
                     runs == 1 ? std::string() : " in " + std::to_string(runs) + " runs",
                     " pack into ", runs * quant::int8_packed_bytes(n), " bytes, not ", bytes);
  return n;
}

// Checks that `values` values in `outputs` runs are summed from whole blocks of `outputs` packed
// runs, `bytes` bytes (at least one block); returns a run's values.
inline std::int64_t int8_sum_values(const char* op, std::int64_t values, std::int64_t outputs,
                                    std::int64_t bytes) {
  expect<ShapeError>(outputs > 0 && values % outputs == 0, op, ": ", values,
                     " values do not split into ", outputs, " equal runs");
  const std::int64_t n = values / outputs;
  const std::int64_t block = outputs * quant::int8_packed_bytes(n);
  expect<ShapeError>(
      block > 0 ? bytes > 0 && bytes % block == 0 : bytes == 0, op, ": ", bytes,
      " bytes are not whole runs of ", n, " values (", quant::int8_packed_bytes(n), " bytes each)",
      outputs == 1 ? std::string() : " in blocks of " + std::to_string(outputs) + " runs");
  return n;
}

// A packed run's scale of block b.
inline float int8_scale_of(const std::uint8_t* run, std::int64_t n, std::int64_t b) {
  float scale;
  std::memcpy(&scale, run + quant::int8_scales_offset(n) + 4 * b, 4);
  return scale;
}

}  // namespace detail

/// out = in cut into `runs` equal runs, each packed as int8 codes and one fp32 scale a block, one
/// packed run after another (out: runs * int8_packed_bytes(in.size() / runs) bytes). With
/// columns > 1, in's runs are rows of `columns` runs and out takes them column by column: packed
/// run j is in's run quant::int8_source_run(j, runs, columns) (qgZ's first hop sends each rank
/// of a node the runs of the shards at its place in every node).
template <class T>
void quantize_int8_blocks(std::span<const T> in, std::span<std::uint8_t> out, std::int64_t runs = 1,
                          std::int64_t columns = 1) {
  const std::int64_t n =
      detail::int8_run_values("quantize_int8_blocks", static_cast<std::int64_t>(in.size()), runs,
                              static_cast<std::int64_t>(out.size()));
  expect<ShapeError>(columns > 0 && runs % columns == 0, "quantize_int8_blocks: ", runs,
                     " runs are not rows of ", columns);
  for (std::int64_t j = 0; j < runs; ++j) {
    const T* x = in.data() + quant::int8_source_run(j, runs, columns) * n;
    std::uint8_t* run = out.data() + j * quant::int8_packed_bytes(n);
    for (std::int64_t b = 0; b < quant::int8_blocks(n); ++b) {
      const std::int64_t first = b * quant::int8_block;
      const std::int64_t last = std::min(n, first + quant::int8_block);
      float absmax = 0;
      for (std::int64_t i = first; i < last; ++i) {
        absmax = std::max(absmax, std::fabs(convert<float>(x[i])));
      }
      const float scale = quant::int8_scale(absmax);
      std::memcpy(run + quant::int8_scales_offset(n) + 4 * b, &scale, 4);
      for (std::int64_t i = first; i < last; ++i) {
        const std::int8_t q = quant::int8_code(convert<float>(x[i]), scale);
        std::memcpy(run + i, &q, 1);
      }
    }
  }
}

/// out = the values `runs` packed runs stand for, one run's after another (in:
/// runs * int8_packed_bytes(out.size() / runs) bytes).
template <class T>
void dequantize_int8_blocks(std::span<const std::uint8_t> in, std::span<T> out,
                            std::int64_t runs = 1) {
  const std::int64_t n =
      detail::int8_run_values("dequantize_int8_blocks", static_cast<std::int64_t>(out.size()), runs,
                              static_cast<std::int64_t>(in.size()));
  for (std::int64_t r = 0; r < runs; ++r) {
    const std::uint8_t* run = in.data() + r * quant::int8_packed_bytes(n);
    T* y = out.data() + r * n;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto q = static_cast<std::int8_t>(run[i]);
      y[i] = convert<T>(quant::int8_value(q, detail::int8_scale_of(run, n, i / quant::int8_block)));
    }
  }
}

/// out = factor * the sums of the packed runs in, added in f32 in run order
/// (quant::int8_add_value) and rounded to T once: qgZ's reduction of what every rank sent for
/// this rank's shard, with factor 1 / ranks for their mean. out holds `outputs` runs of
/// n = out.size() / outputs values, and in a whole number of blocks of `outputs` packed runs
/// (at least one); out's run o sums run o of every block.
template <class T>
void sum_int8_blocks(std::span<const std::uint8_t> in, std::span<T> out, float factor,
                     std::int64_t outputs = 1) {
  const std::int64_t n =
      detail::int8_sum_values("sum_int8_blocks", static_cast<std::int64_t>(out.size()), outputs,
                              static_cast<std::int64_t>(in.size()));
  if (n == 0) return;
  const std::int64_t packed = quant::int8_packed_bytes(n);
  const auto blocks = static_cast<std::int64_t>(in.size()) / (packed * outputs);
  for (std::int64_t o = 0; o < outputs; ++o) {
    for (std::int64_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::uint8_t* run = in.data() + (b * outputs + o) * packed;
        sum = quant::int8_add_value(sum, static_cast<std::int8_t>(run[i]),
                                    detail::int8_scale_of(run, n, i / quant::int8_block));
      }
      out[static_cast<std::size_t>(o * n + i)] = convert<T>(sum * factor);
    }
  }
}

}  // namespace zero::ops::cpu
