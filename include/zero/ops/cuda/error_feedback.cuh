#pragma once
// zero-requires: cuda
// Packing with error feedback on the GPU (ZeRO++'s LoCo): the device twin of
// ops/cpu/error_feedback.hpp, with core/error_feedback.hpp's rules and the int8/int4 layouts, so
// the bits are the host's. One thread block per quantization block (one value a thread; blockIdx.y
// the packed run): each thread adds its value's kept error, cub::BlockReduce takes the block's
// largest magnitude for the packing's scale, each thread writes its code (int4: each even thread
// its pair's byte, after a warp shuffle), then takes its next error, a second BlockReduce its
// scale, and each thread writes its error's int8 code in place. The launcher takes the stream last
// and checks cudaGetLastError().
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/error_feedback.cuh needs nvcc; host-only code includes ops/cpu/error_feedback.hpp"
#endif

#include <cstdint>

#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/core/error_feedback.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/int8_blocks.cuh>

namespace zero::ops::cuda {

/// One quantization block of packed run blockIdx.y (Bits 8 or 4) a thread block, with error
/// feedback: the block of in's run quant::int8_source_run(blockIdx.y, runs, columns) plus its
/// kept error (error: `runs` int8 packed runs in source order) packed into that run's place of
/// out, and its next error kept in place.
template <int Bits, class T>
__global__ void __launch_bounds__(int8_block_threads)
    quantize_feedback_kernel(const T* in, std::uint8_t* out, std::uint8_t* error,
                             quant::ErrorFeedback feedback, std::int64_t n, std::int64_t runs,
                             std::int64_t columns) {
  using Reduce = cub::BlockReduce<float, int8_block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale, next_scale;
  const std::int64_t source = quant::int8_source_run(blockIdx.y, runs, columns);
  in += source * n;
  std::uint8_t* kept = error + source * quant::int8_packed_bytes(n);
  float* kept_scales = reinterpret_cast<float*>(kept + quant::int8_scales_offset(n));
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * quant::int8_block + threadIdx.x;
  const bool here = i < n;
  const float kept_scale = kept_scales[blockIdx.x];
  const auto kept_code = here ? static_cast<std::int8_t>(kept[i]) : std::int8_t{0};
  const float c = here ? quant::compensated(load(in[i]), kept_code, kept_scale) : 0.0f;
  const float absmax = Reduce(temp).Reduce(fabsf(c), [](float a, float b) { return fmaxf(a, b); });
  if constexpr (Bits == 8) {
    out += static_cast<std::int64_t>(blockIdx.y) * quant::int8_packed_bytes(n);
    if (threadIdx.x == 0) {
      // fmaxf skips a NaN but gives one for a block of NaNs alone; the host gives 0.
      scale = quant::int8_scale(fmaxf(absmax, 0.0f));
      reinterpret_cast<float*>(out + quant::int8_scales_offset(n))[blockIdx.x] = scale;
    }
  } else {
    out += static_cast<std::int64_t>(blockIdx.y) * quant::int4_packed_bytes(n);
    if (threadIdx.x == 0) {
      // fmaxf skips a NaN but gives one for a block of NaNs alone; the host gives 0.
      scale = quant::int4_scale(fmaxf(absmax, 0.0f));
      reinterpret_cast<float*>(out + quant::int4_scales_offset(n))[blockIdx.x] = scale;
    }
  }
  __syncthreads();  // scale is written; temp is free again; every kept_scale is read
  std::int8_t code = 0;
  if constexpr (Bits == 8) {
    if (here) {
      code = quant::int8_code(c, scale);
      out[i] = static_cast<std::uint8_t>(code);
    }
  } else {
    if (here) code = quant::int4_code(c, scale);
    const int odd = __shfl_down_sync(0xffffffffu, static_cast<int>(code), 1);
    if (here && i % 2 == 0) out[i / 2] = quant::int4_pair(code, static_cast<std::int8_t>(odd));
  }
  const float next =
      here ? quant::next_error(quant::int8_value(kept_code, kept_scale), c, code, scale, feedback)
           : 0.0f;
  const float next_max =
      Reduce(temp).Reduce(fabsf(next), [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) {
    next_scale = quant::int8_scale(next_max);
    kept_scales[blockIdx.x] = next_scale;
  }
  __syncthreads();
  if (here) kept[i] = static_cast<std::uint8_t>(quant::int8_code(next, next_scale));
}

// ---- launcher -----------------------------------------------------------------------------------

/// out (runs * the packed bytes of a run of n values at `bits`, 8 or 4; 4-byte aligned) = in's
/// `runs` runs of n values, each packed after adding the error kept for it in error (runs *
/// int8_packed_bytes(n) bytes, the runs in source order; zeroed for none), which then holds the
/// next error (core/error_feedback.hpp), on stream; with columns > 1 taken column by column from
/// rows of `columns` runs (quant::int8_source_run).
template <class T>
void quantize_with_feedback(const T* in, std::uint8_t* out, std::uint8_t* error,
                            quant::ErrorFeedback feedback, int bits, std::int64_t n,
                            std::int64_t runs, std::int64_t columns, cudaStream_t stream) {
  static_assert(is_device_float<T>, "quantize_with_feedback: f32, bf16 and f16 on the device");
  expect<ShapeError>(bits == 8 || bits == 4, "quantize_with_feedback: ", bits,
                     " bits; codes are 8 or 4 bits");
  if (n == 0 || runs == 0) return;
  expect_int_range(n, "quantize_with_feedback");
  expect<ShapeError>(runs <= 65535, "quantize_with_feedback: ", runs,
                     " runs (a grid's y extent is at most 65535)");
  const dim3 grid(static_cast<unsigned>(quant::int8_blocks(n)), static_cast<unsigned>(runs));
  if (bits == 8) {
    quantize_feedback_kernel<8, T>
        <<<grid, int8_block_threads, 0, stream>>>(in, out, error, feedback, n, runs, columns);
  } else {
    quantize_feedback_kernel<4, T>
        <<<grid, int8_block_threads, 0, stream>>>(in, out, error, feedback, n, runs, columns);
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::ops::cuda
