#pragma once
// The shared state behind LocalComm: one LocalWorld per LocalComm::run (abort flag, which
// ranks have left) and one LocalGroup per communicator (the rendezvous where every rank posts
// its op's descriptor, and the point-to-point mailboxes). Every wait for another rank to join
// is bounded by a deadline and wakes when the world aborts or a rank it waits for has left, so
// a failure on one rank reaches the others as a CommError instead of a hang. The release that
// ends an op every rank joined waits without a deadline for the ranks still moving bytes (see
// release). A rank that fails in a collective
// (at a rendezvous: its deadline, or a partner that left; or outside one: break_with) breaks the
// group, as NcclComm aborts its communicator: it withdraws its arrival, and every op on the group
// after that fails at once with the first failure's message, so no later op completes against
// descriptors of buffers already freed.

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel::detail {

/// State shared by all ranks (threads) of one LocalComm::run.
struct LocalWorld {
  /// A world of size ranks, none failed or left.
  explicit LocalWorld(int size) : left(static_cast<std::size_t>(size), 0) {}

  std::mutex mutex;            ///< guards everything below and every LocalGroup's state
  std::condition_variable cv;  ///< woken on every arrival, message, abort and departure
  bool aborted = false;        ///< a rank's function threw; everyone stops
  int failed_rank = -1;        ///< the first rank that threw
  std::string failure;         ///< what it threw
  std::vector<char> left;      ///< world rank has returned from its function
  std::uint64_t next_group_id = 1;

  /// Records that rank failed with what (the first failure wins) and wakes every waiter.
  void abort(int rank, std::string what) {
    {
      std::lock_guard lock(mutex);
      if (!aborted) {
        aborted = true;
        failed_rank = rank;
        failure = std::move(what);
      }
    }
    cv.notify_all();
  }
  /// Records that rank returned from its function; waits on it can no longer succeed.
  void leave(int rank) {
    {
      std::lock_guard lock(mutex);
      left[static_cast<std::size_t>(rank)] = 1;
    }
    cv.notify_all();
  }
};

/// What one rank passes to a collective; compared across ranks before any data moves.
struct OpDesc {
  CommOp op = CommOp::barrier;
  DType dtype = DType::u8;
  ReduceOp reduce = ReduceOp::sum;
  std::size_t count = 0;  ///< elements per rank (all_to_all_v: size of the count arrays)
  int root = 0;           ///< broadcast root
  const void* send = nullptr;
  void* recv = nullptr;
  const std::size_t* send_counts = nullptr;  ///< all_to_all_v
  const std::size_t* recv_counts = nullptr;  ///< all_to_all_v
  int color = 0, key = 0;                    ///< split
  std::uint64_t seq = 0;                     ///< this rank's op number on the group
};

/// Names an op for error messages: op, sequence number, bytes, group, ranks.
struct OpContext {
  CommOp op;
  std::uint64_t seq;
  std::size_t bytes;
  DType dtype;
  std::string_view group;
  int rank;
  int size;
  int world_rank;
  std::string_view comm = "LocalComm";  ///< the communicator type, prefixing its errors

  /// "all_reduce #3 (4096 bytes of f32) on group 'world' at rank 1 of 4 (world rank 1)".
  std::string describe() const {
    return zero::detail::concat(name_of(op), " #", seq, " (", bytes, " bytes of ", name_of(dtype),
                                ") on group '", group, "' at rank ", rank, " of ", size,
                                " (world rank ", world_rank, ")");
  }
};

/// "[0, 2, 3]".
inline std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << ']';
  return std::move(out).str();
}

/// One eager point-to-point message waiting in a mailbox.
struct LocalMessage {
  DType dtype;
  std::size_t count;
  std::vector<std::byte> data;
};

/// A communicator's shared state: members, rendezvous slots, split results, mailboxes.
struct LocalGroup {
  /// A group of the given world ranks (in group-rank order).
  LocalGroup(std::shared_ptr<LocalWorld> w, std::vector<int> m, std::uint64_t group_id)
      : world(std::move(w)),
        members(std::move(m)),
        id(group_id),
        slots(members.size()),
        arrived_at(members.size(), 0) {}

