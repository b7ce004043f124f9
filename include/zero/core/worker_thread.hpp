#pragma once
// One long-lived thread that runs the tasks handed to it, one at a time, in the order given; each
// task's result (or exception) comes back through a std::future. A task started with std::async
// gets a new thread, and under OpenMP a new team of threads for its parallel loops, every time; a
// WorkerThread keeps both from one task to the next (the engine's delayed parameter update runs
// once a step on one). The destructor runs what is still queued, then joins: nothing queued is
// dropped, and no task outlives the objects it was given.
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

namespace zero {

class WorkerThread {
 public:
  WorkerThread() : thread_([this] { serve(); }) {}
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;
  ~WorkerThread() {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }

  /// Queues task; the future is ready once it has run (get() rethrows what it threw).
  std::future<void> run(std::function<void()> task) {
    std::packaged_task<void()> job(std::move(task));
    std::future<void> done = job.get_future();
    {
      const std::lock_guard lock(mutex_);
      queue_.push_back(std::move(job));
    }
    ready_.notify_one();
    return done;
  }

  /// The worker's id (the same for every task it runs).
  std::thread::id id() const { return thread_.get_id(); }

 private:
  void serve() {
    for (;;) {
      std::packaged_task<void()> job;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, with nothing left to run
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();  // an exception goes into the job's future
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace zero
