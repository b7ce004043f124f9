#pragma once
// PosixFileIo: the FileIo engine without liburing. aio.thread_count worker threads each take a
// block-sized request and run it with pread/pwrite, so a transfer still proceeds in the
// background while the caller computes; with one thread it is a plain sequential loop.

#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include <zero/offload/file_io.hpp>

namespace zero::offload {

/// pread/pwrite on worker threads (the fallback engine; see file_io.hpp).
class PosixFileIo final : public detail::QueuedFileIo {
 public:
  /// Starts options.thread_count workers; note says why this engine was chosen (for name()).
  explicit PosixFileIo(IoOptions options, std::string note = "")
      : QueuedFileIo(std::move(options)), note_(std::move(note)) {
    for (int i = 0; i < this->options().thread_count; ++i) workers_.emplace_back([this] { run(); });
  }
  PosixFileIo(const PosixFileIo&) = delete;
  PosixFileIo& operator=(const PosixFileIo&) = delete;
  ~PosixFileIo() override {
    stop();
    for (auto& w : workers_) w.join();
  }

  std::string name() const override {
    return note_.empty() ? "pread/pwrite" : "pread/pwrite (" + note_ + ")";
  }

 private:
  void run() {
    while (auto r = take_blocking()) {
      // An injected transient error is retried as a real one would be: the transfer goes on.
      if (r->fault.error != 0 && !transient_error(r->fault.error)) {
        complete(*r, -r->fault.error);
        continue;
      }
      const std::size_t want =
          r->fault.short_bytes ? std::min(*r->fault.short_bytes, r->bytes) : r->bytes;
      std::int64_t result =
          transfer(r->state->transfer.op, r->state->transfer.fd, r->data, want, r->offset);
      complete(*r, result);
    }
  }

  // Moves want bytes (retrying partial transfers, EINTR, and EAGAIN a few times); returns
  // bytes done or -errno.
  static std::int64_t transfer(IoOp op, int fd, std::byte* data, std::size_t want,
                               std::uint64_t offset) {
    std::size_t done = 0;
    int retries = 0;
    while (done < want) {
      const auto at = static_cast<::off_t>(offset + done);
      const ::ssize_t n = op == IoOp::read ? ::pread(fd, data + done, want - done, at)
                                           : ::pwrite(fd, data + done, want - done, at);
      if (n < 0) {
        if (errno == EINTR || (errno == EAGAIN && ++retries <= max_transient_retries)) continue;
        return -errno;
      }
      if (n == 0) break;  // end of file (read) or no progress (write): a short transfer
      done += static_cast<std::size_t>(n);
    }
    return static_cast<std::int64_t>(done);
  }

  std::string note_;
  std::vector<std::thread> workers_;
};

}  // namespace zero::offload
