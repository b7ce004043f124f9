// Main of the NcclComm test: MPI is initialised once around the Catch2 session; without a
// visible GPU every rank exits with 77, which CTest reports as skipped (not as passed).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include <cuda_runtime.h>

#include <parallel/comm/mpi_comm.hpp>

int main(int argc, char** argv) {
  auto world = zero::parallel::MpiComm::world(argc, argv);
  int devices = 0;
  const int have = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 ? 1 : 0;
  int all_have = have;
  MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, world.native_handle());
  if (all_have == 0) {
    if (world.rank() == 0) std::printf("no CUDA device visible: skipping the NcclComm tests\n");
    return 77;
  }
  int result = Catch::Session().run(argc, argv);
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, world.native_handle());
  return worst;
}
