// Main of the NcclComm test: MPI is initialised once around the Catch2 session; without a
// visible GPU, or with more ranks on a node than GPUs (NCCL takes one GPU a rank), every rank
// exits with 77, which CTest reports as skipped (not as passed).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include <string>

#include <cuda_runtime.h>

#include <parallel/comm/mpi_comm.hpp>

#include "device_presence.hpp"

int main(int argc, char** argv) {
  auto world = zero::parallel::MpiComm::world(argc, argv);
  std::string why;
  int devices = 0;
  const auto presence = zero::test::cuda_presence(why, devices);
  if (presence == zero::test::CudaPresence::broken) {
    std::printf("rank %d: a CUDA driver is installed but the runtime cannot use it (%s)\n",
                world.rank(), why.c_str());
    MPI_Abort(world.native_handle(), 1);
  }
  const int have = presence == zero::test::CudaPresence::device ? 1 : 0;
  int all_have = have;
  MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, world.native_handle());
  if (all_have == 0) {
    if (world.rank() == 0) std::printf("no CUDA device visible: skipping the NcclComm tests\n");
    return 77;
  }
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(world.native_handle(), MPI_COMM_TYPE_SHARED, world.rank(), MPI_INFO_NULL,
                      &node);
  int node_ranks = 1;
  MPI_Comm_size(node, &node_ranks);
  MPI_Comm_free(&node);
  const int fits = node_ranks <= devices ? 1 : 0;
  int all_fit = fits;
  MPI_Allreduce(&fits, &all_fit, 1, MPI_INT, MPI_MIN, world.native_handle());
  if (all_fit == 0) {
    if (world.rank() == 0) {
      std::printf("more ranks on a node than GPUs (%d on %d): skipping the NcclComm tests\n",
                  node_ranks, devices);
    }
    return 77;
  }
  int result = Catch::Session().run(argc, argv);
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, world.native_handle());
  return worst;
}
