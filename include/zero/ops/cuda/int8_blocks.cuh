#pragma once
// zero-requires: cuda
// Block-wise int8 quantization on the GPU (ZeRO++'s quantized weights): the device twins of
// ops/cpu/int8_blocks.hpp, with core/int8_blocks.hpp's rules and layout, so the bits are the
// host's. Quantizing: one thread block per quantization block (int8_block threads, one value
// each): cub::BlockReduce takes the block's largest magnitude, the scale is written once, and
// every thread writes its code. Reading back: grid-stride, one value a thread. Launchers take the
// stream last and check cudaGetLastError().
#if !defined(__CUDACC__)
#error "zero/ops/cuda/int8_blocks.cuh needs nvcc; host-only code includes ops/cpu/int8_blocks.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/core/int8_blocks.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

inline constexpr int int8_block_threads = static_cast<int>(quant::int8_block);

/// One quantization block a thread block: its scale and its codes into out (packed as
/// core/int8_blocks.hpp lays a run of n values out).
template <class T>
__global__ void __launch_bounds__(int8_block_threads)
    quantize_int8_kernel(const T* in, std::uint8_t* out, std::int64_t n) {
  using Reduce = cub::BlockReduce<float, int8_block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * quant::int8_block + threadIdx.x;
  const float x = i < n ? load(in[i]) : 0.0f;
  const float absmax = Reduce(temp).Reduce(fabsf(x), [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) {
    scale = quant::int8_scale(absmax);
    reinterpret_cast<float*>(out + quant::int8_scales_offset(n))[blockIdx.x] = scale;
  }
  __syncthreads();
  if (i < n) out[i] = static_cast<std::uint8_t>(quant::int8_code(x, scale));
}

/// out[i] = the value of code i under its block's scale.
template <class T>
__global__ void dequantize_int8_kernel(const std::uint8_t* in, T* out, std::int64_t n) {
  const float* scales = reinterpret_cast<const float*>(in + quant::int8_scales_offset(n));
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const auto q = static_cast<std::int8_t>(in[i]);
    out[i] = store<T>(quant::int8_value(q, scales[i / quant::int8_block]));
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out (int8_packed_bytes(n) bytes, 4-byte aligned) = in's n values packed, on stream.
template <class T>
void quantize_int8_blocks(const T* in, std::uint8_t* out, std::int64_t n, cudaStream_t stream) {
  static_assert(is_device_float<T>, "quantize_int8_blocks: f32, bf16 and f16 on the device");
  if (n == 0) return;
  expect_int_range(n, "quantize_int8_blocks");
  const auto blocks = static_cast<unsigned>(quant::int8_blocks(n));
  quantize_int8_kernel<T><<<blocks, int8_block_threads, 0, stream>>>(in, out, n);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out's n values = what the packed run in (int8_packed_bytes(n) bytes, 4-byte aligned) stands
/// for, on stream.
template <class T>
void dequantize_int8_blocks(const std::uint8_t* in, T* out, std::int64_t n, cudaStream_t stream) {
  static_assert(is_device_float<T>, "dequantize_int8_blocks: f32, bf16 and f16 on the device");
  if (n == 0) return;
  expect_int_range(n, "dequantize_int8_blocks");
  dequantize_int8_kernel<T><<<grid_for(n), elementwise_threads, 0, stream>>>(in, out, n);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
