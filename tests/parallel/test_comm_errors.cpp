// LocalComm failure paths: errors on one rank reach the others, deadlines fire and name the
// op, group, ranks and bytes, mismatched arguments are reported instead of corrupting memory.

#include <catch2/catch.hpp>

#include <chrono>
#include <latch>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <parallel/comm/local_comm.hpp>

#include "comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using namespace zero::parallel::testing;
using Catch::Matchers::Contains;

namespace {
/// What a rank saw: the CommError text it caught (empty if none) and how long the op took.
struct Caught {
  std::string message;
  double seconds = 0;
};

template <class Fn>
Caught catch_comm_error(Fn&& fn) {
  Caught c;
  const auto start = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const CommError& e) {
    c.message = e.what();
  }
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}
}  // namespace

TEST_CASE("An exception on one rank reaches the others as a CommError and run rethrows it",
          "[unit][comm]") {
  std::vector<std::string> seen(4);
  try {
    LocalComm::run(
        4,
        [&](LocalComm& comm) {
          if (comm.rank() == 2) throw std::runtime_error("boom on rank two");
          std::vector<float> v(16, 1.0f);
          try {
            comm.all_reduce(std::span<float>(v), ReduceOp::sum);
          } catch (const CommError& e) {
            seen[static_cast<std::size_t>(comm.rank())] = e.what();
            throw;
          }
        },
        CommOptions{.timeout_s = 60});
    FAIL("run did not rethrow");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "boom on rank two");  // the root cause, not a CommError
  }
  for (int r : {0, 1, 3}) {
    CHECK_THAT(seen[static_cast<std::size_t>(r)],
               Contains("aborted") && Contains("world rank 2 failed") &&
                   Contains("boom on rank two") && Contains("all_reduce"));
  }
}

TEST_CASE("A rank withheld from a collective makes the others fail within the deadline",
          "[unit][comm]") {
  const double timeout = 0.5;
  std::latch others_done(3);
  std::vector<Caught> got(4);
  LocalComm::run(
      4,
      [&](LocalComm& comm) {
        if (comm.rank() == 3) {
          others_done.wait();  // busy elsewhere, neither joining nor leaving
          return;
        }
        got[static_cast<std::size_t>(comm.rank())] = catch_comm_error([&] {
          std::vector<float> v(1024, 1.0f);
          comm.all_reduce(std::span<float>(v), ReduceOp::sum);
        });
        others_done.count_down();
      },
      CommOptions{.timeout_s = timeout});
  // The first rank whose deadline passes breaks the group; the others, waiting in the same
  // rendezvous, fail then with its message (so they may not have waited their own full deadline).
  int timed_out_themselves = 0;
  for (int r = 0; r < 3; ++r) {
    const auto& c = got[static_cast<std::size_t>(r)];
    INFO(c.message);
    CHECK_THAT(c.message, Contains("all_reduce #0") && Contains("4096 bytes of f32") &&
                              Contains("group 'world'") && Contains("timed out after 0.5 s") &&
                              Contains("group ranks [3]") && Contains("never joined"));
    if (c.message.find("unusable") == std::string::npos) {
      ++timed_out_themselves;
      CHECK(c.seconds >= timeout * 0.99);
    }
    CHECK(c.seconds < timeout + 2.0);
  }
  CHECK(timed_out_themselves >= 1);
}

TEST_CASE("A timeout too long for the clock waits instead of failing at once", "[unit][comm]") {
  // 1e10 s and more (a config's way to say "never") overflowed the clock's 64-bit nanoseconds
  // into a deadline in the past, so every wait timed out at once; NaN and infinity likewise.
  const auto thirty_years = std::chrono::hours(24 * 365 * 30);
  for (const double s : {1e10, 1e12, std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN()}) {
    INFO("timeout_s " << s);
    CHECK(deadline_after(s) > CommClock::now() + thirty_years);
  }
  CHECK(deadline_after(1.0) < CommClock::now() + std::chrono::seconds(2));
  // A collective under such a timeout runs, on ranks that arrive apart.
  std::vector<float> sums(2);
  LocalComm::run(
      2,
      [&](LocalComm& comm) {
        if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::vector<float> v(16, 1.0f);
        comm.all_reduce(std::span<float>(v), ReduceOp::sum);
        sums[static_cast<std::size_t>(comm.rank())] = v[0];
      },
      CommOptions{.timeout_s = 1e12});
  CHECK(sums == std::vector<float>{2.0f, 2.0f});
}

