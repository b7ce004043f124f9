// Compute<Cuda> without a GPU: constructing CudaBackend throws zero::CudaError saying that no
// CUDA device is visible and what to do, never falling back to the host. A plain Catch2 main
// (cuda_main.cpp would skip before the test runs); CTest hides every GPU
// (CUDA_VISIBLE_DEVICES=-1) so the case runs on GPU machines too.
#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <zero/core/error.hpp>
#include <zero/engine/cuda_backend.cuh>

TEST_CASE("CudaBackend without a CUDA device throws CudaError naming what is missing",
          "[cuda][engine]") {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    WARN(
        "a CUDA device is visible, so the no-device case is skipped (CTest runs it with "
        "CUDA_VISIBLE_DEVICES=-1)");
    return;
  }
  (void)cudaGetLastError();
  CHECK_THROWS_AS(zero::engine::CudaBackend(), zero::CudaError);
  CHECK_THROWS_WITH(zero::engine::CudaBackend(),
                    Catch::Contains("CudaBackend (Compute<Cuda>): no CUDA device is visible") &&
                        Catch::Contains("Compute<Host>"));
}
