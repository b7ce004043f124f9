#pragma once
// Shared by the engine's MPI test files (one executable under mpiexec): the world communicator
// and the largest of a value over all ranks, so every rank asserts on the same number.
#include <span>

#include <parallel/comm/mpi_comm.hpp>

namespace zero::test {

/// MPI_COMM_WORLD as an MpiComm, created once per process.
inline parallel::MpiComm& world() {
  static parallel::MpiComm comm = parallel::MpiComm::world();
  return comm;
}

/// The largest of mine over all ranks.
inline double worst(double mine) {
  world().all_reduce(std::span<double>(&mine, 1), parallel::ReduceOp::max);
  return mine;
}

}  // namespace zero::test