  std::shared_ptr<LocalWorld> world;
  std::vector<int> members;  ///< world rank of each group rank
  std::uint64_t id;
  std::vector<OpDesc> slots;              ///< the current op's descriptor of each rank
  std::vector<std::uint64_t> arrived_at;  ///< generation+1 of the barrier each rank is in
  int arrived = 0;
  std::uint64_t generation = 0;
  int released = 0;                      ///< ranks at the current op's release
  int release_failures = 0;              ///< of those, ranks whose share failed
  bool last_release_failed = false;      ///< the outcome of the last completed release
  std::uint64_t release_generation = 0;  ///< completed releases
  /// Set by the first rank that failed at a rendezvous of this group (see the file comment):
  /// what it threw. Guarded by world->mutex.
  std::string broken;
  /// Split results keyed by (op seq, color): the new group and how many members still fetch it.
  std::map<std::pair<std::uint64_t, int>, std::pair<std::shared_ptr<LocalGroup>, int>> splits;
  /// Eager messages keyed by (source, destination, tag), in send order.
  std::map<std::tuple<int, int, int>, std::deque<LocalMessage>> mailboxes;

  /// Number of ranks.
  int size() const { return static_cast<int>(members.size()); }

  /// Posts desc (when given) and blocks until every rank of the group arrived at this barrier.
  /// Throws CommError when the world aborts, the group is broken, a missing rank has left, or
  /// deadline passes; in the last two cases it breaks the group.
  void arrive(int rank, const OpDesc* desc, CommClock::time_point deadline, const OpContext& ctx,
              double timeout_s) {
    std::unique_lock lock(world->mutex);
    throw_if_aborted(ctx);
    throw_if_broken(ctx);
    if (desc) slots[static_cast<std::size_t>(rank)] = *desc;
    const std::uint64_t gen = generation;
    arrived_at[static_cast<std::size_t>(rank)] = gen + 1;
    if (++arrived == size()) {
      arrived = 0;
      ++generation;
      world->cv.notify_all();
      return;
    }
    try {
      wait_for_all(gen, deadline, ctx, timeout_s, lock);
    } catch (const CommError& e) {
      // The op cannot complete: take this rank's arrival back (a later arrival must not count
      // it) and, unless the world aborted (every rank stops anyway), break the group.
      arrived_at[static_cast<std::size_t>(rank)] = 0;
      --arrived;
      if (!world->aborted && broken.empty()) broken = e.what();
      world->cv.notify_all();
      throw;
    }
  }

  /// The closing barrier of an op every rank of the group has joined (passed the first
  /// rendezvous): blocks until each rank has finished its share of the data movement or failed
  /// in it (failed), and returns whether any rank of this op failed. It has no deadline and no
  /// abort or broken exit on purpose: a rank's share reads and writes the other ranks' buffers,
  /// so none may return (and free its buffers) while a peer still moves bytes, and every rank
  /// that joined comes here after its own share, whose device waits have their deadline.
  bool release(bool failed) {
    std::unique_lock lock(world->mutex);
    const std::uint64_t gen = release_generation;
    release_failures += failed ? 1 : 0;
    if (++released == size()) {
      // Kept until this rank's next release completes, which needs every rank to have left
      // this one first: each reads its own op's outcome.
      last_release_failed = release_failures > 0;
      released = 0;
      release_failures = 0;
      ++release_generation;
      world->cv.notify_all();
      return last_release_failed;
    }
    world->cv.wait(lock, [&] { return release_generation != gen; });
    return last_release_failed;
  }

  /// Breaks the group with why (unless it is already broken): a rank failed in an op outside
  /// its rendezvous, which the other ranks must then not complete without it.
  void break_with(const std::string& why) {
    {
      std::lock_guard lock(world->mutex);
      if (broken.empty()) broken = why;
    }
    world->cv.notify_all();
  }

