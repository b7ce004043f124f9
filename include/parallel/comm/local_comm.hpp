#pragma once
// LocalComm: N ranks as threads of one process, moving real data between the ranks' buffers
// through shared memory. The embedded default backend: tests and the quick start need no
// launcher. It is BasicLocalComm<HostMover>; the same rendezvous over device memory is
// CudaLocalComm (cuda_local_comm.cuh), which differs only in its Mover (local_mover.hpp): the
// policy that moves and reduces the bytes.
//
// Every collective is a rendezvous: each rank posts a descriptor (op, dtype, count, buffer
// pointers), all ranks check that the descriptors agree, then each rank moves its own share of
// the data (rank r reduces chunk r of an all_reduce, its own output of a reduce_scatter, ...)
// and a release keeps every buffer alive until all ranks are done with it.
// Reductions fold ranks in rank order, so a run is bitwise reproducible.
// Point-to-point sends are eager (copied into a mailbox), so a send never blocks.
// Async ops run in issue order on a per-rank progress thread; a blocking op first waits for
// the rank's pending async ops, so all ops of a rank keep one order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/comm/local_mover.hpp>
#include <parallel/comm/local_world.hpp>
#include <parallel/comm/progress_thread.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <parallel/comm/work.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

namespace detail {

/// Elements [begin, end) of chunk `part` when count elements are split over parts nearly evenly.
inline std::pair<std::size_t, std::size_t> chunk_bounds(std::size_t count, int parts, int part) {
  const std::size_t n = static_cast<std::size_t>(parts), p = static_cast<std::size_t>(part);
  return {count * p / n, count * (p + 1) / n};
}

/// One rank's view of a LocalGroup: its rank, name, options, logger, the mover of its memory and
/// its progress thread.
template <LocalMover Mover>
struct LocalRank {
  /// A rank whose memory lives at place.
  explicit LocalRank(typename Mover::Place place) : mover(place) {}

  std::shared_ptr<LocalGroup> group;
  int rank = 0;
  std::string name;
  CommOptions options;
  std::shared_ptr<CommLogger> logger;
  std::uint64_t next_seq = 0;  ///< touched only by the op running now (ops are serialised)
  /// When the async op running now was issued (zero while a blocking op runs): the logger's
  /// interval of an op starts there, so the time it waited behind the rank's earlier ops, or
  /// for the progress thread to get a core, counts as in flight, as a queued op on a stream's.
  CommClock::time_point issued{};
  bool grouping = false;                        ///< between group_start and group_end
  std::vector<std::function<void()>> deferred;  ///< receives posted inside a group
  Mover mover;              ///< moves this rank's share of every op; outlives the progress thread
  ProgressThread progress;  ///< declared last: joined first, while the rest is alive

  /// Context for error messages of op moving bytes of dtype.
  OpContext context(CommOp op, std::uint64_t seq, std::size_t bytes, DType dtype) const {
    const int world_rank = group->members[static_cast<std::size_t>(rank)];
    return {op, seq, bytes, dtype, name, rank, group->size(), world_rank, Mover::comm_name};
  }

  /// The start of the running op's interval in the logger: when it was issued, or now.
  CommClock::time_point interval_start() const {
    return issued != CommClock::time_point{} ? issued : CommClock::now();
  }

