// zero-requires: nccl mpi
#pragma once
// NcclComm: the Communicator over NCCL on a CUDA stream. Spans point to device memory.
// Rank 0 of the matching MpiComm creates the NCCL unique id and broadcasts it over MPI (which
// works on every NCCL version and reuses MPI's split for sub-groups). NCCL has no all-to-all,
// so all_to_all(_v) are grouped ncclSend/ncclRecv; group_start/group_end batch a pipeline's
// sends and receives into one NCCL group, which cannot deadlock.
// Every op is enqueued on the communicator's stream and an event is recorded after it: the
// async forms return a Work over that event, the blocking forms wait on it from the host with
// the deadline (polling cudaEventQuery and ncclCommGetAsyncError); past it the communicator is
// aborted (ncclCommAbort) and a CommError names the op, group and bytes.
// Differences from the host backends: bf16/f16 are reduced by NCCL itself (which rounds to the
// 16-bit type between steps, not once in fp32), and results follow NCCL's algorithm order.
// clang-format off
#if !defined(__CUDACC__)
#error "parallel/comm/nccl_comm.cuh needs nvcc; host-only code uses parallel/comm/mpi_comm.hpp or local_comm.hpp"
#endif
// clang-format on

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ncclBfloat16 and ncclAvg, which the element types and ReduceOp::avg map to, came in NCCL 2.10.
static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0), "NcclComm needs NCCL 2.10 or newer");

#include <parallel/comm/blocking_collectives.hpp>
#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/comm/mpi_comm.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <parallel/comm/work.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

namespace detail {

/// NCCL's tag for element type T.
template <class T>
constexpr ncclDataType_t nccl_datatype() {
  if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, bf16>)
    return ncclBfloat16;
  else if constexpr (std::is_same_v<T, f16>)
    return ncclFloat16;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return ncclInt64;
  else
    return ncclUint8;
}

/// NCCL's reduction for op.
inline ncclRedOp_t nccl_reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

/// Throws CommError naming call and where when NCCL reports an error.
inline void nccl_check(ncclResult_t rc, std::string_view call, std::string_view where) {
  if (rc == ncclSuccess) return;
  raise<CommError>("NcclComm: ", where, ": ", call, " failed: ", ncclGetErrorString(rc));
}

/// Throws CommError naming call and where when CUDA reports an error.
inline void cuda_comm_check(cudaError_t rc, std::string_view call, std::string_view where) {
  if (rc == cudaSuccess) return;
  raise<CommError>("NcclComm: ", where, ": ", call, " failed: ", cudaGetErrorString(rc));
}

/// A communicator's state, shared by its handles and pending Work.
struct NcclShared {
  MpiComm mpi;  ///< same ranks; carries the unique id and the splits
  ncclComm_t comm = nullptr;
  /// The stream every op is enqueued on: one for a communicator and all its splits, so a backend
  /// that orders the stream after its compute orders every group's ops (the engine's expert and
  /// tensor-parallel groups beside its data-parallel one), and the groups' kernels run in the
  /// order the ranks issue them. Destroyed with the last group that uses it.
  std::shared_ptr<CUstream_st> stream_owner;
  cudaStream_t stream = nullptr;
  int device = 0;
  std::string name;
  CommOptions options;
  std::shared_ptr<CommLogger> logger;
  std::atomic<std::uint64_t> next_seq{0};
  bool grouping = false;               ///< between group_start and group_end
  std::size_t grouped_send_bytes = 0;  ///< bytes the open group's sends move
  std::size_t grouped_recv_bytes = 0;  ///< bytes the open group's receives move
  void* barrier_buffer = nullptr;      ///< one device int for barrier's all_reduce

  NcclShared() = default;
  NcclShared(const NcclShared&) = delete;
  NcclShared& operator=(const NcclShared&) = delete;
  ~NcclShared() {
    if (comm) ncclCommDestroy(comm);
    if (barrier_buffer) cudaFree(barrier_buffer);
  }  // then stream_owner: the stream goes with the last communicator on it

