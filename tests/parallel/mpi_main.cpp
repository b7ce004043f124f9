// Main of the MPI test executable: MPI is initialised once (MpiComm::world) around the whole
// Catch2 session, and the exit code is the worst over the ranks, so a failure on any rank fails
// the CTest test.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>

int main(int argc, char** argv) {
  auto world = zero::parallel::MpiComm::world(argc, argv);
  int result = Catch::Session().run(argc, argv);
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, world.native_handle());
  return worst;
}
