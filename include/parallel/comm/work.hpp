#pragma once
// Work: the handle an async collective returns. The backend completes the op (on a progress
// thread, an MPI request or a CUDA event); the handle only observes it. Every backend bounds
// its waits by the communicator's deadline, so wait() cannot hang past it.

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

namespace zero::parallel {

namespace detail {

/// What a backend implements behind a Work handle.
class WorkState {
 public:
  virtual ~WorkState() = default;
  /// True once the op finished (successfully or not); never blocks for long.
  virtual bool done() = 0;
  /// Blocks until the op finished or its deadline passed; rethrows the op's failure.
  virtual void wait() = 0;
};

/// A WorkState completed from another thread: complete() or fail() exactly once.
class CompletionState final : public WorkState {
 public:
  /// Marks the op finished successfully.
  void complete() { finish(nullptr); }
  /// Marks the op failed with error (rethrown by wait()).
  void fail(std::exception_ptr error) { finish(std::move(error)); }

  bool done() override {
    std::lock_guard lock(mutex_);
    return done_;
  }
  void wait() override {
    std::exception_ptr error;
    {
      std::unique_lock lock(mutex_);
      // The op itself runs under the communicator's deadline, so this wait ends by then too.
      cv_.wait(lock, [&] { return done_; });
      // Taken out (a Work is waited on once): the error then dies with the waiter's copy, on
      // the waiter's thread, not with this state on the thread that completed it.
      error = std::exchange(error_, nullptr);
    }
    if (error) std::rethrow_exception(std::move(error));
  }

 private:
  void finish(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace detail

/// Handle of an async op: wait() blocks until it finished and rethrows its failure, test()
/// polls. Move-only; destroying a pending handle waits for the op (its buffers must outlive it)
/// and drops its error, so call wait() to see errors.
class [[nodiscard]] Work {
 public:
  /// An already-completed handle (what a blocking backend returns).
  Work() = default;
  /// Wraps a backend's state.
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
  Work(Work&&) noexcept = default;
  /// Replaces this handle; the op it held is waited for first. Returns void: the class is
  /// [[nodiscard]], so a `Work&` result would be a discarded handle at every `w = op_async()`.
  void operator=(Work&& other) noexcept {
    if (this != &other) {
      release();
      state_ = std::move(other.state_);
    }
  }
  Work(const Work&) = delete;
  void operator=(const Work&) = delete;
  ~Work() { release(); }

  /// Blocks until the op finished (bounded by the communicator's deadline); rethrows its error.
  void wait() {
    if (!state_) return;
    auto state = std::move(state_);
    state->wait();
  }
  /// True when the op finished; rethrows its error once it has. Never blocks.
  bool test() {
    if (!state_) return true;
    if (!state_->done()) return false;
    wait();
    return true;
  }

 private:
  void release() noexcept {
    if (!state_) return;
    try {
      state_->wait();
    } catch (...) {
      // Destructors must not throw; the error was the caller's to collect with wait().
    }
    state_.reset();
  }

  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace zero::parallel