  /// "all_reduce #3 (4096 bytes of f32) on group 'world' at rank 1 of 4".
  std::string describe(CommOp op, std::uint64_t seq, std::size_t bytes, DType dtype) const {
    return zero::detail::concat(name_of(op), " #", seq, " (", bytes, " bytes of ", name_of(dtype),
                                ") on group '", name, "' at rank ", mpi.rank(), " of ", mpi.size());
  }
};

/// An op enqueued on the stream, observed through the event recorded after it.
class NcclWork final : public WorkState {
 public:
  /// Records the completion event of the op just enqueued on shared's stream.
  NcclWork(std::shared_ptr<NcclShared> shared, CommOp op, std::uint64_t seq, std::size_t bytes,
           DType dtype)
      : shared_(std::move(shared)),
        op_(op),
        seq_(seq),
        bytes_(bytes),
        dtype_(dtype),
        start_(CommClock::now()) {
    const std::string where = shared_->describe(op_, seq_, bytes_, dtype_);
    cuda_comm_check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate",
                    where);
    cuda_comm_check(cudaEventRecord(event_, shared_->stream), "cudaEventRecord", where);
  }
  ~NcclWork() override {
    if (event_) cudaEventDestroy(event_);
  }

  bool done() override {
    if (finished_) return true;
    // An abort ends the communicator's kernels, so their events complete without the data.
    if (!shared_->comm) {
      raise<CommError>("NcclComm: ", describe(), ": the communicator was aborted earlier");
    }
    const cudaError_t q = cudaEventQuery(event_);
    if (q == cudaErrorNotReady) {
      check_async_error();
      return false;
    }
    cuda_comm_check(q, "cudaEventQuery", describe());
    finished_ = true;
    if (shared_->logger) {
      shared_->logger->record(op_, shared_->name, shared_->mpi.size(), bytes_, start_,
                              CommClock::now());
    }
    return true;
  }

  void wait() override {
    const auto deadline = deadline_after(shared_->options.timeout_s);
    for (int polls = 0; !done(); ++polls) {
      if (CommClock::now() > deadline) {
        // The kernel waits for peers that will not come; aborting the communicator is the
        // only way to stop it, and the communicator is unusable afterwards.
        if (shared_->comm) ncclCommAbort(shared_->comm);
        shared_->comm = nullptr;
        raise<CommError>("NcclComm: ", describe(), " timed out after ", shared_->options.timeout_s,
                         " s: not every rank of the group joined it (the communicator was "
                         "aborted). Raise CommOptions::timeout_s if the op is legitimately slow");
      }
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  std::string describe() const { return shared_->describe(op_, seq_, bytes_, dtype_); }

  void check_async_error() {
    if (!shared_->comm) {
      raise<CommError>("NcclComm: ", describe(), ": the communicator was aborted earlier");
    }
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(shared_->comm, &async), "ncclCommGetAsyncError", describe());
    if (async != ncclSuccess) {
      // The communicator's kernels may wait for data that will never come (a peer's link
      // failed): aborting is the only way to stop them, as at the deadline, and later ops, the
      // streams' synchronisations and the destructor's ncclCommDestroy would otherwise hang.
      ncclCommAbort(shared_->comm);
      shared_->comm = nullptr;
      nccl_check(async, "NCCL (asynchronous error; the communicator was aborted)", describe());
    }
  }

  std::shared_ptr<NcclShared> shared_;
  CommOp op_;
  std::uint64_t seq_;
  std::size_t bytes_;
  DType dtype_;
  CommClock::time_point start_;
  cudaEvent_t event_ = nullptr;
  bool finished_ = false;
};

}  // namespace detail

/// A communicator over NCCL (see the file comment). Buffers are device memory.
class NcclComm : public BlockingCollectives<NcclComm> {
 public:
  /// A null communicator (what split with undefined_color returns).
  NcclComm() = default;

