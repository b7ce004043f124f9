// Catch2 main for [cuda] tests: exits with 77 (skipped) when no GPU is visible.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include <cuda_runtime.h>

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device visible: skipping the [cuda] tests\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
