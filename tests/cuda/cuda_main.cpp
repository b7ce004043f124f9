// Catch2 main for [cuda] tests: exits with 77 (skipped) on a machine without a GPU, and fails
// (exit 1) where a driver is installed but the runtime cannot use it (device_presence.hpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "device_presence.hpp"

int main(int argc, char** argv) {
  std::string why;
  int devices = 0;
  switch (zero::test::cuda_presence(why, devices)) {
    case zero::test::CudaPresence::none:
      std::printf("no CUDA device visible: skipping the [cuda] tests\n");
      return 77;
    case zero::test::CudaPresence::broken:
      std::printf("a CUDA driver is installed but the runtime cannot use it (%s)\n", why.c_str());
      return 1;
    case zero::test::CudaPresence::device:
      break;
  }
  return Catch::Session().run(argc, argv);
}
