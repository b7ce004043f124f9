#pragma once
// zero-requires: cuda
// Block-wise int4 quantization on the GPU (DeepSpeed's width for ZeRO++'s quantized gradients):
// the device twins of ops/cpu/int4_blocks.hpp, with core/int4_blocks.hpp's rules and layout, so
// the bits are the host's. Quantizing: one thread block per quantization block (int4_block
// threads, one value each; blockIdx.y the run): cub::BlockReduce takes the block's largest
// magnitude, each thread its code, and each even thread writes its pair's byte with its odd
// neighbour's code (a warp shuffle; past the run's end a code is 0, the padding nibble). Reading
// back and summing runs are int8_blocks.cuh's kernels over Int4Codes. Launchers take the stream
// last and check cudaGetLastError().

#if !defined(__CUDACC__)
#error "zero/ops/cuda/int4_blocks.cuh needs nvcc; host-only code includes ops/cpu/int4_blocks.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/core/int4_blocks.hpp>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/int8_blocks.cuh>

namespace zero::ops::cuda {

inline constexpr int int4_block_threads = static_cast<int>(quant::int4_block);

/// One quantization block of int4 packed run blockIdx.y a thread block: its scale and its code
/// bytes into that run's place of out, from in's run quant::int8_source_run(blockIdx.y, runs,
/// columns).
template <class T>
__global__ void __launch_bounds__(int4_block_threads)
    quantize_int4_kernel(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                         std::int64_t columns) {
  using Reduce = cub::BlockReduce<float, int4_block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  in += quant::int8_source_run(blockIdx.y, runs, columns) * n;
  out += static_cast<std::int64_t>(blockIdx.y) * quant::int4_packed_bytes(n);
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * quant::int4_block + threadIdx.x;
  const float x = i < n ? load(in[i]) : 0.0f;
  const float absmax = Reduce(temp).Reduce(fabsf(x), [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) {
    // fmaxf skips a NaN but gives one for a block of NaNs alone; the host gives 0.
    scale = quant::int4_scale(fmaxf(absmax, 0.0f));
    reinterpret_cast<float*>(out + quant::int4_scales_offset(n))[blockIdx.x] = scale;
  }
  __syncthreads();
  const std::int8_t code = i < n ? quant::int4_code(x, scale) : std::int8_t{0};
  const int odd = __shfl_down_sync(0xffffffffu, static_cast<int>(code), 1);
  if (i < n && i % 2 == 0) {
    out[i / 2] = quant::int4_pair(code, static_cast<std::int8_t>(odd));
  }
}

/// int4 packed runs for the reading kernels of int8_blocks.cuh.
struct Int4Codes {
  __host__ __device__ static std::int64_t packed_bytes(std::int64_t n) {
    return quant::int4_packed_bytes(n);
  }
  __host__ __device__ static std::int64_t scales_offset(std::int64_t n) {
    return quant::int4_scales_offset(n);
  }
  __device__ static std::int8_t code(const std::uint8_t* run, std::int64_t i) {
    return quant::int4_code_at(run, i);
  }
};

// ---- launchers ----------------------------------------------------------------------------------

/// out (runs * int4_packed_bytes(n) bytes, 4-byte aligned) = in's `runs` runs of n values, each
/// packed as int4, on stream; with columns > 1 taken column by column from rows of `columns` runs
/// (quant::int8_source_run).
template <class T>
void quantize_int4_blocks(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                          std::int64_t columns, cudaStream_t stream) {
  static_assert(is_device_float<T>, "quantize_int4_blocks: f32, bf16 and f16 on the device");
  if (n == 0 || runs == 0) return;
  expect_int_range(n, "quantize_int4_blocks");
  expect<ShapeError>(runs <= 65535, "quantize_int4_blocks: ", runs,
                     " runs (a grid's y extent is at most 65535)");
  const dim3 grid(static_cast<unsigned>(quant::int4_blocks(n)), static_cast<unsigned>(runs));
  quantize_int4_kernel<T><<<grid, int4_block_threads, 0, stream>>>(in, out, n, runs, columns);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out's runs * n values = what the `runs` int4 packed runs in (runs * int4_packed_bytes(n)
/// bytes, 4-byte aligned) stand for, on stream.
template <class T>
void dequantize_int4_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t runs,
                            cudaStream_t stream) {
  detail::dequantize_blocks<Int4Codes>(in, out, n, runs, stream, "dequantize_int4_blocks");
}

/// out's outputs * n values = factor * the sums of run o of each of in's `blocks` blocks of
/// `outputs` int4 packed runs (each int4_packed_bytes(n) bytes, 4-byte aligned), added in f32 in
/// block order, on stream.
template <class T>
void sum_int4_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t outputs,
                     std::int64_t blocks, float factor, cudaStream_t stream) {
  detail::sum_blocks<Int4Codes>(in, out, n, outputs, blocks, factor, stream, "sum_int4_blocks");
}

}  // namespace zero::ops::cuda
