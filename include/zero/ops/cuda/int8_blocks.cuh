#pragma once
// zero-requires: cuda
// Block-wise int8 quantization on the GPU (ZeRO++'s quantized weights and gradients): the device
// twins of ops/cpu/int8_blocks.hpp, with core/int8_blocks.hpp's rules and layout, so the bits are
// the host's. Quantizing: one thread block per quantization block (int8_block threads, one value
// each; blockIdx.y the run): cub::BlockReduce takes the block's largest magnitude, the scale is
// written once, and every thread writes its code. Reading back: grid-stride over every run's
// values, one a thread. Summing runs: grid-stride over the outputs' values, each thread adding its
// value of every block's run in block order with quant::int8_add_value. The reading kernels take
// the packing as a Codes type (Int8Codes here; int4_blocks.cuh's Int4Codes). Launchers take the
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

/// One quantization block of packed run blockIdx.y a thread block: its scale and its codes into
/// that run's place of out (each run of n values packed as core/int8_blocks.hpp lays it out), from
/// in's run quant::int8_source_run(blockIdx.y, runs, columns).
template <class T>
__global__ void __launch_bounds__(int8_block_threads)
    quantize_int8_kernel(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                         std::int64_t columns) {
  using Reduce = cub::BlockReduce<float, int8_block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  in += quant::int8_source_run(blockIdx.y, runs, columns) * n;
  out += static_cast<std::int64_t>(blockIdx.y) * quant::int8_packed_bytes(n);
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * quant::int8_block + threadIdx.x;
  const float x = i < n ? load(in[i]) : 0.0f;
  const float absmax = Reduce(temp).Reduce(fabsf(x), [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) {
    // fmaxf skips a NaN but gives one for a block of NaNs alone; the host gives 0.
    scale = quant::int8_scale(fmaxf(absmax, 0.0f));
    reinterpret_cast<float*>(out + quant::int8_scales_offset(n))[blockIdx.x] = scale;
  }
  __syncthreads();
  if (i < n) out[i] = static_cast<std::uint8_t>(quant::int8_code(x, scale));
}

/// int8 packed runs for the reading kernels below: a run's bytes, where its scales start, its
/// code i. ops/cuda/int4_blocks.cuh gives int4's (Int4Codes) to the same kernels.
struct Int8Codes {
  __host__ __device__ static std::int64_t packed_bytes(std::int64_t n) {
    return quant::int8_packed_bytes(n);
  }
  __host__ __device__ static std::int64_t scales_offset(std::int64_t n) {
    return quant::int8_scales_offset(n);
  }
  __device__ static std::int8_t code(const std::uint8_t* run, std::int64_t i) {
    return static_cast<std::int8_t>(run[i]);
  }
};

/// out[r * n + i] = the value of run r's code i under its block's scale, for `runs` runs packed
/// as Codes says.
template <class Codes, class T>
__global__ void dequantize_blocks_kernel(const std::uint8_t* in, T* out, std::int64_t n,
                                         std::int64_t runs) {
  const std::int64_t packed = Codes::packed_bytes(n);
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       k < runs * n; k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = k / n, i = k - r * n;
    const std::uint8_t* run = in + r * packed;
    const float* scales = reinterpret_cast<const float*>(run + Codes::scales_offset(n));
    out[k] = store<T>(quant::int8_value(Codes::code(run, i), scales[i / quant::int8_block]));
  }
}

/// out[o * n + i] = factor * the sum over the `blocks` blocks of their run o's value i, added in
/// f32 in block order (in: blocks of `outputs` runs packed as Codes says).
template <class Codes, class T>
__global__ void sum_blocks_kernel(const std::uint8_t* in, T* out, std::int64_t n,
                                  std::int64_t outputs, std::int64_t blocks, float factor) {
  const std::int64_t packed = Codes::packed_bytes(n);
  const std::int64_t scales_at = Codes::scales_offset(n);
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       k < outputs * n; k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t o = k / n, i = k - o * n;
    float sum = 0.0f;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::uint8_t* run = in + (b * outputs + o) * packed;
      const float scale = reinterpret_cast<const float*>(run + scales_at)[i / quant::int8_block];
      sum = quant::int8_add_value(sum, Codes::code(run, i), scale);
    }
    out[k] = store<T>(__fmul_rn(sum, factor));
  }
}

namespace detail {

// The launches of the reading kernels for runs packed as Codes says; op names the caller.
template <class Codes, class T>
void dequantize_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t runs,
                       cudaStream_t stream, const char* op) {
  static_assert(is_device_float<T>, "dequantizing blocks: f32, bf16 and f16 on the device");
  if (n == 0 || runs == 0) return;
  expect_int_range(n, op);
  dequantize_blocks_kernel<Codes, T>
      <<<grid_for(runs * n), elementwise_threads, 0, stream>>>(in, out, n, runs);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

template <class Codes, class T>
void sum_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t outputs,
                std::int64_t blocks, float factor, cudaStream_t stream, const char* op) {
  static_assert(is_device_float<T>, "summing blocks: f32, bf16 and f16 on the device");
  if (n == 0 || outputs == 0) return;
  expect_int_range(n, op);
  sum_blocks_kernel<Codes, T><<<grid_for(outputs * n), elementwise_threads, 0, stream>>>(
      in, out, n, outputs, blocks, factor);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

// ---- launchers ----------------------------------------------------------------------------------

/// out (runs * int8_packed_bytes(n) bytes, 4-byte aligned) = in's `runs` runs of n values, each
/// packed, on stream; with columns > 1 taken column by column from rows of `columns` runs
/// (quant::int8_source_run).
template <class T>
void quantize_int8_blocks(const T* in, std::uint8_t* out, std::int64_t n, std::int64_t runs,
                          std::int64_t columns, cudaStream_t stream) {
  static_assert(is_device_float<T>, "quantize_int8_blocks: f32, bf16 and f16 on the device");
  if (n == 0 || runs == 0) return;
  expect_int_range(n, "quantize_int8_blocks");
  expect<ShapeError>(runs <= 65535, "quantize_int8_blocks: ", runs,
                     " runs (a grid's y extent is at most 65535)");
  const dim3 grid(static_cast<unsigned>(quant::int8_blocks(n)), static_cast<unsigned>(runs));
  quantize_int8_kernel<T><<<grid, int8_block_threads, 0, stream>>>(in, out, n, runs, columns);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out's runs * n values = what the `runs` packed runs in (runs * int8_packed_bytes(n) bytes,
/// 4-byte aligned) stand for, on stream.
template <class T>
void dequantize_int8_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t runs,
                            cudaStream_t stream) {
  detail::dequantize_blocks<Int8Codes>(in, out, n, runs, stream, "dequantize_int8_blocks");
}

/// out's outputs * n values = factor * the sums of run o of each of in's `blocks` blocks of
/// `outputs` packed runs (each int8_packed_bytes(n) bytes, 4-byte aligned), added in f32 in
/// block order, on stream (ZeRO++'s quantized gradients).
template <class T>
void sum_int8_blocks(const std::uint8_t* in, T* out, std::int64_t n, std::int64_t outputs,
                     std::int64_t blocks, float factor, cudaStream_t stream) {
  detail::sum_blocks<Int8Codes>(in, out, n, outputs, blocks, factor, stream, "sum_int8_blocks");
}

}  // namespace zero::ops::cuda
