#pragma once
// zero-requires: uring
// UringFileIo: the FileIo engine on io_uring (liburing). One ring of queue_depth entries and one
// thread that keeps it full: it takes block-sized requests from the queue, prepares a read or
// write SQE for each, submits them (in one batch, or one by one with aio.single_submit), and on
// each completion refills the ring (or, with aio.overlap_events false, only once the whole batch
// has completed, as DeepSpeed's non-overlapped mode does).

#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <zero/offload/file_io.hpp>

namespace zero::offload {

/// io_uring engine (see file_io.hpp).
class UringFileIo final : public detail::QueuedFileIo {
 public:
  /// Sets up the ring; throws IoError when the kernel refuses io_uring (old kernel, seccomp, or
  /// sysctl kernel.io_uring_disabled), which make_file_io turns into the pread/pwrite fallback.
  explicit UringFileIo(IoOptions options) : QueuedFileIo(std::move(options)) {
    const unsigned entries = static_cast<unsigned>(this->options().queue_depth);
    const int rc = ::io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0)
      raise<IoError>("NVMe offload: io_uring_queue_init(", entries,
                     ") failed: ", std::strerror(-rc),
                     " (io_uring disabled by the kernel, a seccomp profile or "
                     "sysctl kernel.io_uring_disabled?)");
    try {
      slots_.resize(entries);
      done_.resize(entries);
      retries_.resize(entries);
      for (unsigned i = 0; i < entries; ++i) free_slots_.push_back(entries - 1 - i);
      worker_ = std::thread([this] { run(); });
    } catch (...) {
      ::io_uring_queue_exit(&ring_);  // the destructor does not run for a failed constructor
      throw;
    }
  }
  UringFileIo(const UringFileIo&) = delete;
  UringFileIo& operator=(const UringFileIo&) = delete;
  ~UringFileIo() override {
    stop();
    worker_.join();
    ::io_uring_queue_exit(&ring_);
  }

  std::string name() const override { return "io_uring"; }

 private:
  void run() {
    const auto& opt = options();
    std::vector<unsigned> injected;  // slots whose request a fault injector fails
    for (;;) {
      // Fill the ring with whatever is queued; block only when nothing is in flight.
      unsigned prepared = 0;
      {
        std::unique_lock lock(mutex_);
        const bool may_refill = opt.overlap_events || in_flight_ == 0;
        while (may_refill && !free_slots_.empty()) {
          auto r = try_take_locked();
          if (!r) {
            if (in_flight_ > 0 || prepared > 0 || !injected.empty()) break;
            if (stopping_locked()) return;
            work_cv_.wait(lock);
            continue;
          }
          const unsigned slot = free_slots_.back();
          free_slots_.pop_back();
          const bool fails = r->fault.error != 0;
          slots_[slot] = std::move(*r);
          done_[slot] = 0;
          retries_[slot] = 0;
          if (fails) {  // completes as the kernel would have failed it, below
            injected.push_back(slot);
            ++in_flight_;
            continue;
          }
          prepare(slot);
          ++prepared;
          ++in_flight_;
          if (opt.single_submit) ::io_uring_submit(&ring_);
        }
      }
      for (const unsigned slot : injected) {
        const int error = slots_[slot].fault.error;
        slots_[slot].fault.error = 0;  // a retry of a transient error goes to the disk
        completed(slot, -error);
      }
      injected.clear();
      if (prepared > 0 && !opt.single_submit) submit_all();
      if (in_flight_ > 0) reap();
    }
  }

  // The bytes slot's request moves: all of it, or what a fault injector lets through.
  std::size_t wanted(unsigned slot) const {
    const Request& r = slots_[slot];
    return r.fault.short_bytes ? std::min(*r.fault.short_bytes, r.bytes) : r.bytes;
  }

  // Queues the rest of slot's request, past the done_[slot] bytes already moved.
  void prepare(unsigned slot) {
    Request& r = slots_[slot];
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
    // The ring has queue_depth entries and at most queue_depth requests are in flight.
    const std::size_t done = done_[slot];
    const auto rest = static_cast<unsigned>(wanted(slot) - done);
    const Transfer& t = r.state->transfer;
    if (t.op == IoOp::read)
      ::io_uring_prep_read(sqe, t.fd, r.data + done, rest, r.offset + done);
    else
      ::io_uring_prep_write(sqe, t.fd, r.data + done, rest, r.offset + done);
    ::io_uring_sqe_set_data64(sqe, slot);
  }

  // One attempt: what the kernel does not take now stays in the ring, for reap's submit.
  void submit_all() { (void)::io_uring_submit(&ring_); }

  // Submits what the ring still holds (a submit the kernel took only part of, or refused with
  // EAGAIN or EBUSY, leaves the rest there: waiting without submitting it would wait forever),
  // waits for at least one completion, then takes every completion that is ready. A completion
  // that moved part of its bytes queues the rest again, as the pread/pwrite engine loops (a
  // write that reaches a full disk or the file-size limit moves part, and the next one reports
  // why); one that moved none ends the request short.
  void reap() {
    io_uring_cqe* cqe = nullptr;
    int rc = ::io_uring_submit_and_wait(&ring_, 1);
    while (rc == -EINTR) rc = ::io_uring_submit_and_wait(&ring_, 1);
    if (::io_uring_peek_cqe(&ring_, &cqe) != 0) return;  // none yet; the loop tries again
    do {
      const auto slot = static_cast<unsigned>(::io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      ::io_uring_cqe_seen(&ring_, cqe);
      completed(slot, res);
    } while (::io_uring_peek_cqe(&ring_, &cqe) == 0);
  }

  // A completion of slot's request with the kernel's result res. Part of the bytes: the rest is
  // queued again. A transient error (transient_error): the request is reissued, up to
  // max_transient_retries times. Otherwise the request ends with res.
  void completed(unsigned slot, int res) {
    if ((res > 0 && done_[slot] + static_cast<std::size_t>(res) < wanted(slot)) ||
        (res < 0 && transient_error(-res) && retries_[slot] < max_transient_retries)) {
      if (res > 0) {
        done_[slot] += static_cast<std::size_t>(res);
      } else {
        ++retries_[slot];
      }
      prepare(slot);  // its slot stays in flight: the ring has room for it
      return;
    }
    const std::int64_t result = res < 0 ? res : static_cast<std::int64_t>(done_[slot]) + res;
    Request r = std::move(slots_[slot]);
    {
      std::lock_guard lock(mutex_);
      free_slots_.push_back(slot);
      --in_flight_;
    }
    complete(r, result);
  }

  io_uring ring_{};
  std::vector<Request> slots_;
  std::vector<std::size_t> done_;  // bytes each slot's request has moved so far
  std::vector<int> retries_;       // transient errors each slot's request has met
  std::vector<unsigned> free_slots_;
  unsigned in_flight_ = 0;  // touched by the worker only (and read under the mutex)
  std::thread worker_;
};

}  // namespace zero::offload