  /// The choke point of every collective: rendezvous, validation, data movement by body,
  /// release (every rank's movement has finished), logging. bytes is the nccl-tests S of the op.
  template <class Body>
  void collective(OpDesc desc, std::size_t bytes, Body&& body) {
    desc.seq = next_seq++;
    const OpContext ctx = context(desc.op, desc.seq, bytes, desc.dtype);
    const auto start = interval_start();
    const auto deadline = deadline_after(options.timeout_s);
    // A failure outside the rendezvous (the rank's stream past the deadline, a move that threw)
    // breaks the group as one inside it does: the others must not complete this op, or the
    // next, without this rank. The descriptors' disagreement, which every rank sees alike, does
    // not.
    const auto breaking = [&](auto&& step) {
      try {
        step();
      } catch (const std::exception& e) {
        group->break_with(e.what());
        throw;
      }
    };
    breaking([&] { mover.begin(ctx, deadline); });
    group->arrive(rank, &desc, deadline, ctx, options.timeout_s);
    // Past the rendezvous every rank has posted buffers the others read and write: each rank
    // leaves only through the release, once all have finished with them (a rank that failed
    // meanwhile, or whose world aborted, still waits for the peers writing into its memory).
    if (std::string error = group->validation_error(ctx); !error.empty()) {
      group->release(false);
      throw CommError(error);
    }
    try {
      breaking([&] {
        body(group->slots);
        mover.end(ctx, deadline);
      });
    } catch (...) {
      group->break_with("a rank's share of the op threw a non-standard exception");  // if not yet
      group->release(true);
      throw;
    }
    // A peer whose share of this op failed broke the group: the op did not complete everywhere,
    // so no rank goes on as if it had.
    if (group->release(false)) {
      std::lock_guard lock(group->world->mutex);
      group->throw_if_broken(ctx);
    }
    if (logger) {
      logger->record(desc.op, name, group->size(), bytes, start, CommClock::now());
    }
  }
};

}  // namespace detail

/// A communicator whose ranks are threads of this process, exchanging the memory Mover moves
/// (see the file comment).
template <LocalMover Mover>
class BasicLocalComm {
  using Rank = detail::LocalRank<Mover>;

 public:
  /// The prefix of this communicator's errors ("LocalComm", "CudaLocalComm").
  static constexpr std::string_view comm_name = Mover::comm_name;

