#pragma once
// Turns failed CUDA runtime calls into zero::CudaError naming the call, the error and the place.
#if !defined(__CUDACC__)
#error "zero/core/cuda_check.cuh needs nvcc; host-only code includes zero/core/device.hpp"
#endif

#include <cuda_runtime.h>

#include <zero/core/error.hpp>

namespace zero::cuda {

/// Throws CudaError when status is not cudaSuccess; call names the API call, file/line the place.
inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) [[unlikely]] {
    raise<CudaError>(call, " failed: ", cudaGetErrorString(status), " (", cudaGetErrorName(status),
                     ") at ", file, ":", line);
  }
}

}  // namespace zero::cuda

/// Checks a CUDA runtime call; the macro exists only to capture the call text and place.
#define ZERO_CUDA_CHECK(call) ::zero::cuda::check((call), #call, __FILE__, __LINE__)
