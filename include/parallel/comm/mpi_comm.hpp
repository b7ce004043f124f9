// zero-requires: mpi
#pragma once
// MpiComm: the Communicator over MPI. Boost.MPI owns the environment and the communicators
// (boost::mpi::environment, boost::mpi::communicator); every op is plain nonblocking MPI
// (MPI_Iallreduce, MPI_Ialltoallv, ...; all_gather and reduce_scatter on groups of up to 8 ranks
// as MPI_Isend/MPI_Irecv exchanges, see mpi_direct.hpp) because Boost.MPI's collectives block
// and have no reduce-scatter or all-to-all-v, and nonblocking requests can be polled with
// MPI_Test against the deadline. A blocking op is its async form plus wait().
//
// bf16/f16 reductions are staged in fp32 (convert, reduce in float, round once), so they
// accumulate in fp32 like LocalComm's; avg is a sum divided on completion (MPI has no avg).
// Nonblocking collectives progress only inside MPI calls: an async op advances when its Work
// is tested or waited on, or when this rank calls MPI for something else.
// A timed-out collective names the ranks that never joined it: a census on the group's
// control channel (mpi_control.hpp) asks who else is stuck there. With
// CommOptions::verify_sequence every collective first checks that all ranks issue the same one,
// and an all_to_all_v that every rank's send counts match their receivers' receive counts.
// After a timed-out collective or send the communicator refuses every later op with a CommError
// (MPI cannot cancel them, and their posted messages could match a later op's; a timed-out
// receive is cancelled and leaves it usable); the usual recovery is to let the CommError end the
// job and restart it from the last checkpoint (the Engine refuses further steps, see
// docs/reliability.md).

#include <mpi.h>

#include <boost/mpi/communicator.hpp>
#include <boost/mpi/environment.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <parallel/comm/blocking_collectives.hpp>
#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/comm/mpi_algorithms.hpp>
#include <parallel/comm/mpi_control.hpp>
#include <parallel/comm/mpi_direct.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <parallel/comm/work.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

namespace detail {

/// MPI datatype that carries T's bits (bf16/f16 travel as 16-bit integers; they are never
/// reduced by MPI, see the file comment).
template <class T>
MPI_Datatype mpi_datatype() {
  if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint8_t>)
    return MPI_UINT8_T;
  else
    return MPI_UINT16_T;  // bf16, f16
}

/// MPI reduction for op (avg reduces with MPI_SUM and divides on completion).
inline MPI_Op mpi_reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

/// MPI's text for error code rc.
inline std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<std::size_t>(len));
}

/// A communicator's state shared by its handles and its pending Work.
struct MpiShared {
  std::shared_ptr<boost::mpi::environment> env;  ///< first member: finalises MPI last
  boost::mpi::communicator comm;
  std::string name;
  CommOptions options;
  std::shared_ptr<CommLogger> logger;
  std::atomic<std::uint64_t> next_seq{0};
  std::vector<int> world_ranks;  ///< MPI_COMM_WORLD rank of each rank, for messages
  /// A timed-out op's requests (MPI cannot cancel a collective) and the buffers they may still
  /// read or write: they stay alive until the requests complete.
  struct Abandoned {
    std::vector<MPI_Request> requests;
    std::vector<std::shared_ptr<void>> buffers;
  };
  std::mutex abandoned_mutex;        ///< guards abandoned (a Work may be dropped on any thread)
  std::vector<Abandoned> abandoned;  ///< timed-out ops not yet seen complete
  std::atomic<std::size_t> abandoned_count{0};  ///< abandoned.size(), read without the lock
  /// Set by the first op that timed out with requests MPI cannot cancel (a collective, a send):
  /// they stay posted, so a later op's messages could match them. Every op after is refused.
  std::atomic<bool> broken{false};
  std::string broken_by;  ///< that op, described; written once, before broken is set
  std::mutex broken_mutex;
  MPI_Comm control = MPI_COMM_NULL;   ///< the group's control channel (mpi_control.hpp)
  MPI_Comm exchange = MPI_COMM_NULL;  ///< direct exchanges' channel (mpi_direct.hpp), or null
  bool grouping = false;              ///< between group_start and group_end
  std::vector<std::shared_ptr<WorkState>> grouped;  ///< point-to-point ops posted in the group

  ~MpiShared() {
    // A timed-out collective may still complete if the late ranks joined meanwhile; buffers of
    // one that has not are left allocated, since MPI may still write them.
    reap_abandoned();
    for (Abandoned& a : abandoned) {
      if (a.buffers.empty()) continue;
      std::lock_guard lock(graveyard_mutex());
      graveyard().push_back(std::move(a.buffers));
    }
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (control != MPI_COMM_NULL && !finalized) MPI_Comm_free(&control);
    if (exchange != MPI_COMM_NULL && !finalized) MPI_Comm_free(&exchange);
  }