TEST_CASE("After a rendezvous times out, a late rank and later ops fail at once", "[unit][comm]") {
  // Ranks 0 and 2 time out waiting for rank 1 and keep their buffers alive; rank 1 then joins.
  // Were the timed-out arrivals still counted, rank 1's all_reduce would complete alone against
  // their stale descriptors, and their next op against its.
  std::latch timed_out(2);
  std::vector<Caught> first(3), later(3);
  std::vector<std::vector<float>> buffers(3, std::vector<float>(64, 1.0f));
  LocalComm::run(
      3,
      [&](LocalComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        auto& v = buffers[r];
        if (comm.rank() == 1) {
          timed_out.wait();
          first[r] = catch_comm_error([&] { comm.all_reduce(std::span<float>(v), ReduceOp::sum); });
          later[r] = catch_comm_error([&] { comm.barrier(); });
          return;
        }
        first[r] = catch_comm_error([&] { comm.all_reduce(std::span<float>(v), ReduceOp::sum); });
        timed_out.count_down();
        later[r] = catch_comm_error([&] { comm.barrier(); });
      },
      CommOptions{.timeout_s = 1.0});
  for (int r : {0, 2}) {
    INFO("rank " << r << ": " << first[static_cast<std::size_t>(r)].message);
    CHECK_THAT(first[static_cast<std::size_t>(r)].message,
               Contains("all_reduce #0") && Contains("timed out after 1 s"));
  }
  for (int r = 0; r < 3; ++r) {
    const auto& c = later[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << c.message);
    CHECK_THAT(c.message,
               Contains("barrier #1") && Contains("unusable") && Contains("timed out after 1 s"));
    CHECK(c.seconds < 0.5);  // at once, not at its own deadline (1 s)
  }
  INFO(first[1].message);
  CHECK_THAT(first[1].message, Contains("all_reduce #0") && Contains("unusable"));
  CHECK(first[1].seconds < 0.5);
  CHECK(buffers[1] == std::vector<float>(64, 1.0f));  // nothing was reduced into it
}

TEST_CASE("A deadline in a sub-group names the group and the world ranks", "[unit][comm]") {
  std::latch done(1);
  std::vector<Caught> got(4);
  LocalComm::run(
      4,
      [&](LocalComm& comm) {
        auto pair = comm.split(comm.rank() / 2, comm.rank(), "tp");
        if (comm.rank() == 3) {
          done.wait();
          return;
        }
        if (comm.rank() == 2) {
          got[2] = catch_comm_error([&] {
            std::vector<std::int32_t> v(3);
            pair.broadcast(std::span<std::int32_t>(v), 0);
          });
          done.count_down();
        }
      },
      CommOptions{.timeout_s = 0.3});
  CHECK_THAT(got[2].message, Contains("broadcast") && Contains("group 'tp'") &&
                                 Contains("group ranks [1] (world ranks [3])") &&
                                 Contains("12 bytes of i32"));
}

TEST_CASE("A rank that returns without joining is reported at once, not at the deadline",
          "[unit][comm]") {
  std::vector<Caught> got(3);
  LocalComm::run(
      3,
      [&](LocalComm& comm) {
        if (comm.rank() == 1) return;
        got[static_cast<std::size_t>(comm.rank())] = catch_comm_error([&] { comm.barrier(); });
      },
      CommOptions{.timeout_s = 30});
  for (int r : {0, 2}) {
    CHECK_THAT(got[static_cast<std::size_t>(r)].message,
               Contains("barrier") && Contains("[1]") && Contains("returned from their function"));
    CHECK(got[static_cast<std::size_t>(r)].seconds < 10);
  }
}

