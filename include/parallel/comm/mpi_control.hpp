// zero-requires: mpi
#pragma once
// The out-of-band control channel of an MpiComm group: a duplicate of the group's communicator
// that carries no data, only short records of which collective a rank is at. Two uses:
//
// * Census after a timeout. MPI cannot say which ranks joined a collective, so a rank whose
//   collective timed out sends its record (op, sequence number) to every other rank of the
//   group and collects theirs for a grace period. Ranks stuck in the same collective time out
//   too and answer; a rank that never answers is dead, stalled outside communication, or
//   blocked on another group, and is named as not arrived. A rank that answers with another
//   op is named with the op it is at (the group's ranks diverged).
// * Sequence check (CommOptions::verify_sequence, a debug mode). Before each collective every
//   rank all-gathers a short hash of (op, group, count, dtype, sequence number) on the control
//   channel, so ranks that issue different collectives fail at the first divergence with both
//   ranks' ops named, instead of matching the wrong buffers or hanging. LocalComm always
//   compares full descriptors (local_world.hpp); this is MPI's cheap equivalent.

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include <parallel/comm/comm_op.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel::detail {

/// What one rank says about the collective it is at; sent as raw bytes on the control channel.
struct MpiOpRecord {
  std::uint64_t hash = 0;   ///< op_hash of the fields below and the group's name
  std::uint64_t seq = 0;    ///< the rank's sequence number of the op on the group
  std::uint64_t count = 0;  ///< elements (0 where ranks legitimately differ: all_to_all_v)
  std::uint8_t op = 0;      ///< CommOp
  std::uint8_t dtype = 0;   ///< DType
  std::uint8_t valid = 0;   ///< 1 for a record a rank sent (0: nothing received)
  std::uint8_t pad[5] = {};

  /// "all_reduce #5 (21 elements of f32)".
  std::string describe() const {
    return zero::detail::concat(name_of(static_cast<CommOp>(op)), " #", seq, " (", count,
                                " elements of ", name_of(static_cast<DType>(dtype)), ")");
  }
};
static_assert(std::is_trivially_copyable_v<MpiOpRecord> && sizeof(MpiOpRecord) == 32);

/// FNV-1a over the bytes of (op, dtype, count, seq) and the group's name: equal on every rank
/// that issues the same collective as its seq-th op on the group.
inline std::uint64_t op_hash(CommOp op, DType dtype, std::uint64_t count, std::uint64_t seq,
                             std::string_view group) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* data, std::size_t n) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  };
  const auto o = static_cast<std::uint8_t>(op), d = static_cast<std::uint8_t>(dtype);
  mix(&o, 1);
  mix(&d, 1);
  mix(&count, sizeof count);
  mix(&seq, sizeof seq);
  mix(group.data(), group.size());
  return h;
}

/// The record of op as this rank issues it.
inline MpiOpRecord make_record(CommOp op, DType dtype, std::uint64_t count, std::uint64_t seq,
                               std::string_view group) {
  MpiOpRecord r;
  r.hash = op_hash(op, dtype, count, seq, group);
  r.seq = seq;
  r.count = count;
  r.op = static_cast<std::uint8_t>(op);
  r.dtype = static_cast<std::uint8_t>(dtype);
  r.valid = 1;
  return r;
}

/// Tag of census records on the control channel (the channel carries nothing else
/// point-to-point, so any fixed tag works).
inline constexpr int census_tag = 7301;

/// "[0, 2, 3]".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

/// After mine timed out at rank `rank` of the group: sends mine to every other rank of the
/// control channel, collects their records for grace_s, and returns the sentence that names
/// who never joined (world_ranks maps group ranks to world ranks). Never throws: it runs on
/// the way to a CommError and must not replace it.
inline std::string census(MPI_Comm control, int rank, int size, const MpiOpRecord& mine,
                          double grace_s, const std::vector<int>& world_ranks) {
  if (control == MPI_COMM_NULL || size < 2) return {};
  std::vector<MpiOpRecord> got(static_cast<std::size_t>(size));
  got[static_cast<std::size_t>(rank)] = mine;
  // The requests are freed at once (a dead peer never completes them), and MPI may read a
  // freed send's buffer until the send completes: the record is sent from a copy kept for the
  // life of the process (one per census, which runs only on the way to a CommError), never
  // from the caller's temporary.
  const MpiOpRecord* sent = nullptr;
  {
    static std::mutex kept_mutex;
    static auto* kept = new std::vector<std::unique_ptr<MpiOpRecord>>();
    std::lock_guard lock(kept_mutex);
    kept->push_back(std::make_unique<MpiOpRecord>(mine));
    sent = kept->back().get();
  }
  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(sent, sizeof *sent, MPI_BYTE, q, census_tag, control, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(grace_s));
  auto heard_all = [&] {
    for (const auto& r : got) {
      if (!r.valid) return false;
    }
    return true;
  };
  while (!heard_all() && std::chrono::steady_clock::now() < deadline) {
    int flag = 0;
    MPI_Status status{};
    if (MPI_Iprobe(MPI_ANY_SOURCE, census_tag, control, &flag, &status) != MPI_SUCCESS) break;
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    MpiOpRecord r;
    if (MPI_Recv(&r, sizeof r, MPI_BYTE, status.MPI_SOURCE, census_tag, control,
                 MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      break;
    }
    // A record of an earlier timeout on this group can still be queued: keep the newest.
    auto& slot = got[static_cast<std::size_t>(status.MPI_SOURCE)];
    if (!slot.valid || r.seq >= slot.seq) slot = r;
  }
  std::vector<int> silent, silent_world, joined;
  std::string elsewhere;
  for (int q = 0; q < size; ++q) {
    const auto& r = got[static_cast<std::size_t>(q)];
    const int world = world_ranks[static_cast<std::size_t>(q)];
    if (!r.valid) {
      silent.push_back(q);
      silent_world.push_back(world);
    } else if (r.hash == mine.hash) {
      joined.push_back(q);
    } else {
      elsewhere += zero::detail::concat("; rank ", q, " (world rank ", world, ") is stuck at ",
                                        r.describe(), " instead");
    }
  }
  std::string out;
  if (!silent.empty()) {
    out = zero::detail::concat("group ranks ", rank_list(silent), " (world ranks ",
                               rank_list(silent_world),
                               ") never joined it (no progress report within ", grace_s,
                               " s: dead, stalled outside communication, or blocked on another "
                               "group); ranks ",
                               rank_list(joined), " did");
  } else {
    out = zero::detail::concat("ranks ", rank_list(joined), " joined it");
  }
  return out + elsewhere;
}

/// The CommError message when the records all ranks posted for their next collective (index
/// = group rank) disagree with this rank's, naming both ranks' ops; empty when they agree.
inline std::string sequence_mismatch(std::span<const MpiOpRecord> records, int rank,
                                     std::string_view group, const std::vector<int>& world_ranks) {
  const MpiOpRecord& mine = records[static_cast<std::size_t>(rank)];
  for (std::size_t q = 0; q < records.size(); ++q) {
    if (records[q].hash == mine.hash) continue;
    return zero::detail::concat(
        "MpiComm: collective sequence diverged on group '", group, "': rank ", rank,
        " (world rank ", world_ranks[static_cast<std::size_t>(rank)], ") issued ", mine.describe(),
        " where rank ", q, " (world rank ", world_ranks[q], ") issued ", records[q].describe(),
        "; every rank of a group must issue the same collectives in the same order");
  }
  return {};
}

}  // namespace zero::parallel::detail