  /// Hands a timed-out op's requests and buffers over (see Abandoned).
  void abandon(std::vector<MPI_Request> requests, std::vector<std::shared_ptr<void>> buffers) {
    std::lock_guard lock(abandoned_mutex);
    abandoned.push_back({std::move(requests), std::move(buffers)});
    abandoned_count.store(abandoned.size(), std::memory_order_release);
  }
  /// Where buffers MPI may still write outlive their communicator: never freed, but reachable
  /// (a leak checker does not count them).
  static std::vector<std::vector<std::shared_ptr<void>>>& graveyard() {
    static auto* kept = new std::vector<std::vector<std::shared_ptr<void>>>();
    return *kept;
  }
  /// Guards graveyard (communicators end on whichever thread drops their last Work).
  static std::mutex& graveyard_mutex() {
    static std::mutex m;
    return m;
  }
  /// Frees the buffers of abandoned ops whose requests have completed since.
  /// Every op calls this: without abandoned ops it costs one atomic load, not the lock.
  void reap_abandoned() {
    if (abandoned_count.load(std::memory_order_acquire) == 0) return;
    std::lock_guard lock(abandoned_mutex);
    if (abandoned.empty()) return;
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) return;
    std::erase_if(abandoned, [](Abandoned& a) {
      int flag = 0;
      MPI_Testall(static_cast<int>(a.requests.size()), a.requests.data(), &flag,
                  MPI_STATUSES_IGNORE);
      return flag != 0;
    });
    abandoned_count.store(abandoned.size(), std::memory_order_release);
  }

  /// Marks the group unusable after op (see broken); the first caller's op is kept.
  void mark_broken(const std::string& op) {
    std::lock_guard lock(broken_mutex);
    if (broken.load(std::memory_order_relaxed)) return;
    broken_by = op;
    broken.store(true, std::memory_order_release);
  }
  /// CommError when the group is unusable.
  void throw_if_broken() const {
    if (!broken.load(std::memory_order_acquire)) return;
    raise<CommError>("MpiComm: group '", name, "' is unusable: ", broken_by,
                     " timed out earlier and MPI cannot cancel it (its messages could match a "
                     "later op's); end the job and restart it from the last checkpoint");
  }

  /// How long a census waits for the other ranks' reports: ranks stuck in the same collective
  /// time out up to their skew later, so a fraction of the deadline, at least 0.2 s.
  double census_grace_s() const { return std::clamp(0.2 * options.timeout_s, 0.2, 5.0); }

  /// This rank in the group.
  int rank() const { return comm.rank(); }
  /// Ranks in the group.
  int size() const { return comm.size(); }

  /// "all_reduce #3 (4096 bytes of f32) on group 'world' at rank 1 of 4 (world rank 1)".
  std::string describe(CommOp op, std::uint64_t seq, std::size_t bytes, DType dtype) const {
    return zero::detail::concat(name_of(op), " #", seq, " (", bytes, " bytes of ", name_of(dtype),
                                ") on group '", name, "' at rank ", rank(), " of ", size(),
                                " (world rank ", world_ranks[static_cast<std::size_t>(rank())],
                                ")");
  }
  /// "[0, 2, 4]": the world ranks of the group.
  std::string members() const {
    std::string out = "[";
    for (std::size_t i = 0; i < world_ranks.size(); ++i) {
      out += (i ? ", " : "") + std::to_string(world_ranks[i]);
    }
    return out + "]";
  }
};

/// One nonblocking MPI op: its request, what finishes it (unstaging, avg division, size
/// checks) and the buffers it must keep alive.
class MpiWork final : public WorkState {
 public:
  /// What names the op in errors and in the log.
  struct Info {
    CommOp op;
    std::uint64_t seq;
    std::size_t bytes;
    DType dtype;
    int peer = -1;  ///< point-to-point peer, or -1
  };

  /// An op of shared's group described by info; the caller starts it on request().
  MpiWork(std::shared_ptr<MpiShared> shared, Info info)
      : shared_(std::move(shared)), info_(info), start_(CommClock::now()) {}
  ~MpiWork() override {
    const bool pending = std::any_of(requests_.begin(), requests_.end(),
                                     [](MPI_Request r) { return r != MPI_REQUEST_NULL; });
    if (pending) shared_->abandon(std::move(requests_), std::move(keep_alive));
  }

  /// What names the op.
  const Info& info() const { return info_; }
  /// The request to fill (pass to MPI_I*).
  MPI_Request* request() { return requests_.data(); }
  /// count requests to fill, for an op made of several messages (it completes when all have).
  MPI_Request* requests(std::size_t count) {
    requests_.assign(count, MPI_REQUEST_NULL);
    return requests_.data();
  }
  /// Runs when the request completes (before the Work reports done); sees the status.
  std::function<void(const MPI_Status&)> on_complete;
  /// Buffers owned by the op (staging, counts) that must live until it completes.
  std::vector<std::shared_ptr<void>> keep_alive;
  /// Whether completion is logged (false for the sequence check, which is not a user op).
  bool logged = true;

  /// This op's record for the control channel (what the other ranks compare against theirs).
  MpiOpRecord record() const {
    // all_to_all_v moves a different number of bytes on every rank: its count is not compared.
    const std::uint64_t count =
        info_.op == CommOp::all_to_all_v ? 0 : info_.bytes / size_of(info_.dtype);
    return make_record(info_.op, info_.dtype, count, info_.seq, shared_->name);
  }

