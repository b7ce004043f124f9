// CommLogger: counts, nccl-tests bytes and bus factors per op and group, run-time switch.

#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>

#include "comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;

TEST_CASE("bus_factor follows nccl-tests", "[unit][comm]") {
  CHECK(bus_factor(CommOp::all_reduce, 4) == Approx(1.5));
  CHECK(bus_factor(CommOp::reduce_scatter, 4) == Approx(0.75));
  CHECK(bus_factor(CommOp::all_gather, 8) == Approx(0.875));
  CHECK(bus_factor(CommOp::all_to_all, 2) == Approx(0.5));
  CHECK(bus_factor(CommOp::broadcast, 8) == 1.0);
  CHECK(bus_factor(CommOp::all_reduce, 1) == 0.0);
}

TEST_CASE("CommLogger records per op and group, and can be switched off", "[unit][comm]") {
  const int n = 4;
  constexpr std::size_t count = 1024;
  struct Totals {
    CommStats ar, rs, ag, ar_tp, all;
    std::size_t rows;
    CommStats after_off;
  };
  auto got = zero::testing::per_rank<Totals>(n, [&](LocalComm& world) {
    auto logger = std::make_shared<CommLogger>();
    world.set_logger(logger);
    auto tp = world.split(world.rank() / 2, world.rank(), "tp");  // inherits the logger
    std::vector<float> a(count), big(count * n);
    world.all_reduce(std::span<float>(a), ReduceOp::sum);
    world.all_reduce(std::span<float>(a), ReduceOp::sum);
    world.reduce_scatter(std::span<const float>(big), std::span<float>(a), ReduceOp::sum);
    world.all_gather(std::span<const float>(a), std::span<float>(big));
    tp.all_reduce(std::span<float>(a), ReduceOp::sum);
    Totals t{logger->total(CommOp::all_reduce, "world"),
             logger->total(CommOp::reduce_scatter),
             logger->total(CommOp::all_gather),
             logger->total(CommOp::all_reduce, "tp"),
             logger->total(),
             logger->records().size(),
             {}};
    logger->enable(false);
    world.all_reduce(std::span<float>(a), ReduceOp::sum);
    logger->enable(true);
    logger->reset();
    t.after_off = logger->total();
    return t;
  });
  const double bytes = count * sizeof(float);
  for (const auto& t : got) {
    CHECK(t.ar.count == 2);
    CHECK(t.ar.bytes == 2 * count * sizeof(float));
    CHECK(t.ar.bus_bytes == Approx(2 * bytes * 1.5));
    CHECK(t.rs.bytes == n * count * sizeof(float));  // S is the whole send buffer
    CHECK(t.rs.bus_bytes == Approx(n * bytes * 0.75));
    CHECK(t.ag.bytes == n * count * sizeof(float));
    CHECK(t.ar_tp.count == 1);
    CHECK(t.ar_tp.bus_bytes == Approx(bytes * 1.0));  // 2 ranks: 2(n-1)/n = 1
    CHECK(t.all.count == 6);                          // 5 ops + the split
    CHECK(t.rows == 5);                               // split, ar, rs, ag on world; ar on tp
    CHECK(t.ar.time_s > 0);
    CHECK(t.after_off.count == 0);
  }
}

TEST_CASE("CommLogger report prints one JSON object per row", "[unit][comm]") {
  CommLogger logger;
  logger.record(CommOp::all_gather, "dp", 8, 8000, 0.001);
  const auto text = logger.report();
  CHECK(text ==
        "{\"op\":\"all_gather\",\"group\":\"dp\",\"ranks\":8,\"count\":1,\"bytes\":8000,"
        "\"bus_bytes\":7000,\"time_s\":0.001,\"algbw_gbps\":0.008,\"busbw_gbps\":0.007}\n");
}

