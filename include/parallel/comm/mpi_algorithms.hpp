// zero-requires: mpi
#pragma once
// Which algorithm MpiComm's nonblocking all_reduce runs, chosen per call, and which groups
// run all_gather and reduce_scatter as direct exchanges (mpi_direct.hpp).
//
// MpiComm's collectives are nonblocking (so deadlines hold), and Open MPI serves nonblocking
// collectives from coll/libnbc, whose own choice for MPI_Iallreduce is a binomial reduce then
// broadcast whenever the group has fewer than 4 ranks, the buffer is under 64 KiB, or the call
// is in place: each rank moves the whole buffer twice. The blocking MPI_Allreduce (coll/tuned)
// picks better, so at 2 ranks zero's all_reduce ran at 0.66-0.78 of the raw call's speed from
// 256 KiB up (comm_bench, median of 5 runs). libnbc's ring (reduce-scatter then all-gather,
// each rank moving 2(p-1)/p of the buffer) beat the raw call at every size from 64 KiB at 2
// ranks, and from 1 MiB at 4; below that, at 4 ranks, libnbc's own choice is better.
//
// Open MPI exposes the choice as the control variable coll_libnbc_iallreduce_algorithm (0:
// libnbc decides, 1: ring), settable at run time through the MPI tool interface (MPI_T). Where
// it is absent (another MPI, or Open MPI without libnbc) this does nothing. A user who sets the
// variable (OMPI_MCA_coll_libnbc_iallreduce_algorithm) keeps that setting: zero then leaves it.

#include <mpi.h>

#include <cstddef>
#include <cstdlib>

namespace zero::parallel::detail {

/// The ring's size threshold: from 64 KiB at 2 or 3 ranks, 1 MiB at 4 or more; 0 below
/// (libnbc decides).
inline int iallreduce_algorithm(int ranks, std::size_t bytes) {
  constexpr int libnbc_decides = 0, ring = 1;
  const std::size_t from = ranks < 4 ? (std::size_t{64} << 10) : (std::size_t{1} << 20);
  return bytes >= from ? ring : libnbc_decides;
}

/// Whether a group of `ranks` runs all_gather and reduce_scatter as direct point-to-point
/// exchanges (mpi_direct.hpp) rather than through libnbc: up to 8 ranks, at every size. At 2
/// and 4 ranks they were as fast as the blocking all_gather and faster than either
/// reduce_scatter from 1 KiB to 16 MiB; a direct exchange sends p - 1 messages per rank in one
/// round, which larger groups (not measured) may prefer to spread over log p rounds.
inline bool direct_exchange(int ranks) {
  return ranks <= 8;
}

/// The control variable, bound once (after MPI_Init).
class IallreduceAlgorithm {
 public:
  /// The process's binding; inactive when MPI_T or the variable is missing, or the user set it.
  static IallreduceAlgorithm& instance() {
    static IallreduceAlgorithm bound;
    return bound;
  }
  /// Sets the algorithm of the next MPI_Iallreduce (no effect when inactive).
  void set(int algorithm) {
    if (!active_ || algorithm == current_) return;
    if (MPI_T_cvar_write(handle_, &algorithm) == MPI_SUCCESS) current_ = algorithm;
  }
  bool active() const { return active_; }

 private:
  IallreduceAlgorithm() {
    if (std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm") != nullptr) return;
    // MPI_T_init_thread asks for the level MPI already has: Open MPI 4.1 overwrites the level
    // MPI_Query_thread reports with the one asked for here.
    int level = MPI_THREAD_SINGLE, provided = 0;
    MPI_Query_thread(&level);
    if (MPI_T_init_thread(level, &provided) != MPI_SUCCESS) return;
    int index = -1, count = 0;
    if (MPI_T_cvar_get_index("coll_libnbc_iallreduce_algorithm", &index) != MPI_SUCCESS) return;
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle_, &count) != MPI_SUCCESS || count != 1) {
      return;
    }
    if (MPI_T_cvar_read(handle_, &current_) != MPI_SUCCESS) return;
    active_ = true;
  }

  MPI_T_cvar_handle handle_{};
  int current_ = 0;
  bool active_ = false;
};

}  // namespace zero::parallel::detail