  /// Throws CommError naming the op when rc is not MPI_SUCCESS.
  void check(int rc, std::string_view call) const {
    if (rc == MPI_SUCCESS) return;
    raise<CommError>("MpiComm: ", describe(), ": ", call, " failed: ", mpi_error_string(rc));
  }

  bool done() override {
    if (finished_) return true;
    int flag = 0;
    MPI_Status status{};
    if (requests_.size() == 1) {
      check(MPI_Test(requests_.data(), &flag, &status), "MPI_Test");
    } else {
      check(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag,
                        MPI_STATUSES_IGNORE),
            "MPI_Testall");
    }
    if (flag) finish(status);
    return finished_;
  }

  void wait() override {
    if (finished_) {
      rethrow();
      return;
    }
    const auto deadline = deadline_after(shared_->options.timeout_s);
    // Poll rather than MPI_Wait, so the deadline holds. A nonblocking collective advances only
    // inside MPI calls, one round or fragment per call, so any sleep between polls is added to
    // every round: a 20 us sleep made a 1 MiB all_reduce 3x slower than the raw call. After a
    // short spin the loop yields instead, which leaves the core to an oversubscribed peer
    // without stalling the op's own progress.
    for (int polls = 0; !done(); ++polls) {
      if (CommClock::now() > deadline) timeout();
      if (polls > 1000) std::this_thread::yield();
    }
    rethrow();
  }

 private:
  std::string describe() const {
    return shared_->describe(info_.op, info_.seq, info_.bytes, info_.dtype);
  }

  // Raises the CommError of an op past its deadline, except for a receive whose message
  // arrived after all (then it finishes as if in time and returns).
  void timeout() {
    bool stuck = info_.op != CommOp::recv;
    if (info_.op == CommOp::recv) {
      // A receive not yet matched is cancelled, which leaves the communicator usable. One that
      // matched a message cannot be: its data may still be on the way (a large message moves
      // only while the sender calls into MPI), so a plain MPI_Wait could block past any
      // deadline. Wait the census grace for either outcome.
      MPI_Cancel(requests_.data());
      const auto grace = deadline_after(shared_->census_grace_s());
      int flag = 0;
      MPI_Status status{};
      while (MPI_Test(requests_.data(), &flag, &status) == MPI_SUCCESS && !flag &&
             CommClock::now() < grace) {
        std::this_thread::yield();
      }
      int cancelled = 0;
      if (flag) MPI_Test_cancelled(&status, &cancelled);
      if (flag && !cancelled) {
        finish(status);  // the message came in whole: not a timeout
        return;
      }
      // Still matched and moving: left posted (its buffer may yet be written) with the group
      // broken, as a send that timed out.
      stuck = !flag;
    }
    finished_ = true;
    if (stuck) shared_->mark_broken(describe());
    if (info_.peer >= 0) {
      raise<CommError>("MpiComm: ", describe(), " timed out after ", shared_->options.timeout_s,
                       " s waiting for rank ", info_.peer, " (world rank ",
                       shared_->world_ranks[static_cast<std::size_t>(info_.peer)], ")");
    }
    const std::string who = census(shared_->control, shared_->rank(), shared_->size(), record(),
                                   shared_->census_grace_s(), shared_->world_ranks);
    raise<CommError>("MpiComm: ", describe(), " timed out after ", shared_->options.timeout_s,
                     " s: not every rank of the group (world ranks ", shared_->members(),
                     ") joined it: ", who,
                     ". Every rank of a group must issue the same collectives in the same order; "
                     "raise CommOptions::timeout_s if the op is legitimately slow");
  }

  void finish(const MPI_Status& status) {
    finished_ = true;
    requests_.assign(requests_.size(), MPI_REQUEST_NULL);
    try {
      if (on_complete) on_complete(status);
    } catch (...) {
      error_ = std::current_exception();
    }
    keep_alive.clear();
    if (logged && shared_->logger) {
      shared_->logger->record(info_.op, shared_->name, info_.peer >= 0 ? 2 : shared_->size(),
                              info_.bytes, start_, CommClock::now());
    }
  }

  void rethrow() {
    if (error_) std::rethrow_exception(error_);
  }

  std::shared_ptr<MpiShared> shared_;
  Info info_;
  CommClock::time_point start_;
  std::vector<MPI_Request> requests_{MPI_REQUEST_NULL};
  bool finished_ = false;
  std::exception_ptr error_;
};

/// count as an MPI int count, or a CommError naming the op.
inline int mpi_count(std::size_t count, CommOp op) {
  expect<CommError>(count <= static_cast<std::size_t>(INT_MAX), "MpiComm: ", name_of(op), " of ",
                    count, " elements exceeds MPI's int count limit; split the buffer");
  return static_cast<int>(count);
}

/// True when the byte ranges [a, a+na) and [b, b+nb) overlap.
inline bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
  auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return na && nb && pa < pb + nb && pb < pa + na;
}

}  // namespace detail

/// A communicator over MPI processes (see the file comment).
class MpiComm : public BlockingCollectives<MpiComm> {
 public:
  /// A null communicator (what split with undefined_color returns).
  MpiComm() = default;

