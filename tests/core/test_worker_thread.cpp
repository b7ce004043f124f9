// WorkerThread: tasks in order on one thread of its own, exceptions through the future, and a
// destructor that runs what is queued before it joins.
#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/worker_thread.hpp>

TEST_CASE("a worker thread runs its tasks in order, all on one thread that is not the caller's",
          "[unit][worker]") {
  zero::WorkerThread worker;
  std::vector<int> order;  // written by the worker only, read after the last future
  std::vector<std::thread::id> ran_on;
  std::vector<std::future<void>> done;
  for (int i = 0; i < 5; ++i) {
    done.push_back(worker.run([&, i] {
      order.push_back(i);
      ran_on.push_back(std::this_thread::get_id());
    }));
  }
  for (auto& d : done) d.get();
  CHECK(order == std::vector<int>{0, 1, 2, 3, 4});
  for (const std::thread::id id : ran_on) {
    CHECK(id == worker.id());
    CHECK(id != std::this_thread::get_id());
  }
}

TEST_CASE("a worker thread's task that throws rethrows from its future, and the worker goes on",
          "[unit][worker]") {
  zero::WorkerThread worker;
  auto failed = worker.run([] { throw std::runtime_error("update failed"); });
  CHECK_THROWS_WITH(failed.get(), "update failed");
  bool ran = false;
  worker.run([&] { ran = true; }).get();
  CHECK(ran);
}

TEST_CASE("a worker thread's destructor runs every queued task before it joins", "[unit][worker]") {
  std::atomic<int> ran{0};
  std::future<void> last;
  {
    zero::WorkerThread worker;
    // The first task holds the worker while the others queue behind it.
    worker.run([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ++ran;
    });
    for (int i = 0; i < 3; ++i) last = worker.run([&] { ++ran; });
  }
  CHECK(ran == 4);
  CHECK(last.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
}
