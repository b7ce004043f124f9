#pragma once
// FileIo: the asynchronous file-I/O interface of NVMe offload. A transfer (one buffer <-> one
// byte range of one file) is submitted and returns at once with an IoTicket; the engine splits
// it into block_size requests and keeps up to queue_depth of them in flight on its own thread,
// so reads, compute and writes overlap; wait(ticket) blocks until the whole transfer is done and
// throws NvmeIoError (file, offset, bytes, errno text) if any request of it failed.
//
// Two engines implement it: UringFileIo (io_uring, zero-requires: uring) and PosixFileIo
// (pread/pwrite on aio.thread_count threads, always available); make_file_io picks one. Both
// share the queueing, ticket and fault-injection logic of detail::QueuedFileIo below.

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <zero/core/error.hpp>
#include <zero/offload/fault_injector.hpp>
#include <zero/offload/io_error.hpp>

namespace zero::offload {

/// One buffer <-> one byte range of one open file. With O_DIRECT, data, offset and bytes must be
/// multiples of the file system's alignment (the swapper guarantees it).
struct Transfer {
  IoOp op = IoOp::read;
  int fd = -1;
  std::string path;  ///< for error messages
  std::uint64_t offset = 0;
  std::byte* data = nullptr;
  std::size_t bytes = 0;
};

/// How a FileIo engine issues requests (the "aio" config section; see NvmeConfig).
struct IoOptions {
  std::size_t block_size = 1 << 20;       ///< bytes per request
  int queue_depth = 8;                    ///< requests in flight
  int thread_count = 1;                   ///< worker threads (PosixFileIo)
  bool single_submit = false;             ///< one io_uring_submit per request (UringFileIo)
  bool overlap_events = true;             ///< refill as requests finish, not after the whole batch
  std::shared_ptr<FaultInjector> faults;  ///< tests only: fail chosen requests
};

namespace detail {
/// The progress of one submitted transfer; guarded by the engine's mutex.
struct TransferState {
  Transfer transfer;
  std::size_t issued = 0;  // bytes handed out as requests
  int outstanding = 0;     // requests handed out and not completed
  bool done = false;
  std::exception_ptr error;  // the first failure
};
}  // namespace detail

/// A handle on a submitted transfer; wait on it with the FileIo that issued it.
class IoTicket {
 public:
  IoTicket() = default;
  /// True for a ticket from submit that was not waited on yet.
  bool valid() const { return state_ != nullptr; }

 private:
  friend class FileIo;
  explicit IoTicket(std::shared_ptr<detail::TransferState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::TransferState> state_;
};

/// The asynchronous file-I/O interface (see the top of this file).
class FileIo {
 public:
  virtual ~FileIo() = default;
  /// Queues a transfer and returns at once; the buffer must stay alive until wait.
  [[nodiscard]] virtual IoTicket submit(Transfer transfer) = 0;
  /// Blocks until the transfer is complete; throws NvmeIoError when a request of it failed.
  /// The ticket is invalid afterwards; waiting on an invalid ticket does nothing.
  virtual void wait(IoTicket& ticket) = 0;
  /// True when wait(ticket) would not block.
  virtual bool ready(const IoTicket& ticket) = 0;
  /// The engine's name and, for a fallback, why ("io_uring", "pread/pwrite (...)").
  virtual std::string name() const = 0;
  /// The options it runs with.
  virtual const IoOptions& options() const = 0;

  /// submit then wait.
  void run(Transfer transfer) {
    IoTicket t = submit(std::move(transfer));
    wait(t);
  }

 protected:
  static std::shared_ptr<detail::TransferState>& state_of(IoTicket& t) { return t.state_; }
  static const std::shared_ptr<detail::TransferState>& state_of(const IoTicket& t) {
    return t.state_;
  }
  static IoTicket make_ticket(std::shared_ptr<detail::TransferState> s) {
    return IoTicket(std::move(s));
  }
};

namespace detail {

/// The queueing shared by the engines: transfers wait in a FIFO and are handed out to the
/// engine's worker as block-sized requests; completions update the transfer and wake waiters.
class QueuedFileIo : public FileIo {
 public:
  /// One block-sized piece of a transfer.
  struct Request {
    std::shared_ptr<TransferState> state;
    std::uint64_t offset = 0;
    std::byte* data = nullptr;
    std::size_t bytes = 0;
    FaultInjector::Decision fault;
  };

  /// A request that fails with EAGAIN or EINTR is issued again, this many times at most: the
  /// kernel could not take it now (io_uring can complete an O_DIRECT transfer of a MiB or more
  /// with -EAGAIN when the block layer is out of tags), and the application is to reissue it.
  static constexpr int max_transient_retries = 16;
  static constexpr bool transient_error(int error) { return error == EAGAIN || error == EINTR; }

