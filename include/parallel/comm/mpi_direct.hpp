// zero-requires: mpi
#pragma once
// MpiComm's all_gather and reduce_scatter on small groups, as direct point-to-point exchanges.
//
// Open MPI serves MPI_Iallgather and MPI_Ireduce_scatter_block from coll/libnbc, and both were
// slower than the blocking calls (coll/tuned) at 2 ranks whatever the polling: MPI_Iallgather
// + MPI_Wait took 8 us where MPI_Allgather took 4 at 64 KiB and 30-60 us where it took 9 at
// 256 KiB, though at 2 ranks both move one message each way. libnbc's ireduce_scatter_block
// is a binomial reduce of the whole buffer to rank 0 then a linear scatter (rank 0 receives
// and reduces all of it), and has no algorithm variable. Plain MPI_Isend/MPI_Irecv to every
// other rank at once, then a local reduction, matched the blocking all_gather and beat both
// reduce_scatters (1.4-5x at 2 ranks, 1.1-1.8x at 4) from 64 KiB to 16 MiB.
//
// Each rank sends every other rank its chunk (all_gather) or the chunk that rank owns
// (reduce_scatter), moving (p-1)/p of the buffer like a ring, in one round. The messages go on
// a duplicate of the group's communicator with a tag per op, so they never match the user's
// point-to-point messages; ops of one kind match in issue order (MPI does not overtake).
// reduce_scatter folds the chunks in rank order (((c0 op c1) op c2) ...), like LocalComm,
// so its results do not depend on arrival order and equal LocalComm's bit for bit (max and min
// with a NaN aside: each library has its own rule, see docs/collectives.md).

#include <mpi.h>

#include <cstddef>
#include <cstring>

namespace zero::parallel::detail {

/// Tags of the direct exchanges (one per op, so a diverging sequence fails on sizes or hangs
/// into the deadline instead of mixing two ops' data).
inline constexpr int direct_all_gather_tag = 1, direct_reduce_scatter_tag = 2;

/// Request slots a direct exchange needs at `ranks` ranks: a send and a receive per peer.
inline std::size_t direct_requests(int ranks) {
  return 2 * static_cast<std::size_t>(ranks - 1);
}

/// Posts rank `me`'s part of an all_gather of count elements of `type` (`bytes` each) per rank:
/// copies send into its slot of recv (unless send is that slot), receives every other rank's
/// chunk into its slot, and sends send to every other rank. Fills direct_requests(ranks)
/// requests; returns the first MPI error code, or MPI_SUCCESS.
inline int post_direct_all_gather(const void* send, void* recv, int count, MPI_Datatype type,
                                  std::size_t bytes, int me, int ranks, MPI_Comm comm,
                                  MPI_Request* requests) {
  const std::size_t chunk = static_cast<std::size_t>(count) * bytes;
  auto slot = [&](int q) { return static_cast<char*>(recv) + static_cast<std::size_t>(q) * chunk; };
  if (send != slot(me) && chunk != 0) std::memcpy(slot(me), send, chunk);
  // Receives first, so each send finds its receive posted; sends go round the ring from me + 1,
  // so that the ranks do not all send to rank 0 first.
  for (int k = 1; k < ranks; ++k) {
    const int q = (me + ranks - k) % ranks;
    const int rc = MPI_Irecv(slot(q), count, type, q, direct_all_gather_tag, comm, requests++);
    if (rc != MPI_SUCCESS) return rc;
  }
  for (int k = 1; k < ranks; ++k) {
    const int q = (me + k) % ranks;
    const int rc = MPI_Isend(send, count, type, q, direct_all_gather_tag, comm, requests++);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

/// Where rank q's chunk of a direct reduce_scatter lands in the receive buffer of rank me
/// (ranks - 1 chunks, in rank order without me).
inline std::size_t direct_peer_slot(int q, int me) {
  return static_cast<std::size_t>(q < me ? q : q - 1);
}

/// Posts rank `me`'s part of a reduce_scatter of count elements per rank: sends rank q the
/// q-th chunk of send, and receives every other rank's chunk of mine into `peers` (ranks - 1
/// chunks, see direct_peer_slot). Fills direct_requests(ranks) requests; returns the first MPI
/// error code, or MPI_SUCCESS. fold_direct_reduce_scatter finishes the op.
inline int post_direct_reduce_scatter(const void* send, void* peers, int count, MPI_Datatype type,
                                      std::size_t bytes, int me, int ranks, MPI_Comm comm,
                                      MPI_Request* requests) {
  const std::size_t chunk = static_cast<std::size_t>(count) * bytes;
  for (int k = 1; k < ranks; ++k) {
    const int q = (me + ranks - k) % ranks;
    void* into = static_cast<char*>(peers) + direct_peer_slot(q, me) * chunk;
    const int rc = MPI_Irecv(into, count, type, q, direct_reduce_scatter_tag, comm, requests++);
    if (rc != MPI_SUCCESS) return rc;
  }
  for (int k = 1; k < ranks; ++k) {
    const int q = (me + k) % ranks;
    const void* from = static_cast<const char*>(send) + static_cast<std::size_t>(q) * chunk;
    const int rc = MPI_Isend(from, count, type, q, direct_reduce_scatter_tag, comm, requests++);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

/// Once the exchange completed: out = chunk_0 op chunk_1 op ... in rank order, where chunk_me
/// is `own` (this rank's chunk of its send buffer; must not overlap out unless it is out and
/// me is 0) and the others are in `peers`. Returns the first MPI error code, or MPI_SUCCESS.
inline int fold_direct_reduce_scatter(const void* own, const void* peers, void* out, int count,
                                      MPI_Datatype type, std::size_t bytes, MPI_Op op, int me,
                                      int ranks) {
  const std::size_t chunk = static_cast<std::size_t>(count) * bytes;
  auto chunk_of = [&](int q) -> const void* {
    return q == me ? own : static_cast<const char*>(peers) + direct_peer_slot(q, me) * chunk;
  };
  if (chunk_of(0) != out && chunk != 0) std::memcpy(out, chunk_of(0), chunk);
  for (int q = 1; q < ranks; ++q) {
    // MPI_Reduce_local computes inout = in op inout; sum and prod commute, and max and min do
    // on values other than NaN, so this is out op chunk_q bit for bit (not with a NaN).
    const int rc = MPI_Reduce_local(chunk_of(q), out, count, type, op);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

}  // namespace zero::parallel::detail