  /// Runs fn(comm) on n threads, one per rank, and joins them. If a rank throws, the ranks
  /// waiting on it get a CommError naming it, and run rethrows the first exception.
  /// Each rank's host kernels get an equal share of the caller's OpenMP threads (at least one),
  /// so n ranks do not start n full thread teams on the same cores.
  /// Every rank's memory is at the place current on the calling thread (for CudaLocalComm, the
  /// current device).
  static void run(int n, const std::function<void(BasicLocalComm&)>& fn, CommOptions options = {}) {
    expect<CommError>(n >= 1 && n <= Mover::max_ranks, comm_name, "::run: needs 1 to ",
                      Mover::max_ranks, " ranks, got ", n);
    const typename Mover::Place place = Mover::current_place();
    [[maybe_unused]] const int rank_threads = threads_per_rank(n);
    auto world = std::make_shared<detail::LocalWorld>(n);
    std::vector<int> members(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) members[static_cast<std::size_t>(r)] = r;
    auto group = std::make_shared<detail::LocalGroup>(world, std::move(members), 0);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
#if defined(_OPENMP)
          omp_set_num_threads(rank_threads);
#endif
          auto state = std::make_shared<Rank>(place);
          state->group = group;
          state->rank = r;
          state->name = "world";
          state->options = options;
          BasicLocalComm comm(std::move(state));
          fn(comm);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          world->abort(r, what_of(errors[static_cast<std::size_t>(r)]));
        }
        world->leave(r);
      });
    }
    for (auto& t : threads) t.join();
    if (world->failed_rank >= 0) {
      std::rethrow_exception(errors[static_cast<std::size_t>(world->failed_rank)]);
    }
  }

  /// The OpenMP threads each of n rank threads gets: the caller's count divided by n, at least
  /// one (1 without OpenMP).
  static int threads_per_rank(int n) {
#if defined(_OPENMP)
    return std::max(1, omp_get_max_threads() / std::max(1, n));
#else
    (void)n;
    return 1;
#endif
  }

  /// A null communicator (what split with undefined_color returns).
  BasicLocalComm() = default;

  /// This rank's index in the group.
  int rank() const {
    return state_ ? state_->rank : -1;
  }
  /// Number of ranks in the group (0 for a null communicator).
  int size() const {
    return state_ ? state_->group->size() : 0;
  }
  /// True for the communicator split returns to ranks that passed undefined_color.
  bool is_null() const {
    return state_ == nullptr;
  }
  /// The group's name in logs and errors ("world", "tp", ...).
  const std::string& name() const {
    return checked().name;
  }
  /// World rank of group rank r.
  int world_rank(int r) const {
    return checked().group->members.at(static_cast<std::size_t>(r));
  }
  /// This communicator's options.
  const CommOptions& options() const {
    return checked().options;
  }
  /// Replaces the options (e.g. a shorter deadline) for this rank's later ops. Waits for the
  /// rank's pending async ops first: they read the options while they run.
  void set_options(const CommOptions& options) {
    auto& s = checked();
    s.progress.drain();
    s.options = options;
  }
  /// Logs this rank's later ops into logger (shared with communicators split from this one
  /// later); waits for the pending async ops first, as set_options does.
  void set_logger(std::shared_ptr<CommLogger> logger) {
    auto& s = checked();
    s.progress.drain();
    s.logger = std::move(logger);
  }
  /// The logger, or null.
  CommLogger* logger() const {
    return checked().logger.get();
  }
  /// The mover of this rank's memory (CudaLocalComm: its stream).
  Mover& mover() const {
    return checked().mover;
  }
  /// The stream this rank's ops run on, for a mover of device memory (CudaLocalComm); order the
  /// producers of an op's buffers before it.
  auto device_stream() const requires requires(const Mover& m) {
    m.stream();
  }
  { return checked().mover.stream(); }

  /// Splits the group: ranks passing the same color form a new group, ordered by (key, rank);
  /// undefined_color gives a null communicator. Collective over this group. name names the
  /// new group in logs and errors (default: "<parent>.split(<color>)").
  BasicLocalComm split(int color, int key, std::string_view name = {}) {
    auto& s = checked();
    s.progress.drain();
    detail::OpDesc desc;
    desc.op = CommOp::split;
    desc.color = color;
    desc.key = key;
    std::shared_ptr<Rank> child;
    s.collective(desc, 0, [&](const std::vector<detail::OpDesc>& slots) {
      if (color < 0) return;
      std::vector<std::pair<int, int>> order;  // (key, old rank) of the ranks with our color
      for (int r = 0; r < static_cast<int>(slots.size()); ++r) {
        if (slots[static_cast<std::size_t>(r)].color == color) {
          order.emplace_back(slots[static_cast<std::size_t>(r)].key, r);
        }
      }
      std::sort(order.begin(), order.end());
      std::vector<int> members;
      int new_rank = 0;
      for (std::size_t i = 0; i < order.size(); ++i) {
        members.push_back(s.group->members[static_cast<std::size_t>(order[i].second)]);
        if (order[i].second == s.rank) new_rank = static_cast<int>(i);
      }
      child = std::make_shared<Rank>(s.mover.place());
      child->group =
          s.group->split_group(slots[static_cast<std::size_t>(s.rank)].seq, color, members);
      child->rank = new_rank;
      child->name =
          name.empty() ? zero::detail::concat(s.name, ".split(", color, ")") : std::string(name);
      child->options = s.options;
      child->logger = s.logger;
    });
    return BasicLocalComm(std::move(child));
  }

  // ---- collectives (blocking) -------------------------------------------------------------

  /// recv[i] = op over ranks of send[i]; send and recv may be the same span.
  template <CommElement T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op) {
    blocking([&](Rank& s) { do_all_reduce<T>(s, send, recv, op); });
  }
  /// In-place all_reduce of buf.
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op) {
    all_reduce<T>(buf, buf, op);
  }
  /// recv (count) = op over ranks of chunk rank() of send (size()*count).
  template <CommElement T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                      ReduceOp op) {
    blocking([&](Rank& s) { do_reduce_scatter<T>(s, send, recv, op); });
  }
  /// Chunk q of recv (size()*count) = send (count) of rank q.
  template <CommElement T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    blocking([&](Rank& s) { do_all_gather<T>(s, send, recv); });
  }
  /// Every rank's buf = root's buf.
  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    blocking([&](Rank& s) { do_broadcast<T>(s, buf, root); });
  }
  /// Chunk q of recv = chunk rank() of rank q's send; both hold size()*count elements.
  template <CommElement T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    blocking([&](Rank& s) { do_all_to_all<T>(s, send, recv); });
  }
  /// Variable all_to_all: send packs send_counts[q] elements for each rank q in rank order,
  /// recv receives recv_counts[q] elements from each rank q in rank order.
  template <CommElement T>
  void all_to_all_v(std::span<const std::type_identity_t<T>> send,
                    std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) {
    blocking([&](Rank& s) { do_all_to_all_v<T>(s, send, send_counts, recv, recv_counts); });
  }
  /// Sends buf to peer (eager: returns once copied).
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  void send(std::span<T> buf, int peer, int tag = 0) {
    using E = std::remove_const_t<T>;
    blocking([&](Rank& s) { do_send<E>(s, std::span<const E>(buf), peer, tag); });
  }
  /// Receives buf from peer; inside group_start/group_end it completes at group_end.
  template <CommElement T>
  void recv(std::span<T> buf, int peer, int tag = 0) {
    auto& s = checked();
    if (s.grouping) {
      s.deferred.push_back([&s, buf, peer, tag] { do_recv<T>(s, buf, peer, tag); });
      return;
    }
    blocking([&](Rank& st) { do_recv<T>(st, buf, peer, tag); });
  }
  /// Returns once every rank of the group has called barrier.
  void barrier() {
    blocking([&](Rank& s) { do_barrier(s); });
  }

  /// Starts a batch of point-to-point ops; receives complete at group_end (NCCL's group
  /// semantics, so a pipeline's exchange in any order cannot deadlock).
  void group_start() {
    checked().grouping = true;
  }
  /// Completes the receives posted since group_start, in order. One that fails (a size
  /// mismatch, its deadline) with receives after it breaks the group, so every later op fails,
  /// a receive whose message is already queued included.
  void group_end() {
    auto& s = checked();
    s.grouping = false;
    auto deferred = std::move(s.deferred);
    s.deferred.clear();
    s.progress.drain();
    for (std::size_t i = 0; i < deferred.size(); ++i) {
      try {
        deferred[i]();
      } catch (const std::exception& e) {
        if (i + 1 < deferred.size()) {
          s.group->break_with(
              zero::detail::concat("a grouped receive failed with ", deferred.size() - i - 1,
                                   " receives of its group not taken (", e.what(), ")"));
        }
        throw;
      }
    }
  }

  // ---- collectives (async) ----------------------------------------------------------------

  /// Async all_reduce; buffers must stay alive until the Work completes.
  template <CommElement T>
  [[nodiscard]] Work all_reduce_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv, ReduceOp op) {
    return async([=](Rank& s) { do_all_reduce<T>(s, send, recv, op); });
  }
  /// Async reduce_scatter.
  template <CommElement T>
  [[nodiscard]] Work reduce_scatter_async(std::span<const std::type_identity_t<T>> send,
                                          std::span<T> recv, ReduceOp op) {
    return async([=](Rank& s) { do_reduce_scatter<T>(s, send, recv, op); });
  }
  /// Async all_gather.
  template <CommElement T>
  [[nodiscard]] Work all_gather_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    return async([=](Rank& s) { do_all_gather<T>(s, send, recv); });
  }
  /// Async broadcast.
  template <CommElement T>
  [[nodiscard]] Work broadcast_async(std::span<T> buf, int root) {
    return async([=](Rank& s) { do_broadcast<T>(s, buf, root); });
  }
  /// Async all_to_all.
  template <CommElement T>
  [[nodiscard]] Work all_to_all_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    return async([=](Rank& s) { do_all_to_all<T>(s, send, recv); });
  }
  /// Async all_to_all_v; the count arrays must stay alive too.
  template <CommElement T>
  [[nodiscard]] Work all_to_all_v_async(std::span<const std::type_identity_t<T>> send,
                                        std::span<const std::size_t> send_counts, std::span<T> recv,
                                        std::span<const std::size_t> recv_counts) {
    return async([=](Rank& s) { do_all_to_all_v<T>(s, send, send_counts, recv, recv_counts); });
  }
  /// Async send.
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  [[nodiscard]] Work send_async(std::span<T> buf, int peer, int tag = 0) {
    using E = std::remove_const_t<T>;
    const std::span<const E> data(buf);
    return async([=](Rank& s) { do_send<E>(s, data, peer, tag); });
  }
  /// Async recv.
  template <CommElement T>
  [[nodiscard]] Work recv_async(std::span<T> buf, int peer, int tag = 0) {
    return async([=](Rank& s) { do_recv<T>(s, buf, peer, tag); });
  }
  /// Async barrier.
  [[nodiscard]] Work barrier_async() {
    return async([](Rank& s) { do_barrier(s); });
  }

 private:
  explicit BasicLocalComm(std::shared_ptr<Rank> state) : state_(std::move(state)) {}

  Rank& checked() const {
    expect<CommError>(state_ != nullptr, comm_name,
                      ": this is a null communicator (split with undefined_color)");
    return *state_;
  }

  static std::string what_of(const std::exception_ptr& error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "an exception not derived from std::exception";
    }
  }

  template <class Fn>
  void blocking(Fn&& fn) {
    auto& s = checked();
    s.progress.drain();  // this op must come after the rank's pending async ops
    fn(s);
  }

  template <class Fn>
  Work async(Fn fn) {
    auto state = state_;
    expect<CommError>(state != nullptr, comm_name, ": async op on a null communicator");
    auto work = std::make_shared<detail::CompletionState>();
    const auto issued = CommClock::now();
    state->progress.submit([state_ptr = state.get(), work, issued, fn = std::move(fn)] {
      std::exception_ptr error;
      state_ptr->issued = issued;
      try {
        fn(*state_ptr);
      } catch (...) {
        error = std::current_exception();
      }
      state_ptr->issued = {};
      // Outside the handler: the exception is now owned by `error` alone, and fail() hands it
      // over under the state's mutex, so the waiter ends up with the last reference and the
      // CommError is read and destroyed on the same thread (the handler's reference would
      // otherwise be released here, after the waiter read it, through libstdc++'s reference
      // count, which ThreadSanitizer cannot see).
      if (error) {
        work->fail(std::move(error));
      } else {
        work->complete();
      }
    });
    return Work(std::move(work));
  }

  template <class T>
  static detail::OpDesc describe(CommOp op, const void* send, void* recv, std::size_t count) {
    detail::OpDesc d;
    d.op = op;
    d.dtype = dtype_of<T>;
    d.send = send;
    d.recv = recv;
    d.count = count;
    return d;
  }

  template <class T>
  static void check_size(const Rank& s, CommOp op, std::string_view what, std::size_t got,
                         std::size_t expected) {
    std::string_view type = "size_t";
    if constexpr (CommElement<T>) type = name_of(dtype_of<T>);
    expect<CommError>(got == expected, comm_name, ": ", name_of(op), " on group '", s.name,
                      "' at rank ", s.rank, ": ", what, " holds ", got, " elements of ", type,
                      ", expected ", expected);
  }

  template <class T>
  static void do_all_reduce(Rank& s, std::span<const T> send, std::span<T> recv, ReduceOp op) {
    check_size<T>(s, CommOp::all_reduce, "recv", recv.size(), send.size());
    auto desc = describe<T>(CommOp::all_reduce, send.data(), recv.data(), send.size());
    desc.reduce = op;
    s.collective(desc, send.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      const int n = static_cast<int>(slots.size());
      const auto [begin, end] = detail::chunk_bounds(send.size(), n, s.rank);
      std::vector<const T*> in(slots.size());
      std::vector<T*> out(slots.size());
      for (std::size_t q = 0; q < slots.size(); ++q) {
        in[q] = static_cast<const T*>(slots[q].send) + begin;
        out[q] = static_cast<T*>(slots[q].recv) + begin;
      }
      s.mover.template reduce<T>(op, in.data(), n, end - begin, out.data(), n);
    });
  }

  template <class T>
  static void do_reduce_scatter(Rank& s, std::span<const T> send, std::span<T> recv, ReduceOp op) {
    const std::size_t n = static_cast<std::size_t>(s.group->size());
    check_size<T>(s, CommOp::reduce_scatter, "send", send.size(), n * recv.size());
    auto desc = describe<T>(CommOp::reduce_scatter, send.data(), recv.data(), recv.size());
    desc.reduce = op;
    s.collective(desc, send.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      const std::size_t count = recv.size();
      std::vector<const T*> in(slots.size());
      for (std::size_t q = 0; q < slots.size(); ++q) {
        in[q] = static_cast<const T*>(slots[q].send) + static_cast<std::size_t>(s.rank) * count;
      }
      T* out = recv.data();
      s.mover.template reduce<T>(op, in.data(), static_cast<int>(n), count, &out, 1);
    });
  }

  template <class T>
  static void do_all_gather(Rank& s, std::span<const T> send, std::span<T> recv) {
    const std::size_t n = static_cast<std::size_t>(s.group->size());
    check_size<T>(s, CommOp::all_gather, "recv", recv.size(), n * send.size());
    auto desc = describe<T>(CommOp::all_gather, send.data(), recv.data(), send.size());
    s.collective(desc, recv.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      const std::size_t count = send.size();
      for (std::size_t q = 0; q < n; ++q) {
        const T* src = static_cast<const T*>(slots[q].send);
        T* dst = recv.data() + q * count;
        if (src != dst && count) s.mover.copy(dst, src, count * sizeof(T));  // in place: skip
      }
    });
  }

  template <class T>
  static void do_broadcast(Rank& s, std::span<T> buf, int root) {
    expect<CommError>(root >= 0 && root < s.group->size(), comm_name, ": broadcast on group '",
                      s.name, "': root ", root, " is not a rank of this ", s.group->size(),
                      "-rank group");
    auto desc = describe<T>(CommOp::broadcast, buf.data(), buf.data(), buf.size());
    desc.root = root;
    s.collective(desc, buf.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      if (s.rank != root && !buf.empty()) {
        s.mover.copy(buf.data(), slots[static_cast<std::size_t>(root)].send, buf.size_bytes());
      }
    });
  }

  template <class T>
  static void do_all_to_all(Rank& s, std::span<const T> send, std::span<T> recv) {
    const std::size_t n = static_cast<std::size_t>(s.group->size());
    check_size<T>(s, CommOp::all_to_all, "recv", recv.size(), send.size());
    expect<CommError>(send.size() % n == 0, comm_name, ": all_to_all on group '", s.name,
                      "': send holds ", send.size(), " elements, not a multiple of the ", n,
                      " ranks");
    expect<CommError>(send.empty() || send.data() != recv.data(), comm_name,
                      ": all_to_all on group '", s.name,
                      "': send and recv must not be the same buffer");
    const std::size_t count = send.size() / n;
    auto desc = describe<T>(CommOp::all_to_all, send.data(), recv.data(), count);
    s.collective(desc, send.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      for (std::size_t q = 0; q < n; ++q) {
        const T* src =
            static_cast<const T*>(slots[q].send) + static_cast<std::size_t>(s.rank) * count;
        if (count) s.mover.copy(recv.data() + q * count, src, count * sizeof(T));
      }
    });
  }

  template <class T>
  static void do_all_to_all_v(Rank& s, std::span<const T> send,
                              std::span<const std::size_t> send_counts, std::span<T> recv,
                              std::span<const std::size_t> recv_counts) {
    const std::size_t n = static_cast<std::size_t>(s.group->size());
    check_size<std::size_t>(s, CommOp::all_to_all_v, "send_counts", send_counts.size(), n);
    check_size<std::size_t>(s, CommOp::all_to_all_v, "recv_counts", recv_counts.size(), n);
    std::size_t total_send = 0, total_recv = 0;
    for (std::size_t q = 0; q < n; ++q) {
      total_send += send_counts[q];
      total_recv += recv_counts[q];
    }
    check_size<T>(s, CommOp::all_to_all_v, "send (sum of send_counts)", send.size(), total_send);
    check_size<T>(s, CommOp::all_to_all_v, "recv (sum of recv_counts)", recv.size(), total_recv);
    auto desc = describe<T>(CommOp::all_to_all_v, send.data(), recv.data(), n);
    desc.send_counts = send_counts.data();
    desc.recv_counts = recv_counts.data();
    s.collective(desc, send.size_bytes(), [&](const std::vector<detail::OpDesc>& slots) {
      const std::size_t me = static_cast<std::size_t>(s.rank);
      std::size_t recv_offset = 0;
      for (std::size_t q = 0; q < n; ++q) {
        std::size_t send_offset = 0;  // where rank q packed the elements for ranks before me
        for (std::size_t p = 0; p < me; ++p) send_offset += slots[q].send_counts[p];
        const std::size_t len = recv_counts[q];
        if (len) {
          s.mover.copy(recv.data() + recv_offset,
                       static_cast<const T*>(slots[q].send) + send_offset, len * sizeof(T));
        }
        recv_offset += len;
      }
    });
  }

  template <class T>
  static void check_peer(const Rank& s, CommOp op, int peer) {
    expect<CommError>(peer >= 0 && peer < s.group->size() && peer != s.rank, comm_name, ": ",
                      name_of(op), " on group '", s.name, "' at rank ", s.rank, ": peer ", peer,
                      " must be another rank of this ", s.group->size(), "-rank group");
  }

  template <class T>
  static void do_send(Rank& s, std::span<const T> buf, int peer, int tag) {
    check_peer<T>(s, CommOp::send, peer);
    const auto start = s.interval_start();
    detail::LocalMessage message{dtype_of<T>, buf.size(), std::vector<std::byte>(buf.size_bytes())};
    if (!buf.empty()) {
      const auto ctx = s.context(CommOp::send, s.next_seq, buf.size_bytes(), dtype_of<T>);
      s.mover.to_host(message.data.data(), buf.data(), buf.size_bytes(), ctx,
                      deadline_after(s.options.timeout_s));
    }
    s.group->post(s.rank, peer, tag, std::move(message));
    if (s.logger) {
      s.logger->record(CommOp::send, s.name, 2, buf.size_bytes(), start, CommClock::now());
    }
  }

  template <class T>
  static void do_recv(Rank& s, std::span<T> buf, int peer, int tag) {
    check_peer<T>(s, CommOp::recv, peer);
    const auto start = s.interval_start();
    const auto ctx = s.context(CommOp::recv, s.next_seq, buf.size_bytes(), dtype_of<T>);
    const auto deadline = deadline_after(s.options.timeout_s);  // the message and its copy
    auto message = s.group->take(peer, s.rank, tag, deadline, ctx, s.options.timeout_s);
    expect<CommError>(message.dtype == dtype_of<T> && message.count == buf.size(), comm_name, ": ",
                      ctx.describe(), ": rank ", peer, " sent ", message.count, " elements of ",
                      name_of(message.dtype), " with tag ", tag, ", the receive expects ",
                      buf.size(), " elements of ", name_of(dtype_of<T>));
    if (!buf.empty()) {
      s.mover.from_host(buf.data(), message.data.data(), buf.size_bytes(), ctx, deadline);
    }
    if (s.logger) {
      s.logger->record(CommOp::recv, s.name, 2, buf.size_bytes(), start, CommClock::now());
    }
  }

  static void do_barrier(Rank& s) {
    s.collective(describe<std::uint8_t>(CommOp::barrier, nullptr, nullptr, 0), 0,
                 [](const std::vector<detail::OpDesc>&) {});
  }

  std::shared_ptr<Rank> state_;
};

/// The communicator of ranks as threads over host memory.
using LocalComm = BasicLocalComm<HostMover>;

static_assert(Communicator<LocalComm>);

}  // namespace zero::parallel