  /// Initialises MPI with MPI_THREAD_MULTIPLE (async Work may be waited on from any thread)
  /// unless it already is, and returns MPI_COMM_WORLD. MPI is finalised when the last
  /// communicator that initialised it is destroyed. Collective: every rank calls it, because
  /// it duplicates MPI_COMM_WORLD for the control channel (mpi_control.hpp).
  static MpiComm world(int& argc, char**& argv, CommOptions options = {}) {
    auto env =
        std::make_shared<boost::mpi::environment>(argc, argv, boost::mpi::threading::multiple,
                                                  /*abort_on_exception=*/false);
    return from_env(std::move(env), options);
  }
  /// MPI_COMM_WORLD, initialising MPI without arguments if nobody has.
  static MpiComm world(CommOptions options = {}) {
    auto env = std::make_shared<boost::mpi::environment>(boost::mpi::threading::multiple,
                                                         /*abort_on_exception=*/false);
    return from_env(std::move(env), options);
  }

  /// The MPI thread level MPI granted (MPI_THREAD_MULTIPLE = async from any thread).
  static int thread_level() {
    int level = 0;
    MPI_Query_thread(&level);
    return level;
  }

  /// This rank's index in the group.
  int rank() const { return shared_ ? shared_->rank() : -1; }
  /// Number of ranks (0 for a null communicator).
  int size() const { return shared_ ? shared_->size() : 0; }
  /// True for the communicator split returns to ranks that passed undefined_color.
  bool is_null() const { return shared_ == nullptr; }
  /// The group's name in logs and errors.
  const std::string& name() const { return checked().name; }
  /// The MPI communicator, for calls zero does not wrap.
  MPI_Comm native_handle() const { return static_cast<MPI_Comm>(checked().comm); }
  /// The Boost.MPI communicator.
  const boost::mpi::communicator& boost_comm() const { return checked().comm; }
  /// This communicator's options.
  const CommOptions& options() const { return checked().options; }
  /// Replaces the options for later ops.
  void set_options(const CommOptions& options) { checked().options = options; }
  /// Logs this rank's ops into logger (inherited by communicators split later).
  void set_logger(std::shared_ptr<CommLogger> logger) { checked().logger = std::move(logger); }
  /// The logger, or null.
  CommLogger* logger() const { return checked().logger.get(); }

  /// Splits the group (MPI_Comm_split); undefined_color gives a null communicator. A barrier
  /// under the deadline runs first, because MPI_Comm_split itself cannot time out.
  MpiComm split(int color, int key, std::string_view name = {}) {
    auto& s = checked();
    barrier();
    MPI_Comm out = MPI_COMM_NULL;
    const int rc =
        MPI_Comm_split(static_cast<MPI_Comm>(s.comm), color < 0 ? MPI_UNDEFINED : color, key, &out);
    expect<CommError>(rc == MPI_SUCCESS, "MpiComm: split of group '", s.name,
                      "' failed: ", detail::mpi_error_string(rc));
    if (out == MPI_COMM_NULL) return MpiComm();
    auto child = std::make_shared<detail::MpiShared>();
    child->env = s.env;
    child->comm = boost::mpi::communicator(out, boost::mpi::comm_take_ownership);
    child->name =
        name.empty() ? zero::detail::concat(s.name, ".split(", color, ")") : std::string(name);
    child->options = s.options;
    child->logger = s.logger;
    child->world_ranks = world_ranks_of(out);
    child->control = duplicate(out, child->name, "control channel");
    if (detail::direct_exchange(child->size())) {
      child->exchange = duplicate(out, child->name, "direct exchanges");
    }
    return MpiComm(std::move(child));
  }

  // ---- blocking: collectives come from BlockingCollectives (async form, waited on) ---------

  /// Sends buf to peer; inside group_start/group_end it completes at group_end.
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  void send(std::span<T> buf, int peer, int tag = 0) {
    auto work = send_async(buf, peer, tag);
    finish_or_defer(std::move(work));
  }
  /// Receives buf from peer; inside group_start/group_end it completes at group_end.
  template <CommElement T>
  void recv(std::span<T> buf, int peer, int tag = 0) {
    finish_or_defer(recv_async<T>(buf, peer, tag));
  }
  /// Returns once every rank has called barrier.
  void barrier() { barrier_async().wait(); }

  /// Starts a batch of point-to-point ops: they are all posted, and complete at group_end, so
  /// a pipeline's exchange in any order cannot deadlock.
  void group_start() { checked().grouping = true; }
  /// Waits for the point-to-point ops posted since group_start.
  void group_end() {
    auto& s = checked();
    s.grouping = false;
    auto pending = std::move(s.grouped);
    s.grouped.clear();
    for (auto& w : pending) w->wait();
  }

  // ---- async ---------------------------------------------------------------------------------