  /// The largest request: Linux moves at most 0x7ffff000 bytes in one read or write, and an
  /// io_uring request's length is 32 bits, so a larger block would come back short.
  static constexpr std::size_t max_block_size = std::size_t{1} << 30;

  explicit QueuedFileIo(IoOptions options) : options_(std::move(options)) {
    expect<ConfigError>(options_.block_size >= 512 && options_.block_size % 512 == 0 &&
                            options_.block_size <= max_block_size,
                        "aio.block_size: ", options_.block_size,
                        " must be a positive multiple of 512 bytes, at most 1 GiB");
    expect<ConfigError>(options_.queue_depth >= 1, "aio.queue_depth: ", options_.queue_depth,
                        " must be at least 1");
    expect<ConfigError>(options_.thread_count >= 1,
                        "aio.intra_op_parallelism: ", options_.thread_count, " must be at least 1");
  }

  IoTicket submit(Transfer transfer) override {
    auto s = std::make_shared<TransferState>();
    s->transfer = std::move(transfer);
    {
      std::lock_guard lock(mutex_);
      expect<Error>(!stopping_, "FileIo::submit after shutdown");
      if (s->transfer.bytes == 0)
        s->done = true;
      else
        pending_.push_back(s);
    }
    work_cv_.notify_all();
    return make_ticket(std::move(s));
  }

  void wait(IoTicket& ticket) override {
    auto s = std::move(state_of(ticket));
    if (!s) return;
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return s->done; });
    if (s->error) std::rethrow_exception(s->error);
  }

  bool ready(const IoTicket& ticket) override {
    const auto& s = state_of(ticket);
    std::lock_guard lock(mutex_);
    return !s || s->done;
  }

  const IoOptions& options() const override { return options_; }

 protected:
  /// The next request, or empty when none is queued; call with the mutex held.
  std::optional<Request> try_take_locked() {
    while (!pending_.empty()) {
      auto& s = pending_.front();
      if (s->error != nullptr || s->issued == s->transfer.bytes) {  // stop issuing after a failure
        s->issued = s->transfer.bytes;
        finish_if_complete_locked(*s);
        pending_.pop_front();
        continue;
      }
      Request r;
      r.state = s;
      r.offset = s->transfer.offset + s->issued;
      r.data = s->transfer.data + s->issued;
      r.bytes = std::min(options_.block_size, s->transfer.bytes - s->issued);
      s->issued += r.bytes;
      ++s->outstanding;
      if (options_.faults) r.fault = options_.faults->decide(s->transfer.op);
      if (s->issued == s->transfer.bytes) pending_.pop_front();
      return r;
    }
    return std::nullopt;
  }

  /// Blocks until a request is queued (returns it) or the engine stops with nothing queued.
  std::optional<Request> take_blocking() {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (auto r = try_take_locked()) return r;
      if (stopping_) return std::nullopt;
      work_cv_.wait(lock);
    }
  }

  /// Records the outcome of request r: result is the byte count done or -errno.
  void complete(Request& r, std::int64_t result) {
    std::exception_ptr error;
    const Transfer& t = r.state->transfer;
    if (result < 0)
      error = std::make_exception_ptr(
          errno_transfer_error(t.op, t.path, r.offset, r.bytes, static_cast<int>(-result)));
    else if (static_cast<std::size_t>(result) != r.bytes)
      error = std::make_exception_ptr(
          short_transfer_error(t.op, t.path, r.offset, r.bytes, static_cast<std::size_t>(result)));
    {
      std::lock_guard lock(mutex_);
      if (error && !r.state->error) r.state->error = error;
      --r.state->outstanding;
      finish_if_complete_locked(*r.state);  // wakes waiters only when the whole transfer is done
    }
    r.state.reset();
  }

  /// Stops handing out new work: queued transfers fail as cancelled; requests already taken
  /// complete normally. Call from the derived destructor before joining its workers.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      for (auto& s : pending_) {
        if (!s->error)
          s->error = std::make_exception_ptr(
              Error("NVMe offload: transfer cancelled because its file-I/O engine was destroyed"));
        s->issued = s->transfer.bytes;
        finish_if_complete_locked(*s);
      }
      pending_.clear();
    }
    work_cv_.notify_all();
    done_cv_.notify_all();
  }

  /// True once stop() ran; call with the mutex held.
  bool stopping_locked() const { return stopping_; }

  std::mutex mutex_;
  std::condition_variable work_cv_;

 private:
  // Marks s done when nothing of it is left to issue or complete, and wakes its waiters.
  void finish_if_complete_locked(TransferState& s) {
    if (!s.done && s.outstanding == 0 && s.issued == s.transfer.bytes) {
      s.done = true;
      done_cv_.notify_all();
    }
  }

  IoOptions options_;
  std::deque<std::shared_ptr<TransferState>> pending_;
  std::condition_variable done_cv_;
  bool stopping_ = false;
};

}  // namespace detail
}  // namespace zero::offload
