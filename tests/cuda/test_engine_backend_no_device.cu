// Compute<Cuda> without a GPU: constructing CudaBackend throws zero::CudaError saying that no
// CUDA device is visible and what to do, never falling back to the host. A plain Catch2 main
// (cuda_main.cpp would skip before the test runs); CTest hides every GPU
// (CUDA_VISIBLE_DEVICES=-1) so the case runs on GPU machines too. What needs no device at all
// runs here as well, on every machine: ZERO_GEMM_TUNING's parsing.
#include <cstdlib>
#include <string>

#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <zero/core/error.hpp>
#include <zero/engine/cuda_backend.cuh>
#include <zero/ops/cuda/gemm.cuh>

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

TEST_CASE("ZERO_GEMM_TUNING chooses the GEMMs' tuning and refuses other values", "[cuda][gemm]") {
  using zero::ops::cuda::gemm_tuning_from_environment;
  using zero::ops::cuda::GemmTuning;
  const char* before = std::getenv("ZERO_GEMM_TUNING");
  const std::string kept = before != nullptr ? before : "";
  ::unsetenv("ZERO_GEMM_TUNING");
  CHECK(gemm_tuning_from_environment() == GemmTuning::heuristic);
  ::setenv("ZERO_GEMM_TUNING", "", 1);
  CHECK(gemm_tuning_from_environment() == GemmTuning::heuristic);
  ::setenv("ZERO_GEMM_TUNING", "heuristic", 1);
  CHECK(gemm_tuning_from_environment() == GemmTuning::heuristic);
  ::setenv("ZERO_GEMM_TUNING", "measured", 1);
  CHECK(gemm_tuning_from_environment() == GemmTuning::measured);
  ::setenv("ZERO_GEMM_TUNING", "fastest", 1);
  CHECK_THROWS_AS(gemm_tuning_from_environment(), zero::ConfigError);
  CHECK_THROWS_WITH(gemm_tuning_from_environment(),
                    Catch::Contains("ZERO_GEMM_TUNING=fastest") && Catch::Contains("measured"));
  if (before != nullptr) {
    ::setenv("ZERO_GEMM_TUNING", kept.c_str(), 1);
  } else {
    ::unsetenv("ZERO_GEMM_TUNING");
  }
}