TEST_CASE("CommLogger summary per op, group and size, op filter, verbose lines", "[unit][comm]") {
  CommLogger logger;
  std::vector<std::string> lines;
  logger.set_verbose([&](const std::string& line) { lines.push_back(line); });
  logger.record(CommOp::all_reduce, "dp", 4, 4096, 0.002);
  logger.record(CommOp::all_reduce, "dp", 4, 4096, 0.004);
  logger.record(CommOp::all_reduce, "dp", 4, 1 << 20, 0.010);
  logger.record(CommOp::all_gather, "tp", 2, 512, 0.001);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0].find("comm op: all_reduce | group: dp (4 ranks)") != std::string::npos);
  CHECK(lines[0].find("msg size: 4.0 KB") != std::string::npos);

  const auto sized = logger.records_by_size();
  REQUIRE(sized.size() == 3);
  CHECK(sized[0].second == 4096);
  CHECK(sized[0].first.stats.count == 2);
  CHECK(sized[0].first.stats.time_s == Approx(0.006));
  CHECK(sized[0].first.stats.busbw_gbps() == Approx(2 * 4096 * 1.5 / 0.006 / 1e9));
  CHECK(logger.total(CommOp::all_reduce, "dp").count == 3);  // the (op, group) rows still sum

  const std::string table = logger.log_summary();
  CHECK(table.find("Comm. Op") != std::string::npos);
  CHECK(table.find("all_reduce [dp, 4 ranks]") != std::string::npos);
  CHECK(table.find("all_gather [tp, 2 ranks]") != std::string::npos);
  CHECK(table.find("1.0 MB") != std::string::npos);
  CHECK(table.find("4.0 KB        2 ") != std::string::npos);  // count 2 for the 4 KB rows

  // prof_ops: only the listed ops are recorded
  logger.reset();
  logger.set_verbose(nullptr);
  logger.record_only({comm_op_named("all_gather")});
  logger.record(CommOp::all_reduce, "dp", 4, 4096, 0.002);
  logger.record(CommOp::all_gather, "dp", 4, 4096, 0.002);
  CHECK(logger.total(CommOp::all_reduce).count == 0);
  CHECK(logger.total(CommOp::all_gather).count == 1);
  // Every op's time, the filter aside (the wall-clock breakdown's time in flight is their union).
  CHECK(logger.total().time_s == Approx(0.002));
  CHECK(logger.seconds_of_every_op() == Approx(0.004));
  CHECK(lines.size() == 4);
  CHECK_THROWS_WITH(comm_op_named("allreduce"), Catch::Contains("all_reduce, reduce_scatter"));
}

TEST_CASE("CommLogger: the time in flight counts overlapping ops once", "[unit]") {
  // A prefetched gather and a reduce-scatter in flight together took 3 s of wall time, not the
  // 4 s their latencies sum to; an op that completes later but began earlier fills the gap.
  CommLogger logger;
  const auto t0 = CommClock::now();
  const auto at = [&](double s) {
    return t0 + std::chrono::duration_cast<CommClock::duration>(std::chrono::duration<double>(s));
  };
  logger.record(CommOp::all_gather, "dp", 4, 4096, at(0), at(2));
  logger.record(CommOp::reduce_scatter, "dp", 4, 4096, at(1), at(3));
  CHECK(logger.seconds_of_every_op() == Approx(4));
  CHECK(logger.seconds_in_flight() == Approx(3));
  logger.record(CommOp::all_gather, "dp", 4, 4096, at(5), at(6));  // after a gap
  CHECK(logger.seconds_in_flight() == Approx(4));
  logger.record(CommOp::all_reduce, "dp", 4, 4096, at(2.5), at(7));  // spans the gap
  CHECK(logger.seconds_in_flight() == Approx(7));
  CHECK(logger.seconds_of_every_op() == Approx(9.5));
  logger.record(CommOp::all_reduce, "dp", 4, 4096, at(1.5), at(1.75));  // inside: adds nothing
  CHECK(logger.seconds_in_flight() == Approx(7));
  logger.record_only({CommOp::send});  // the filter does not hide ops from the wall time
  logger.record(CommOp::all_reduce, "dp", 4, 4096, at(8), at(8.5));
  CHECK(logger.seconds_in_flight() == Approx(7.5));
  logger.enable(false);  // nor does a disabled logger count any
  logger.record(CommOp::all_reduce, "dp", 4, 4096, at(9), at(10));
  CHECK(logger.seconds_in_flight() == Approx(7.5));
  logger.reset();
  CHECK(logger.seconds_in_flight() == 0);
}

TEST_CASE("LocalComm: an async op's interval starts when it was issued, not when it ran",
          "[unit][comm]") {
  // Rank 0 queues an all-reduce behind a barrier that rank 1 joins 100 ms late. The all-reduce
  // waited in the queue all that time: its interval starts at its issue, as an op queued on a
  // stream's, so the wait for it counts as communication. A blocking op starts when it runs.
  constexpr double late_s = 0.1;
  const auto seconds = zero::testing::per_rank<std::vector<double>>(2, [&](LocalComm& comm) {
    auto logger = std::make_shared<CommLogger>();
    comm.set_logger(logger);
    std::vector<float> a(16, 1.0f);
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::duration<double>(late_s));
    Work barrier = comm.barrier_async();
    Work reduce = comm.all_reduce_async<float>(a, a, ReduceOp::sum);
    barrier.wait();
    reduce.wait();
    const double queued = logger->total(CommOp::all_reduce).time_s;
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::duration<double>(late_s));
    comm.all_reduce(std::span<float>(a), ReduceOp::sum);  // blocking: rank 0 waits for rank 1
    return std::vector<double>{queued, logger->total(CommOp::all_reduce).time_s - queued};
  });
  CHECK(seconds[0][0] >= 0.9 * late_s);  // it ran in microseconds once the barrier let it
  CHECK(seconds[1][0] < 0.9 * late_s);   // rank 1 issued it after its sleep
  CHECK(seconds[0][1] >= 0.9 * late_s);  // the blocking op's wait for the late rank
  CHECK(seconds[1][1] < 0.9 * late_s);
}
