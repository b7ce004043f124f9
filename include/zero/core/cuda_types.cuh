#pragma once
// zero's 16-bit float types and CUDA's share their bits: conversions are bit casts.
#if !defined(__CUDACC__)
#error "zero/core/cuda_types.cuh needs nvcc; host-only code includes zero/core/dtype.hpp"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <zero/core/dtype.hpp>

namespace zero::cuda {

/// CUDA's type with the same bits as T (T itself for other types).
template <class T>
struct native_type {
  using type = T;
};
template <>
struct native_type<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct native_type<f16> {
  using type = __half;
};
template <class T>
using native_type_t = typename native_type<T>::type;

static_assert(sizeof(__nv_bfloat16) == sizeof(bf16) && sizeof(__half) == sizeof(f16));

/// Reinterprets a pointer to zero's element type as CUDA's.
template <class T>
__host__ __device__ inline native_type_t<T>* native(T* p) {
  return reinterpret_cast<native_type_t<T>*>(p);
}
template <class T>
__host__ __device__ inline const native_type_t<T>* native(const T* p) {
  return reinterpret_cast<const native_type_t<T>*>(p);
}

}  // namespace zero::cuda
