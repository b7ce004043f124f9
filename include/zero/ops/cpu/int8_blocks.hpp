#pragma once
// Block-wise int8 quantization on the host (ZeRO++'s quantized weights): packs a run of values
// as core/int8_blocks.hpp lays it out, and reads a packed run back. The device's twins are in
// ops/cuda/int8_blocks.cuh, with the same rules and bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/int8_blocks.hpp>

namespace zero::ops::cpu {

/// out = in packed as int8 codes and one fp32 scale a block (out: int8_packed_bytes(in.size())).
template <class T>
void quantize_int8_blocks(std::span<const T> in, std::span<std::uint8_t> out) {
  const auto n = static_cast<std::int64_t>(in.size());
  expect<ShapeError>(static_cast<std::int64_t>(out.size()) == quant::int8_packed_bytes(n),
                     "quantize_int8_blocks: ", n, " values pack into ", quant::int8_packed_bytes(n),
                     " bytes, not ", out.size());
  std::uint8_t* scales = out.data() + quant::int8_scales_offset(n);
  for (std::int64_t b = 0; b < quant::int8_blocks(n); ++b) {
    const std::int64_t first = b * quant::int8_block, last = std::min(n, first + quant::int8_block);
    float absmax = 0;
    for (std::int64_t i = first; i < last; ++i) {
      absmax = std::max(absmax, std::fabs(convert<float>(in[static_cast<std::size_t>(i)])));
    }
    const float scale = quant::int8_scale(absmax);
    std::memcpy(scales + 4 * b, &scale, 4);
    for (std::int64_t i = first; i < last; ++i) {
      const std::int8_t q =
          quant::int8_code(convert<float>(in[static_cast<std::size_t>(i)]), scale);
      std::memcpy(out.data() + i, &q, 1);
    }
  }
}

/// out = the values a packed run stands for (in: int8_packed_bytes(out.size()) bytes).
template <class T>
void dequantize_int8_blocks(std::span<const std::uint8_t> in, std::span<T> out) {
  const auto n = static_cast<std::int64_t>(out.size());
  expect<ShapeError>(static_cast<std::int64_t>(in.size()) == quant::int8_packed_bytes(n),
                     "dequantize_int8_blocks: ", n, " values pack into ",
                     quant::int8_packed_bytes(n), " bytes, not ", in.size());
  const std::uint8_t* scales = in.data() + quant::int8_scales_offset(n);
  for (std::int64_t b = 0; b < quant::int8_blocks(n); ++b) {
    float scale;
    std::memcpy(&scale, scales + 4 * b, 4);
    const std::int64_t first = b * quant::int8_block, last = std::min(n, first + quant::int8_block);
    for (std::int64_t i = first; i < last; ++i) {
      std::int8_t q;
      std::memcpy(&q, in.data() + i, 1);
      out[static_cast<std::size_t>(i)] = convert<T>(quant::int8_value(q, scale));
    }
  }
}

}  // namespace zero::ops::cpu