TEST_CASE("Mismatched sizes and op sequences across ranks are reported clearly", "[unit][comm]") {
  auto sizes = per_rank<Caught>(3, [](LocalComm& comm) {
    return catch_comm_error([&] {
      std::vector<double> v(comm.rank() == 1 ? 5 : 4);
      comm.all_reduce(std::span<double>(v), ReduceOp::max);
    });
  });
  for (const auto& c : sizes) {
    CHECK_THAT(c.message, Contains("mismatched buffers") &&
                              Contains("rank 1 passed 5 elements of f64") &&
                              Contains("rank 0 passed 4 elements of f64"));
  }
  auto order = per_rank<Caught>(2, [](LocalComm& comm) {
    return catch_comm_error([&] {
      std::vector<float> v(4);
      if (comm.rank() == 0)
        comm.broadcast(std::span<float>(v), 0);
      else
        comm.all_reduce(std::span<float>(v), ReduceOp::sum);
    });
  });
  for (const auto& c : order) {
    CHECK_THAT(c.message, Contains("disagree on the op sequence") &&
                              Contains("rank 1 issued all_reduce") &&
                              Contains("rank 0 issued broadcast"));
  }
  auto counts = per_rank<Caught>(2, [](LocalComm& comm) {
    return catch_comm_error([&] {
      // Rank 0 sends 2 elements to rank 1, which expects 3.
      std::vector<std::size_t> sc{1, 2}, rc{1, 1};
      if (comm.rank() == 1) rc = {3, 2};
      std::vector<float> send(3), recv(rc[0] + rc[1]);
      comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(sc),
                        std::span<float>(recv), std::span<const std::size_t>(rc));
    });
  });
  for (const auto& c : counts)
    CHECK_THAT(c.message, Contains("rank 0 sends 2 elements to rank 1 but rank 1 expects 3"));
  auto local = per_rank<Caught>(2, [](LocalComm& comm) {
    return catch_comm_error([&] {
      std::vector<float> send(8), recv(3);  // 2 ranks x 3 needs 6
      comm.reduce_scatter(std::span<const float>(send), std::span<float>(recv), ReduceOp::sum);
    });
  });
  CHECK_THAT(local[0].message,
             Contains("reduce_scatter") && Contains("send holds 8 elements of f32, expected 6"));
}

TEST_CASE("A receive honours the deadline and checks the message size", "[unit][comm]") {
  std::latch done(1);
  std::vector<Caught> got(2);
  LocalComm::run(
      2,
      [&](LocalComm& comm) {
        if (comm.rank() == 1) {
          done.wait();
          return;
        }
        got[0] = catch_comm_error([&] {
          std::vector<float> v(4);
          comm.recv(std::span<float>(v), 1, 5);
        });
        done.count_down();
      },
      CommOptions{.timeout_s = 0.3});
  CHECK_THAT(got[0].message, Contains("recv") && Contains("timed out after 0.3 s") &&
                                 Contains("from rank 1") && Contains("tag 5"));
  CHECK(got[0].seconds < 2.3);

  auto sizes = per_rank<Caught>(2, [](LocalComm& comm) {
    return catch_comm_error([&] {
      std::vector<float> v(comm.rank() == 0 ? 4 : 5);
      if (comm.rank() == 0)
        comm.send(std::span<const float>(v), 1);
      else
        comm.recv(std::span<float>(v), 0);
    });
  });
  CHECK_THAT(sizes[1].message, Contains("rank 0 sent 4 elements of f32") && Contains("expects 5"));
}

TEST_CASE("An async op's failure surfaces through Work::wait", "[unit][comm]") {
  std::latch done(1);
  std::vector<Caught> got(2);
  LocalComm::run(
      2,
      [&](LocalComm& comm) {
        if (comm.rank() == 1) {
          done.wait();
          return;
        }
        std::vector<float> v(4);
        auto work =
            comm.all_reduce_async(std::span<const float>(v), std::span<float>(v), ReduceOp::sum);
        got[0] = catch_comm_error([&] { work.wait(); });
        done.count_down();
      },
      CommOptions{.timeout_s = 0.3});
  CHECK_THAT(got[0].message, Contains("all_reduce") && Contains("timed out"));
}

TEST_CASE("Negative control: the deadline test would catch an op that hangs past it",
          "[unit][comm]") {
  // The same withheld-rank setup with a deadline longer than the allowed window: the elapsed
  // time check used above must reject it.
  std::latch done(1);
  std::vector<Caught> got(2);
  LocalComm::run(
      2,
      [&](LocalComm& comm) {
        if (comm.rank() == 1) {
          done.wait();
          return;
        }
        got[0] = catch_comm_error([&] { comm.barrier(); });
        done.count_down();
      },
      CommOptions{.timeout_s = 0.6});
  const double allowed = 0.3 + 0.2;  // what a 0.3 s deadline test would accept
  CHECK_FALSE(got[0].seconds < allowed);
}
