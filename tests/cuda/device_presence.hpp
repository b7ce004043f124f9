#pragma once
// Whether a [cuda] test program runs, skips or fails. A machine without a GPU skips (CTest's
// exit code 77): no device, or no NVIDIA driver at all, where the runtime reports
// cudaErrorInsufficientDriver for want of libcuda. A driver that is installed but refuses (too
// old for this CUDA runtime, a broken install) fails instead: a GPU machine that cannot run the
// suite must not report it as skipped.
#include <string>

#include <cuda_runtime.h>
#include <dlfcn.h>

namespace zero::test {

enum class CudaPresence { device, none, broken };

/// The machine's state; why names the runtime's error when broken; devices the count.
inline CudaPresence cuda_presence(std::string& why, int& devices) {
  devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status == cudaSuccess) return devices > 0 ? CudaPresence::device : CudaPresence::none;
  devices = 0;
  (void)cudaGetLastError();
  if (status == cudaErrorNoDevice) return CudaPresence::none;
  if (void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    dlclose(driver);
    why = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
    return CudaPresence::broken;
  }
  return CudaPresence::none;  // no driver installed: a machine without an NVIDIA GPU
}

}  // namespace zero::test