  /// An NCCL communicator over the ranks of mpi, on device (default: the rank's index among
  /// the ranks on its node, modulo the device count), with its own non-blocking stream. NCCL
  /// takes one device a rank: ranks of a node on the same device are a CommError on each of
  /// them (on one GPU, CudaLocalComm runs ranks as threads).
  explicit NcclComm(MpiComm mpi, int device = -1, std::string_view name = {})
      : NcclComm(std::move(mpi), device, name, nullptr) {}

  /// This rank's index in the group.
  int rank() const { return shared_ ? shared_->mpi.rank() : -1; }
  /// Number of ranks (0 for a null communicator).
  int size() const { return shared_ ? shared_->mpi.size() : 0; }
  /// True for the communicator split returns to ranks that passed undefined_color.
  bool is_null() const { return shared_ == nullptr; }
  /// The group's name in logs and errors.
  const std::string& name() const { return checked().name; }
  /// The stream every op is enqueued on; make it wait for the producers of the buffers.
  cudaStream_t stream() const { return checked().stream; }
  /// The same stream, under the name AnyComm (and so the engine) asks for.
  cudaStream_t device_stream() const { return stream(); }
  /// The CUDA device of this rank.
  int device() const { return checked().device; }
  /// The NCCL communicator, for calls zero does not wrap.
  ncclComm_t native_handle() const { return checked().comm; }
  /// The MPI communicator over the same ranks.
  MpiComm& mpi() { return checked().mpi; }
  /// The options (deadline) of later ops.
  const CommOptions& options() const { return checked().options; }
  /// Replaces the options (deadline) for later ops, on the MPI communicator under it too (its
  /// barriers and the unique id's broadcast in split).
  void set_options(const CommOptions& options) {
    auto& s = checked();
    s.options = options;
    s.mpi.set_options(options);
  }
  /// Logs this rank's ops into logger (inherited by later splits).
  void set_logger(std::shared_ptr<CommLogger> logger) { checked().logger = std::move(logger); }

  /// Splits the group: MPI splits, then the new group creates its NCCL communicator.
  NcclComm split(int color, int key, std::string_view name = {}) {
    auto& s = checked();
    MpiComm child = s.mpi.split(color, key, name);
    if (child.is_null()) return NcclComm();
    NcclComm out(std::move(child), s.device, {}, s.stream_owner);
    out.shared_->logger = s.logger;
    out.shared_->options = s.options;
    return out;
  }

  // ---- blocking: collectives come from BlockingCollectives (async form, waited on) ---------

  /// Sends buf to peer; inside group_start/group_end it is only enqueued.
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  void send(std::span<T> buf, int peer, int tag = 0) {
    if (checked().grouping) {
      enqueue_send(buf, peer, tag);
      return;
    }
    send_async(buf, peer, tag).wait();
  }
  /// Receives buf from peer; inside group_start/group_end it is only enqueued.
  template <CommElement T>
  void recv(std::span<T> buf, int peer, int tag = 0) {
    if (checked().grouping) {
      enqueue_recv(buf, peer, tag);
      return;
    }
    recv_async<T>(buf, peer, tag).wait();
  }
  /// Returns once every rank has called barrier (an all_reduce of one int).
  void barrier() { barrier_async().wait(); }

  /// Opens an NCCL group: sends and receives until group_end are issued together.
  void group_start() {
    auto& s = checked();
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart", s.name);
    s.grouping = true;
    s.grouped_send_bytes = 0;
    s.grouped_recv_bytes = 0;
  }
  /// Closes the NCCL group and waits (with the deadline) for its sends and receives.
  void group_end() {
    auto& s = checked();
    s.grouping = false;
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", s.name);
    // Sends and receives are not numbered: ranks issue different numbers of them (MpiComm). They
    // are logged apart, as MpiComm and LocalComm log them (an empty group logs nothing).
    for (const auto& [op, bytes] : {std::pair{CommOp::send, s.grouped_send_bytes},
                                    std::pair{CommOp::recv, s.grouped_recv_bytes}}) {
      if (bytes == 0) continue;
      Work(std::make_shared<detail::NcclWork>(shared_, op, s.next_seq.load(), bytes, DType::u8))
          .wait();
    }
  }