  /// Async all_reduce; buffers must stay alive until the Work completes.
  template <CommElement T>
  [[nodiscard]] Work all_reduce_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv, ReduceOp op) {
    expect_size(CommOp::all_reduce, "recv", recv.size(), send.size());
    auto w = make_work(CommOp::all_reduce, send.size_bytes(), dtype_of<T>);
    const int count = detail::mpi_count(send.size(), CommOp::all_reduce);
    const MPI_Comm comm = native_handle();
    const int n = size();
    detail::IallreduceAlgorithm::instance().set(detail::iallreduce_algorithm(
        n, send.size() * (is_half_type<T> ? sizeof(float) : sizeof(T))));
    if constexpr (is_half_type<T>) {
      auto in = staged(send), out = std::make_shared<std::vector<float>>(send.size());
      w->keep_alive = {in, out};
      w->check(MPI_Iallreduce(in->data(), out->data(), count, MPI_FLOAT, detail::mpi_reduce_op(op),
                              comm, w->request()),
               "MPI_Iallreduce");
      w->on_complete = [out, recv, op, n](const MPI_Status&) { unstage(*out, recv, op, n); };
    } else {
      const void* src = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
      w->check(MPI_Iallreduce(src, recv.data(), count, detail::mpi_datatype<T>(),
                              detail::mpi_reduce_op(op), comm, w->request()),
               "MPI_Iallreduce");
      if (op == ReduceOp::avg) w->on_complete = [recv, n](const MPI_Status&) { divide(recv, n); };
    }
    return Work(std::move(w));
  }
  /// Async reduce_scatter: a direct exchange on small groups (mpi_direct.hpp), else
  /// MPI_Ireduce_scatter_block.
  template <CommElement T>
  [[nodiscard]] Work reduce_scatter_async(std::span<const std::type_identity_t<T>> send,
                                          std::span<T> recv, ReduceOp op) {
    const int n = size();
    expect_size(CommOp::reduce_scatter, "send", send.size(),
                recv.size() * static_cast<std::size_t>(n));
    auto w = make_work(CommOp::reduce_scatter, send.size_bytes(), dtype_of<T>);
    const int count = detail::mpi_count(recv.size(), CommOp::reduce_scatter);
    const MPI_Comm comm = native_handle();
    if (checked().exchange != MPI_COMM_NULL) {
      direct_reduce_scatter(*w, send, recv, op, count);
    } else if constexpr (is_half_type<T>) {
      auto in = staged(send), out = std::make_shared<std::vector<float>>(recv.size());
      w->keep_alive = {in, out};
      w->check(MPI_Ireduce_scatter_block(in->data(), out->data(), count, MPI_FLOAT,
                                         detail::mpi_reduce_op(op), comm, w->request()),
               "MPI_Ireduce_scatter_block");
      w->on_complete = [out, recv, op, n](const MPI_Status&) { unstage(*out, recv, op, n); };
    } else {
      const void* src = send.data();
      if (detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) {
        // MPI forbids aliased buffers; NCCL's in-place form (recv inside send) is copied.
        auto copy = std::make_shared<std::vector<T>>(send.begin(), send.end());
        w->keep_alive = {copy};
        src = copy->data();
      }
      w->check(MPI_Ireduce_scatter_block(src, recv.data(), count, detail::mpi_datatype<T>(),
                                         detail::mpi_reduce_op(op), comm, w->request()),
               "MPI_Ireduce_scatter_block");
      if (op == ReduceOp::avg) w->on_complete = [recv, n](const MPI_Status&) { divide(recv, n); };
    }
    return Work(std::move(w));
  }
  /// Async all_gather (in place when send is this rank's chunk of recv): a direct exchange on
  /// small groups (mpi_direct.hpp), else MPI_Iallgather.
  template <CommElement T>
  [[nodiscard]] Work all_gather_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    const int n = size(), me = rank();
    expect_size(CommOp::all_gather, "recv", recv.size(), send.size() * static_cast<std::size_t>(n));
    auto w = make_work(CommOp::all_gather, recv.size_bytes(), dtype_of<T>);
    const int count = detail::mpi_count(send.size(), CommOp::all_gather);
    if (const MPI_Comm exchange = checked().exchange; exchange != MPI_COMM_NULL) {
      w->check(detail::post_direct_all_gather(send.data(), recv.data(), count,
                                              detail::mpi_datatype<T>(), sizeof(T), me, n, exchange,
                                              w->requests(detail::direct_requests(n))),
               "MPI_Isend/MPI_Irecv (all_gather)");
      return Work(std::move(w));
    }
    const bool in_place = send.data() == recv.data() + static_cast<std::size_t>(me) * send.size();
    w->check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send.data(), count, detail::mpi_datatype<T>(),
                            recv.data(), count, detail::mpi_datatype<T>(), native_handle(),
                            w->request()),
             "MPI_Iallgather");
    return Work(std::move(w));
  }
  /// Async broadcast.
  template <CommElement T>
  [[nodiscard]] Work broadcast_async(std::span<T> buf, int root) {
    expect<CommError>(root >= 0 && root < size(), "MpiComm: broadcast on group '", name(),
                      "': root ", root, " is not a rank of this ", size(), "-rank group");
    auto w = make_work(CommOp::broadcast, buf.size_bytes(), dtype_of<T>);
    w->check(MPI_Ibcast(buf.data(), detail::mpi_count(buf.size(), CommOp::broadcast),
                        detail::mpi_datatype<T>(), root, native_handle(), w->request()),
             "MPI_Ibcast");
    return Work(std::move(w));
  }
  /// Async all_to_all.
  template <CommElement T>
  [[nodiscard]] Work all_to_all_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    const std::size_t n = static_cast<std::size_t>(size());
    expect_size(CommOp::all_to_all, "recv", recv.size(), send.size());
    expect<CommError>(send.size() % n == 0, "MpiComm: all_to_all on group '", name(),
                      "': send holds ", send.size(), " elements, not a multiple of the ", n,
                      " ranks");
    auto w = make_work(CommOp::all_to_all, send.size_bytes(), dtype_of<T>);
    const int count = detail::mpi_count(send.size() / n, CommOp::all_to_all);
    w->check(MPI_Ialltoall(send.data(), count, detail::mpi_datatype<T>(), recv.data(), count,
                           detail::mpi_datatype<T>(), native_handle(), w->request()),
             "MPI_Ialltoall");
    return Work(std::move(w));
  }
  /// Async all_to_all_v (MPI_Ialltoallv with packed displacements).
  template <CommElement T>
  [[nodiscard]] Work all_to_all_v_async(std::span<const std::type_identity_t<T>> send,
                                        std::span<const std::size_t> send_counts, std::span<T> recv,
                                        std::span<const std::size_t> recv_counts) {
    const std::size_t n = static_cast<std::size_t>(size());
    expect_size(CommOp::all_to_all_v, "send_counts", send_counts.size(), n);
    expect_size(CommOp::all_to_all_v, "recv_counts", recv_counts.size(), n);
    // counts and displacements for sends [0, n) and receives [n, 2n), alive until completion
    auto table = std::make_shared<std::vector<int>>(4 * n);
    int* sc = table->data();
    int* sd = sc + n;
    int* rc = sd + n;
    int* rd = rc + n;
    std::size_t send_total = 0, recv_total = 0;
    for (std::size_t q = 0; q < n; ++q) {
      sc[q] = detail::mpi_count(send_counts[q], CommOp::all_to_all_v);
      rc[q] = detail::mpi_count(recv_counts[q], CommOp::all_to_all_v);
      sd[q] = detail::mpi_count(send_total, CommOp::all_to_all_v);
      rd[q] = detail::mpi_count(recv_total, CommOp::all_to_all_v);
      send_total += send_counts[q];
      recv_total += recv_counts[q];
    }
    expect_size(CommOp::all_to_all_v, "send (sum of send_counts)", send.size(), send_total);
    expect_size(CommOp::all_to_all_v, "recv (sum of recv_counts)", recv.size(), recv_total);
    auto w = make_work(CommOp::all_to_all_v, send.size_bytes(), dtype_of<T>);
    if (checked().options.verify_sequence) verify_counts(*w, send_counts, recv_counts);
    w->keep_alive = {table};
    w->check(MPI_Ialltoallv(send.data(), sc, sd, detail::mpi_datatype<T>(), recv.data(), rc, rd,
                            detail::mpi_datatype<T>(), native_handle(), w->request()),
             "MPI_Ialltoallv");
    return Work(std::move(w));
  }
  /// Async send.
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  [[nodiscard]] Work send_async(std::span<T> buf, int peer, int tag = 0) {
    using E = std::remove_const_t<T>;
    check_peer(CommOp::send, peer);
    auto w = make_work(CommOp::send, buf.size_bytes(), dtype_of<E>, peer);
    w->check(MPI_Isend(buf.data(), detail::mpi_count(buf.size(), CommOp::send),
                       detail::mpi_datatype<E>(), peer, tag, native_handle(), w->request()),
             "MPI_Isend");
    return Work(std::move(w));
  }
  /// Async recv; a message of another size is a CommError.
  template <CommElement T>
  [[nodiscard]] Work recv_async(std::span<T> buf, int peer, int tag = 0) {
    check_peer(CommOp::recv, peer);
    auto w = make_work(CommOp::recv, buf.size_bytes(), dtype_of<T>, peer);
    const int count = detail::mpi_count(buf.size(), CommOp::recv);
    w->check(MPI_Irecv(buf.data(), count, detail::mpi_datatype<T>(), peer, tag, native_handle(),
                       w->request()),
             "MPI_Irecv");
    const std::string where = zero::detail::concat("recv on group '", name(), "' at rank ", rank());
    w->on_complete = [count, peer, tag, where](const MPI_Status& status) {
      int got = 0;
      MPI_Get_count(&status, detail::mpi_datatype<T>(), &got);
      expect<CommError>(got == count, "MpiComm: ", where, ": rank ", peer, " sent ", got,
                        " elements of ", name_of(dtype_of<T>), " with tag ", tag,
                        ", the receive expects ", count);
    };
    return Work(std::move(w));
  }
  /// Async barrier (MPI_Ibarrier).
  [[nodiscard]] Work barrier_async() {
    auto w = make_work(CommOp::barrier, 0, DType::u8);
    w->check(MPI_Ibarrier(native_handle(), w->request()), "MPI_Ibarrier");
    return Work(std::move(w));
  }

 private:
  explicit MpiComm(std::shared_ptr<detail::MpiShared> shared) : shared_(std::move(shared)) {}

  static MpiComm from_env(std::shared_ptr<boost::mpi::environment> env, CommOptions options) {
    auto s = std::make_shared<detail::MpiShared>();
    s->env = std::move(env);
    s->comm = boost::mpi::communicator(MPI_COMM_WORLD, boost::mpi::comm_attach);
    s->name = "world";
    s->options = options;
    s->world_ranks = world_ranks_of(MPI_COMM_WORLD);
    s->control = duplicate(MPI_COMM_WORLD, s->name, "control channel");
    if (detail::direct_exchange(s->size())) {
      s->exchange = duplicate(MPI_COMM_WORLD, s->name, "direct exchanges");
    }
    return MpiComm(std::move(s));
  }

  // A channel of a group (control, direct exchanges): collective like the MPI_Comm_split
  // before it. Errors return, so that they become CommErrors naming the op.
  static MPI_Comm duplicate(MPI_Comm comm, std::string_view name, std::string_view purpose) {
    MPI_Comm out = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(comm, &out);
    expect<CommError>(rc == MPI_SUCCESS, "MpiComm: duplicating group '", name, "' for its ",
                      purpose, " failed: ", detail::mpi_error_string(rc));
    MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
    return out;
  }

  static std::vector<int> world_ranks_of(MPI_Comm comm) {
    MPI_Group group, world;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int n = 0;
    MPI_Group_size(group, &n);
    std::vector<int> local(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) local[static_cast<std::size_t>(i)] = i;
    MPI_Group_translate_ranks(group, n, local.data(), world, out.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    return out;
  }

  detail::MpiShared& checked() const {
    expect<CommError>(shared_ != nullptr,
                      "MpiComm: this is a null communicator (split with undefined_color)");
    return *shared_;
  }

  std::shared_ptr<detail::MpiWork> make_work(CommOp op, std::size_t bytes, DType dtype,
                                             int peer = -1) {
    auto& s = checked();
    // Only collectives are numbered (every rank of the group issues each one): ranks send and
    // receive different numbers of messages (a pipeline's middle stages twice its ends'), so a
    // point-to-point op carries the number of the next collective, as LocalComm's do.
    s.throw_if_broken();
    s.reap_abandoned();
    const std::uint64_t seq = peer < 0 ? s.next_seq++ : s.next_seq.load();
    auto work = std::make_shared<detail::MpiWork>(
        shared_, detail::MpiWork::Info{op, seq, bytes, dtype, peer});
    if (peer < 0 && s.options.verify_sequence) verify_sequence(*work);
    return work;
  }

  // Debug mode: all ranks all-gather their next collective's record on the control channel and
  // compare, before the collective itself is posted (under the same deadline).
  void verify_sequence(const detail::MpiWork& work) {
    auto& s = checked();
    auto records =
        std::make_shared<std::vector<detail::MpiOpRecord>>(static_cast<std::size_t>(s.size()));
    auto mine = std::make_shared<detail::MpiOpRecord>(work.record());
    auto check = std::make_shared<detail::MpiWork>(shared_, work.info());
    check->keep_alive = {records, mine};
    check->logged = false;
    check->check(MPI_Iallgather(mine.get(), sizeof *mine, MPI_BYTE, records->data(), sizeof *mine,
                                MPI_BYTE, s.control, check->request()),
                 "MPI_Iallgather (sequence check)");
    const int me = s.rank();
    check->on_complete = [records, me, shared = shared_](const MPI_Status&) {
      const std::string error =
          detail::sequence_mismatch(*records, me, shared->name, shared->world_ranks);
      if (!error.empty()) throw CommError(error);
    };
    check->wait();
  }

  // Debug mode, all_to_all_v: every rank all-gathers its send and receive counts on the control
  // channel and checks every pair (rank a's send_counts[b] against rank b's recv_counts[a]), so
  // all ranks fail with the same message before the exchange is posted, where MPI would
  // truncate a message or leave part of a receive buffer unwritten (LocalComm checks the same).
  void verify_counts(const detail::MpiWork& work, std::span<const std::size_t> send_counts,
                     std::span<const std::size_t> recv_counts) {
    auto& s = checked();
    const auto n = static_cast<std::size_t>(s.size());
    auto mine = std::make_shared<std::vector<std::uint64_t>>(2 * n);
    for (std::size_t q = 0; q < n; ++q) {
      (*mine)[q] = send_counts[q];
      (*mine)[n + q] = recv_counts[q];
    }
    auto all = std::make_shared<std::vector<std::uint64_t>>(2 * n * n);
    auto check = std::make_shared<detail::MpiWork>(shared_, work.info());
    check->keep_alive = {mine, all};
    check->logged = false;
    check->check(MPI_Iallgather(mine->data(), static_cast<int>(2 * n), MPI_UINT64_T, all->data(),
                                static_cast<int>(2 * n), MPI_UINT64_T, s.control, check->request()),
                 "MPI_Iallgather (count check)");
    const detail::MpiWork::Info& i = work.info();
    check->on_complete = [all, n,
                          where = s.describe(i.op, i.seq, i.bytes, i.dtype)](const MPI_Status&) {
      for (std::size_t src = 0; src < n; ++src) {
        for (std::size_t dst = 0; dst < n; ++dst) {
          const std::uint64_t sent = (*all)[src * 2 * n + dst];
          const std::uint64_t expected = (*all)[dst * 2 * n + n + src];
          if (sent != expected) {
            raise<CommError>("MpiComm: ", where, ": rank ", src, " sends ", sent,
                             " elements to rank ", dst, " but rank ", dst, " expects ", expected,
                             " from it (send_counts[", dst, "] vs recv_counts[", src, "])");
          }
        }
      }
    };
    check->wait();
  }

  void finish_or_defer(Work work) {
    auto& s = checked();
    if (!s.grouping) {
      work.wait();
      return;
    }
    // Keep the op pending until group_end: move its state out of the handle.
    struct Deferred final : detail::WorkState {
      Work work;
      explicit Deferred(Work w) : work(std::move(w)) {}
      bool done() override { return work.test(); }
      void wait() override { work.wait(); }
    };
    s.grouped.push_back(std::make_shared<Deferred>(std::move(work)));
  }

  void expect_size(CommOp op, std::string_view what, std::size_t got, std::size_t expected) const {
    expect<CommError>(got == expected, "MpiComm: ", name_of(op), " on group '", name(),
                      "' at rank ", rank(), ": ", what, " holds ", got, " elements, expected ",
                      expected);
  }

  void check_peer(CommOp op, int peer) const {
    expect<CommError>(peer >= 0 && peer < size() && peer != rank(), "MpiComm: ", name_of(op),
                      " on group '", name(), "' at rank ", rank(), ": peer ", peer,
                      " must be another rank of this ", size(), "-rank group");
  }

  // reduce_scatter as a direct exchange (mpi_direct.hpp); bf16/f16 travel and fold as fp32.
  template <class T>
  void direct_reduce_scatter(detail::MpiWork& w, std::span<const T> send, std::span<T> recv,
                             ReduceOp op, int count) {
    const int n = size(), me = rank();
    const std::size_t un = static_cast<std::size_t>(n), chunk = recv.size();
    using Wire = std::conditional_t<is_half_type<T>, float, T>;  // what travels and folds
    const MPI_Datatype type = is_half_type<T> ? MPI_FLOAT : detail::mpi_datatype<T>();
    const MPI_Op mpi_op = detail::mpi_reduce_op(op);
    auto peers = std::make_shared<std::vector<Wire>>((un - 1) * chunk);
    const Wire* wire_send = nullptr;
    std::shared_ptr<std::vector<Wire>> copy;  // staged input, or my chunk where recv aliases it
    Wire* out = nullptr;
    if constexpr (is_half_type<T>) {
      copy = staged(send);
      wire_send = copy->data();
      auto folded = std::make_shared<std::vector<float>>(chunk);
      out = folded->data();
      w.on_complete = [=, &w](const MPI_Status&) {
        w.check(detail::fold_direct_reduce_scatter(wire_send + static_cast<std::size_t>(me) * chunk,
                                                   peers->data(), out, count, type, sizeof(Wire),
                                                   mpi_op, me, n),
                "MPI_Reduce_local");
        unstage(*folded, recv, op, n);
      };
      w.keep_alive = {copy, peers, folded};
    } else {
      wire_send = send.data();
      out = recv.data();
      const Wire* own = send.data() + static_cast<std::size_t>(me) * chunk;
      if (detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) {
        // MPI forbids aliased buffers (NCCL's in-place form has recv inside send). The fold
        // writes recv only once every send has completed, so only my chunk is kept aside.
        copy = std::make_shared<std::vector<Wire>>(own, own + chunk);
        own = copy->data();
      }
      w.on_complete = [=, &w](const MPI_Status&) {
        w.check(detail::fold_direct_reduce_scatter(own, peers->data(), out, count, type,
                                                   sizeof(Wire), mpi_op, me, n),
                "MPI_Reduce_local");
        if (op == ReduceOp::avg) divide(recv, n);
      };
      w.keep_alive = {peers};
      if (copy) w.keep_alive.push_back(copy);
    }
    w.check(detail::post_direct_reduce_scatter(wire_send, peers->data(), count, type, sizeof(Wire),
                                               me, n, checked().exchange,
                                               w.requests(detail::direct_requests(n))),
            "MPI_Isend/MPI_Irecv (reduce_scatter)");
  }

  template <class T>
  static std::shared_ptr<std::vector<float>> staged(std::span<const T> in) {
    auto out = std::make_shared<std::vector<float>>(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) (*out)[i] = static_cast<float>(in[i]);
    return out;
  }

  template <class T>
  static void unstage(const std::vector<float>& reduced, std::span<T> out, ReduceOp op, int n) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      // avg divides (acc / n) as LocalComm does, so both round the same way
      out[i] = T(op == ReduceOp::avg ? reduced[i] / static_cast<float>(n) : reduced[i]);
    }
  }

  template <class T>
  static void divide(std::span<T> values, int n) {
    for (auto& v : values) v = finish_reduce<ReduceOp::avg>(v, n);  // LocalComm's rule
  }

  std::shared_ptr<detail::MpiShared> shared_;
};

static_assert(Communicator<MpiComm>);

}  // namespace zero::parallel