  /// arrive's wait, under lock, until generation passes gen.
  void wait_for_all(std::uint64_t gen, CommClock::time_point deadline, const OpContext& ctx,
                    double timeout_s, std::unique_lock<std::mutex>& lock) {
    while (generation == gen) {
      throw_if_aborted(ctx);
      throw_if_broken(ctx);
      std::vector<int> missing, gone;
      for (int r = 0; r < size(); ++r) {
        if (arrived_at[static_cast<std::size_t>(r)] == gen + 1) continue;
        missing.push_back(r);
        if (world->left[static_cast<std::size_t>(members[static_cast<std::size_t>(r)])]) {
          gone.push_back(r);
        }
      }
      if (!gone.empty()) {
        raise<CommError>(ctx.comm, ": ", ctx.describe(), ": group ranks ", format_ranks(gone),
                         " (world ranks ", format_ranks(world_ranks(gone)),
                         ") returned from their function without joining it; every rank of a "
                         "group must issue the same collectives in the same order");
      }
      const bool timed_out = world->cv.wait_until(lock, deadline) == std::cv_status::timeout;
      if (generation != gen) return;
      // A rank that failed meanwhile, at its own deadline, withdrew its arrival: its failure
      // is the one to report, not a census that counts it missing.
      throw_if_aborted(ctx);
      throw_if_broken(ctx);
      if (timed_out) {
        // Arrivals before the last one do not notify, so both lists are taken afresh here.
        std::vector<int> present;
        missing.clear();
        for (int r = 0; r < size(); ++r) {
          (arrived_at[static_cast<std::size_t>(r)] == gen + 1 ? present : missing).push_back(r);
        }
        raise<CommError>(ctx.comm, ": ", ctx.describe(), " timed out after ", timeout_s,
                         " s: group ranks ", format_ranks(missing), " (world ranks ",
                         format_ranks(world_ranks(missing)), ") never joined; ranks ",
                         format_ranks(present),
                         " did. Raise CommOptions::timeout_s if the op is legitimately slow");
      }
    }
  }

  /// The CommError message when the ranks' descriptors disagree (op, dtype, count, reduction,
  /// root, all_to_all_v counts), or an empty string. Every rank sees the same slots, so all
  /// ranks get the same answer; they throw only after the release, because the
  /// descriptors point into other ranks' memory, which a throwing rank would free.
  std::string validation_error(const OpContext& ctx) const {
    try {
      validate(ctx);
    } catch (const CommError& e) {
      return e.what();
    }
    return {};
  }

  /// Throws CommError when the ranks' descriptors disagree (see validation_error).
  void validate(const OpContext& ctx) const {
    const OpDesc& ref = slots[0];
    for (int r = 1; r < size(); ++r) {
      const OpDesc& d = slots[static_cast<std::size_t>(r)];
      if (d.op != ref.op) {
        raise<CommError>(ctx.comm, ": ", ctx.describe(),
                         ": ranks disagree on the op sequence: rank ", r, " issued ", name_of(d.op),
                         " #", d.seq, " where rank 0 issued ", name_of(ref.op), " #", ref.seq,
                         "; every rank of a group must issue the same collectives in order");
      }
      if (d.dtype != ref.dtype || (d.count != ref.count && d.op != CommOp::split)) {
        raise<CommError>(ctx.comm, ": ", ctx.describe(), ": mismatched buffers: rank ", r,
                         " passed ", d.count, " elements of ", name_of(d.dtype), ", rank 0 passed ",
                         ref.count, " elements of ", name_of(ref.dtype),
                         "; every rank must pass the same count and type");
      }
      if (d.reduce != ref.reduce || d.root != ref.root) {
        raise<CommError>(ctx.comm, ": ", ctx.describe(), ": rank ", r, " passed reduction ",
                         name_of(d.reduce), " root ", d.root, ", rank 0 passed ",
                         name_of(ref.reduce), " root ", ref.root);
      }
    }
    if (ref.op == CommOp::all_to_all_v) {
      for (int src = 0; src < size(); ++src) {
        for (int dst = 0; dst < size(); ++dst) {
          const std::size_t sent = slots[static_cast<std::size_t>(src)].send_counts[dst];
          const std::size_t expected = slots[static_cast<std::size_t>(dst)].recv_counts[src];
          if (sent != expected) {
            raise<CommError>(ctx.comm, ": ", ctx.describe(), ": rank ", src, " sends ", sent,
                             " elements to rank ", dst, " but rank ", dst, " expects ", expected,
                             " from it (send_counts[", dst, "] vs recv_counts[", src, "])");
          }
        }
      }
    }
  }

