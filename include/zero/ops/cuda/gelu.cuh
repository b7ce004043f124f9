#pragma once
// zero-requires: cuda
// GELU, tanh approximation (GPT-2), on the GPU; the twin of zero/ops/cpu/gelu.hpp:
//   y = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),  s = sqrt(2 / pi).
// s is computed on the host exactly as the host kernel computes it and passed in, so the only
// difference from the host is tanhf's last-ulp rounding on the device.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/gelu.cuh needs nvcc; host-only code includes zero/ops/cpu/gelu.hpp"
#endif

#include <cmath>
#include <cstdint>
#include <numbers>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>

namespace zero::ops::cuda {

/// sqrt(2/pi) in float, the host kernel's expression.
inline float gelu_tanh_scale() {
  return std::sqrt(2.0f / std::numbers::pi_v<float>);
}

// ---- kernels ------------------------------------------------------------------------------------

/// gelu(x), the host's expression.
__device__ __forceinline__ float gelu_value(float x, float s) {
  return 0.5f * x * (1.0f + tanhf(s * (x + 0.044715f * x * x * x)));
}

/// gelu'(x), the host's expression term for term.
__device__ __forceinline__ float gelu_slope(float x, float s) {
  const float u = s * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * s * (1.0f + 3.0f * 0.044715f * x * x);
}

/// out[i] = gelu(inp[i]) (Packed: 16-byte accesses, common.cuh's map_elements).
template <class T, bool Packed>
__global__ void gelu_forward_kernel(T* out, const T* inp, std::int64_t n, float s) {
  map_elements<T, Packed>(
      out, n, [s](T x) { return store<T>(gelu_value(load(x), s)); }, inp);
}

/// dinp[i] += gelu'(inp[i]) * dout[i], or = without reading dinp when Overwrite (Packed as in
/// the forward).
template <class T, bool Packed, bool Overwrite>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, std::int64_t n,
                                     float s) {
  if constexpr (Overwrite) {
    map_elements<T, Packed>(
        dinp, n, [s](T x, T dy) { return store<T>(gelu_slope(load(x), s) * load(dy)); }, inp, dout);
  } else {
    map_elements<T, Packed>(
        dinp, n,
        [s](T dx, T x, T dy) { return store<T>(load(dx) + gelu_slope(load(x), s) * load(dy)); },
        static_cast<const T*>(dinp), inp, dout);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

/// out[i] = gelu(inp[i]) for n elements (out may alias inp).
template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16({out, inp})) {
    gelu_forward_kernel<T, true>
        <<<grid_for(n / pack_size<T> + 1), elementwise_threads, 0, stream>>>(out, inp, n,
                                                                             gelu_tanh_scale());
  } else {
    gelu_forward_kernel<T, false>
        <<<grid_for(n), elementwise_threads, 0, stream>>>(out, inp, n, gelu_tanh_scale());
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp[i] += gelu'(inp[i]) * dout[i]; with overwrite_dinp dinp is written instead (not read:
/// a layer whose input gradient starts here skips a pass that zeroes it and one that reads it).
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n, bool overwrite_dinp,
                   cudaStream_t stream) {
  if (n == 0) return;
  const auto launch = [&](auto overwrite) {
    constexpr bool Overwrite = decltype(overwrite)::value;
    if (aligned16({dinp, inp, dout})) {
      gelu_backward_kernel<T, true, Overwrite>
          <<<grid_for(n / pack_size<T> + 1), elementwise_threads, 0, stream>>>(dinp, inp, dout, n,
                                                                               gelu_tanh_scale());
    } else {
      gelu_backward_kernel<T, false, Overwrite>
          <<<grid_for(n), elementwise_threads, 0, stream>>>(dinp, inp, dout, n, gelu_tanh_scale());
    }
  };
  if (overwrite_dinp) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// dinp[i] += gelu'(inp[i]) * dout[i].
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n, cudaStream_t stream) {
  gelu_backward<T>(dinp, inp, dout, n, false, stream);
}

}  // namespace zero::ops::cuda
