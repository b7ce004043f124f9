#pragma once
// zero-requires: cuda
// GELU, tanh approximation (GPT-2), on the GPU; the twin of zero/ops/cpu/gelu.hpp:
//   y = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),  s = sqrt(2 / pi).
// s and the cubic coefficient are the host kernel's constants (zero/ops/gelu_tanh.hpp). Both
// sides evaluate 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + exp(-2u)), which does not cancel in
// the negative tail; the device with the hardware's exp2 and reciprocal (__expf, __fdividef: a
// few ulps), the host with its vector exp: tanhf's accurate path made the forward compute-bound
// on an H200 (0.58 of the copy bandwidth where the backward, with more bytes an element, reached
// 0.89).
#if !defined(__CUDACC__)
#error "zero/ops/cuda/gelu.cuh needs nvcc; host-only code includes zero/ops/cpu/gelu.hpp"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/gelu_tanh.hpp>

namespace zero::ops::cuda {

// ---- kernels ------------------------------------------------------------------------------------

/// sigmoid(2u) = 0.5 (1 + tanh(u)), and e = exp(-2u), its argument capped at 87: e stays finite
/// (so e * sigmoid(2u) = 1 - sigmoid(2u) holds in the tail) and 1 + e below 2^126, where
/// __fdividef would return 0. The host's exp clamps at 88, so for x below about -10 the two
/// differ in values under 2e-37.
__device__ __forceinline__ float gelu_sigmoid(float u, float& e) {
  e = __expf(fminf(-2.0f * u, 87.0f));
  return __fdividef(1.0f, 1.0f + e);
}

/// gelu(x) = x sigmoid(2u), u = s (x + 0.044715 x^3), s = gelu_s.
__device__ __forceinline__ float gelu_value(float x) {
  float e;
  return x * gelu_sigmoid(gelu_s * (x + gelu_c * x * x * x), e);
}

/// gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) s (1 + 3 * 0.044715 x^2), with
/// 0.5 (1 + tanh(u)) = sig and 1 - tanh(u)^2 = 4 sig (1 - sig), 1 - sig = e sig.
__device__ __forceinline__ float gelu_slope(float x) {
  float e;
  const float sig = gelu_sigmoid(gelu_s * (x + gelu_c * x * x * x), e);
  return sig + 2.0f * x * sig * (e * sig) * gelu_s * (1.0f + 3.0f * gelu_c * x * x);
}

/// out[i] = gelu(inp[i]) (Packed: 16-byte accesses, common.cuh's map_elements).
template <class T, bool Packed>
__global__ void gelu_forward_kernel(T* out, const T* inp, std::int64_t n) {
  map_elements<T, Packed>(
      out, n, [](T x) { return store<T>(gelu_value(load(x))); }, inp);
}

/// dinp[i] += gelu'(inp[i]) * dout[i], or = without reading dinp when Overwrite (Packed as in
/// the forward).
template <class T, bool Packed, bool Overwrite>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, std::int64_t n) {
  if constexpr (Overwrite) {
    map_elements<T, Packed>(
        dinp, n, [](T x, T dy) { return store<T>(gelu_slope(load(x)) * load(dy)); }, inp, dout);
  } else {
    map_elements<T, Packed>(
        dinp, n,
        [](T dx, T x, T dy) { return store<T>(load(dx) + gelu_slope(load(x)) * load(dy)); },
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
        <<<grid_for(n / pack_size<T> + 1), elementwise_threads, 0, stream>>>(out, inp, n);
  } else {
    gelu_forward_kernel<T, false><<<grid_for(n), elementwise_threads, 0, stream>>>(out, inp, n);
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
          <<<grid_for(n / pack_size<T> + 1), elementwise_threads, 0, stream>>>(dinp, inp, dout, n);
    } else {
      gelu_backward_kernel<T, false, Overwrite>
          <<<grid_for(n), elementwise_threads, 0, stream>>>(dinp, inp, dout, n);
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