  /// World ranks of the given group ranks.
  std::vector<int> world_ranks(const std::vector<int>& group_ranks) const {
    std::vector<int> out;
    for (int r : group_ranks) out.push_back(members[static_cast<std::size_t>(r)]);
    return out;
  }

  /// Throws the CommError that tells a waiting rank that another rank failed.
  void throw_if_aborted(const OpContext& ctx) const {
    if (world->aborted) {
      raise<CommError>(ctx.comm, ": ", ctx.describe(), " aborted: world rank ", world->failed_rank,
                       " failed: ", world->failure);
    }
  }

  /// Throws the CommError that tells a rank that the group broke at an earlier rendezvous.
  void throw_if_broken(const OpContext& ctx) const {
    if (!broken.empty()) {
      raise<CommError>(ctx.comm, ": ", ctx.describe(),
                       ": the group is unusable since a rank failed in an op on it: ", broken);
    }
  }

  /// The group of the split with sequence number seq for color: created by the first member
  /// to ask, shared with the others. members_of_color lists (key, old rank) sorted.
  std::shared_ptr<LocalGroup> split_group(std::uint64_t seq, int color,
                                          const std::vector<int>& new_members) {
    std::lock_guard lock(world->mutex);
    auto [it, inserted] = splits.try_emplace({seq, color});
    if (inserted) {
      it->second.first = std::make_shared<LocalGroup>(world, new_members, world->next_group_id++);
      it->second.second = static_cast<int>(new_members.size());
    }
    auto group = it->second.first;
    if (--it->second.second == 0) splits.erase(it);
    return group;
  }

  /// Queues an eager message from src to dst with tag.
  void post(int src, int dst, int tag, LocalMessage message) {
    {
      std::lock_guard lock(world->mutex);
      mailboxes[{src, dst, tag}].push_back(std::move(message));
    }
    world->cv.notify_all();
  }

  /// Waits for the next message from src to dst with tag and removes it from the mailbox.
  /// Throws, as every op does, once the world aborted or the group broke, even where the
  /// message is already queued: a broken group's queue holds what a failed exchange left.
  LocalMessage take(int src, int dst, int tag, CommClock::time_point deadline, const OpContext& ctx,
                    double timeout_s) {
    std::unique_lock lock(world->mutex);
    for (;;) {
      throw_if_aborted(ctx);
      throw_if_broken(ctx);
      auto it = mailboxes.find({src, dst, tag});
      if (it != mailboxes.end() && !it->second.empty()) {
        LocalMessage message = std::move(it->second.front());
        it->second.pop_front();
        return message;
      }
      if (world->left[static_cast<std::size_t>(members[static_cast<std::size_t>(src)])]) {
        raise<CommError>(ctx.comm, ": ", ctx.describe(), ": waiting for a message from rank ", src,
                         " with tag ", tag, ", but rank ", src,
                         " returned from its function without sending it");
      }
      if (world->cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        auto again = mailboxes.find({src, dst, tag});
        if (again != mailboxes.end() && !again->second.empty()) continue;
        raise<CommError>(ctx.comm, ": ", ctx.describe(), " timed out after ", timeout_s,
                         " s waiting for a message from rank ", src, " (world rank ",
                         members[static_cast<std::size_t>(src)], ") with tag ", tag);
      }
    }
  }
};

}  // namespace zero::parallel::detail