  // ---- async: enqueue, record an event ---------------------------------------------------------

  /// Async all_reduce.
  template <CommElement T>
  [[nodiscard]] Work all_reduce_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv, ReduceOp op) {
    expect_size(CommOp::all_reduce, "recv", recv.size(), send.size());
    auto& s = ungrouped(CommOp::all_reduce);
    detail::nccl_check(
        ncclAllReduce(send.data(), recv.data(), send.size(), detail::nccl_datatype<T>(),
                      detail::nccl_reduce_op(op), s.comm, s.stream),
        "ncclAllReduce", s.name);
    return record(CommOp::all_reduce, send.size_bytes(), dtype_of<T>);
  }
  /// Async reduce_scatter.
  template <CommElement T>
  [[nodiscard]] Work reduce_scatter_async(std::span<const std::type_identity_t<T>> send,
                                          std::span<T> recv, ReduceOp op) {
    expect_size(CommOp::reduce_scatter, "send", send.size(),
                recv.size() * static_cast<std::size_t>(size()));
    auto& s = ungrouped(CommOp::reduce_scatter);
    detail::nccl_check(
        ncclReduceScatter(send.data(), recv.data(), recv.size(), detail::nccl_datatype<T>(),
                          detail::nccl_reduce_op(op), s.comm, s.stream),
        "ncclReduceScatter", s.name);
    return record(CommOp::reduce_scatter, send.size_bytes(), dtype_of<T>);
  }
  /// Async all_gather.
  template <CommElement T>
  [[nodiscard]] Work all_gather_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    expect_size(CommOp::all_gather, "recv", recv.size(),
                send.size() * static_cast<std::size_t>(size()));
    auto& s = ungrouped(CommOp::all_gather);
    detail::nccl_check(ncclAllGather(send.data(), recv.data(), send.size(),
                                     detail::nccl_datatype<T>(), s.comm, s.stream),
                       "ncclAllGather", s.name);
    return record(CommOp::all_gather, recv.size_bytes(), dtype_of<T>);
  }
  /// Async broadcast.
  template <CommElement T>
  [[nodiscard]] Work broadcast_async(std::span<T> buf, int root) {
    auto& s = ungrouped(CommOp::broadcast);
    expect<CommError>(root >= 0 && root < size(), "NcclComm: broadcast on group '", s.name,
                      "': root ", root, " is not a rank of this ", size(), "-rank group");
    detail::nccl_check(ncclBroadcast(buf.data(), buf.data(), buf.size(), detail::nccl_datatype<T>(),
                                     root, s.comm, s.stream),
                       "ncclBroadcast", s.name);
    return record(CommOp::broadcast, buf.size_bytes(), dtype_of<T>);
  }
  /// Async all_to_all: one NCCL group of a send and a receive per peer.
  template <CommElement T>
  [[nodiscard]] Work all_to_all_async(std::span<const std::type_identity_t<T>> send,
                                      std::span<T> recv) {
    ungrouped(CommOp::all_to_all);
    const std::size_t n = static_cast<std::size_t>(size());
    expect_size(CommOp::all_to_all, "recv", recv.size(), send.size());
    expect<CommError>(send.size() % n == 0, "NcclComm: all_to_all on group '", name(),
                      "': send holds ", send.size(), " elements, not a multiple of the ", n,
                      " ranks");
    expect_apart(CommOp::all_to_all, send.data(), send.size_bytes(), recv.data(),
                 recv.size_bytes());
    const std::size_t count = send.size() / n;
    std::vector<std::size_t> counts(n, count);
    exchange<T>(send.data(), counts, recv.data(), counts);
    return record(CommOp::all_to_all, send.size_bytes(), dtype_of<T>);
  }
  /// Async all_to_all_v: one NCCL group of a send and a receive per peer.
  template <CommElement T>
  [[nodiscard]] Work all_to_all_v_async(std::span<const std::type_identity_t<T>> send,
                                        std::span<const std::size_t> send_counts, std::span<T> recv,
                                        std::span<const std::size_t> recv_counts) {
    ungrouped(CommOp::all_to_all_v);
    const std::size_t n = static_cast<std::size_t>(size());
    expect_size(CommOp::all_to_all_v, "send_counts", send_counts.size(), n);
    expect_size(CommOp::all_to_all_v, "recv_counts", recv_counts.size(), n);
    std::size_t send_total = 0, recv_total = 0;
    for (std::size_t q = 0; q < n; ++q) send_total += send_counts[q], recv_total += recv_counts[q];
    expect_size(CommOp::all_to_all_v, "send (sum of send_counts)", send.size(), send_total);
    expect_size(CommOp::all_to_all_v, "recv (sum of recv_counts)", recv.size(), recv_total);
    expect_apart(CommOp::all_to_all_v, send.data(), send.size_bytes(), recv.data(),
                 recv.size_bytes());
    exchange<T>(send.data(), {send_counts.begin(), send_counts.end()}, recv.data(),
                {recv_counts.begin(), recv_counts.end()});
    return record(CommOp::all_to_all_v, send.size_bytes(), dtype_of<T>);
  }
  /// Async send (tags are not supported by NCCL: matching is by order per peer).
  template <class T>
    requires CommElement<std::remove_const_t<T>>
  [[nodiscard]] Work send_async(std::span<T> buf, int peer, int tag = 0) {
    ungrouped(CommOp::send);
    enqueue_send(buf, peer, tag);
    return record(CommOp::send, buf.size_bytes(), dtype_of<std::remove_const_t<T>>);
  }
  /// Async recv (matching is by order per peer).
  template <CommElement T>
  [[nodiscard]] Work recv_async(std::span<T> buf, int peer, int tag = 0) {
    ungrouped(CommOp::recv);
    enqueue_recv(buf, peer, tag);
    return record(CommOp::recv, buf.size_bytes(), dtype_of<T>);
  }
  /// Async barrier: an all_reduce of one int on the stream.
  [[nodiscard]] Work barrier_async() {
    auto& s = ungrouped(CommOp::barrier);
    detail::nccl_check(
        ncclAllReduce(s.barrier_buffer, s.barrier_buffer, 1, ncclInt32, ncclSum, s.comm, s.stream),
        "ncclAllReduce (barrier)", s.name);
    return record(CommOp::barrier, 0, DType::i32);
  }

 private:
  // The constructor above, on stream (a parent's, for a split) or a new one (null).
  NcclComm(MpiComm mpi, int device, std::string_view name, std::shared_ptr<CUstream_st> stream) {
    expect<CommError>(!mpi.is_null(), "NcclComm: needs a non-null MpiComm");
    auto s = std::make_shared<detail::NcclShared>();
    s->name = name.empty() ? mpi.name() : std::string(name);
    s->options = mpi.options();
    const std::string where = zero::detail::concat("creating group '", s->name, "' at rank ",
                                                   mpi.rank(), " of ", mpi.size());
    if (device < 0) device = NodeRanks(mpi).rank % device_count(where);
    s->device = device;
    detail::cuda_comm_check(cudaSetDevice(device), "cudaSetDevice", where);
    expect_own_device(mpi, device, where);
    if (!stream) {
      cudaStream_t created = nullptr;
      detail::cuda_comm_check(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
                              "cudaStreamCreate", where);
      stream = std::shared_ptr<CUstream_st>(created, [](cudaStream_t t) { cudaStreamDestroy(t); });
    }
    s->stream_owner = std::move(stream);
    s->stream = s->stream_owner.get();
    detail::cuda_comm_check(cudaMalloc(&s->barrier_buffer, sizeof(int)), "cudaMalloc", where);
    ncclUniqueId id{};
    if (mpi.rank() == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", where);
    // The id is opaque bytes; broadcasting it over MPI is deadline-bounded, so a missing rank
    // fails here rather than inside ncclCommInitRank.
    std::span<std::uint8_t> id_bytes(reinterpret_cast<std::uint8_t*>(&id), sizeof(id));
    mpi.broadcast(id_bytes, 0);
    detail::nccl_check(ncclCommInitRank(&s->comm, mpi.size(), id, mpi.rank()), "ncclCommInitRank",
                       where);
    s->mpi = std::move(mpi);
    shared_ = std::move(s);
  }

  // NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected") with an
  // error that does not say which: the ranks of a node compare their devices' UUIDs first (the
  // same on every rank of the node, so all of them raise), whatever CUDA_VISIBLE_DEVICES each
  // sees.
  static void expect_own_device(MpiComm& mpi, int device, std::string_view where) {
    cudaDeviceProp prop{};
    detail::cuda_comm_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties",
                            where);
    const NodeRanks node(mpi);
    constexpr int uuid_bytes = static_cast<int>(sizeof(prop.uuid.bytes));
    std::vector<char> uuids(static_cast<std::size_t>(node.size) * uuid_bytes);
    std::vector<int> devices(static_cast<std::size_t>(node.size));
    MPI_Allgather(prop.uuid.bytes, uuid_bytes, MPI_CHAR, uuids.data(), uuid_bytes, MPI_CHAR,
                  node.comm);
    MPI_Allgather(&device, 1, MPI_INT, devices.data(), 1, MPI_INT, node.comm);
    for (int a = 0; a < node.size; ++a) {
      for (int b = a + 1; b < node.size; ++b) {
        const char* ua = uuids.data() + static_cast<std::size_t>(a) * uuid_bytes;
        const char* ub = uuids.data() + static_cast<std::size_t>(b) * uuid_bytes;
        expect<CommError>(!std::equal(ua, ua + uuid_bytes, ub), "NcclComm: ", where,
                          ": the node's ranks ", a, " and ", b,
                          " (in node order) both use one GPU "
                          "(device ",
                          devices[static_cast<std::size_t>(a)], " and ",
                          devices[static_cast<std::size_t>(b)],
                          " as each sees it); NCCL takes "
                          "one GPU a rank: launch at most as many ranks a node as it has GPUs, or "
                          "run ranks on one GPU as threads over CudaLocalComm");
      }
    }
  }

  // checked(), and no group open: an op's event would be recorded before ncclGroupEnd launched
  // it, so its Work would complete before the op ran (and a blocking one would wait for an op
  // that cannot start until group_end).
  detail::NcclShared& ungrouped(CommOp op) const {
    auto& s = checked();
    expect<CommError>(!s.grouping, "NcclComm: ", name_of(op), " on group '", s.name,
                      "' inside group_start/group_end: only the blocking send and recv may be "
                      "grouped (an async op or a collective would complete before the group runs)");
    return s;
  }

  detail::NcclShared& checked() const {
    expect<CommError>(shared_ != nullptr,
                      "NcclComm: this is a null communicator (split with undefined_color)");
    expect<CommError>(shared_->comm != nullptr, "NcclComm: group '", shared_->name,
                      "' was aborted after a timeout and cannot be used");
    return *shared_;
  }

  static int device_count(std::string_view where) {
    int n = 0;
    detail::cuda_comm_check(cudaGetDeviceCount(&n), "cudaGetDeviceCount", where);
    expect<CommError>(n > 0, "NcclComm: ", where, ": no CUDA device is visible");
    return n;
  }

  // The ranks of mpi on this rank's node (MPI_COMM_TYPE_SHARED; collective over mpi): their
  // communicator, freed with this, this rank's index among them and their count.
  struct NodeRanks {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0, size = 1;
    explicit NodeRanks(MpiComm& mpi) {
      MPI_Comm_split_type(mpi.native_handle(), MPI_COMM_TYPE_SHARED, mpi.rank(), MPI_INFO_NULL,
                          &comm);
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
    }
    NodeRanks(const NodeRanks&) = delete;
    NodeRanks& operator=(const NodeRanks&) = delete;
    ~NodeRanks() { MPI_Comm_free(&comm); }
  };

  Work record(CommOp op, std::size_t bytes, DType dtype) {
    auto& s = checked();
    const bool point_to_point = op == CommOp::send || op == CommOp::recv;
    return Work(std::make_shared<detail::NcclWork>(
        shared_, op, point_to_point ? s.next_seq.load() : s.next_seq++, bytes, dtype));
  }

  // Closes an NCCL group that an exception leaves open: NCCL's group depth is per thread, so
  // every later NCCL call of the thread, on any communicator, would wait for a group end that
  // never comes while its completion event is recorded at once (a wait that returns before the
  // op ran).
  struct OpenGroup {
    bool open = true;
    ~OpenGroup() {
      if (open) (void)ncclGroupEnd();
    }
  };
  // The failure of an NCCL call inside group_start/group_end ends that group before it
  // propagates (see OpenGroup).
  void check_grouped(ncclResult_t result, const char* call) {
    auto& s = checked();
    if (result != ncclSuccess && s.grouping) {
      s.grouping = false;
      (void)ncclGroupEnd();
    }
    detail::nccl_check(result, call, s.name);
  }

  template <class T>
  void enqueue_send(std::span<T> buf, int peer, int /*tag*/) {
    auto& s = checked();
    check_peer(CommOp::send, peer);
    check_grouped(ncclSend(buf.data(), buf.size(), detail::nccl_datatype<std::remove_const_t<T>>(),
                           peer, s.comm, s.stream),
                  "ncclSend");
    s.grouped_send_bytes += buf.size_bytes();
  }

  template <class T>
  void enqueue_recv(std::span<T> buf, int peer, int /*tag*/) {
    auto& s = checked();
    check_peer(CommOp::recv, peer);
    check_grouped(
        ncclRecv(buf.data(), buf.size(), detail::nccl_datatype<T>(), peer, s.comm, s.stream),
        "ncclRecv");
    s.grouped_recv_bytes += buf.size_bytes();
  }

  template <class T>
  void exchange(const T* send, const std::vector<std::size_t>& send_counts, T* recv,
                const std::vector<std::size_t>& recv_counts) {
    auto& s = checked();
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart", s.name);
    OpenGroup group;
    std::size_t send_offset = 0, recv_offset = 0;
    for (std::size_t q = 0; q < send_counts.size(); ++q) {
      const int peer = static_cast<int>(q);
      if (send_counts[q]) {
        detail::nccl_check(ncclSend(send + send_offset, send_counts[q], detail::nccl_datatype<T>(),
                                    peer, s.comm, s.stream),
                           "ncclSend", s.name);
      }
      if (recv_counts[q]) {
        detail::nccl_check(ncclRecv(recv + recv_offset, recv_counts[q], detail::nccl_datatype<T>(),
                                    peer, s.comm, s.stream),
                           "ncclRecv", s.name);
      }
      send_offset += send_counts[q];
      recv_offset += recv_counts[q];
    }
    group.open = false;
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", s.name);
  }

  void expect_size(CommOp op, std::string_view what, std::size_t got, std::size_t expected) const {
    expect<CommError>(got == expected, "NcclComm: ", name_of(op), " on group '", name(),
                      "' at rank ", rank(), ": ", what, " holds ", got, " elements, expected ",
                      expected);
  }

  // all_to_all is not done in place: a peer's chunk could land on one not sent yet.
  void expect_apart(CommOp op, const void* send, std::size_t send_bytes, const void* recv,
                    std::size_t recv_bytes) const {
    expect<CommError>(!detail::overlaps(send, send_bytes, recv, recv_bytes),
                      "NcclComm: ", name_of(op), " on group '", name(), "' at rank ", rank(),
                      ": send and recv must not overlap");
  }

  void check_peer(CommOp op, int peer) const {
    expect<CommError>(peer >= 0 && peer < size() && peer != rank(), "NcclComm: ", name_of(op),
                      " on group '", name(), "' at rank ", rank(), ": peer ", peer,
                      " must be another rank of this ", size(), "-rank group");
  }

  std::shared_ptr<detail::NcclShared> shared_;
};

static_assert(Communicator<NcclComm>);

}  // namespace zero::parallel
