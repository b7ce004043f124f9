// MpiComm under mpiexec (2 and 4 ranks): every op x element type against closed forms, split
// and ProcessGroups against the Grid, async completion, deadlines, logger. Every rank asserts
// on its own results; the main reduces the exit code over ranks.

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/process_groups.hpp>

#include "comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using namespace zero::parallel::testing;
using Catch::Matchers::Contains;

#define COMM_TYPES double, float, zero::bf16, zero::f16, std::int32_t, std::int64_t, std::uint8_t

namespace {
/// Every collective on comm checked against the closed forms; returns nothing, asserts inline
/// (each MPI rank is its own process, so Catch2 is safe here).
template <class T>
void check_all_ops(MpiComm& comm) {
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  constexpr std::size_t count = 21;
  for (ReduceOp op : all_reduce_ops) {
    INFO("group " << comm.name() << " op " << name_of(op));
    auto send = make_input<T>(me, count);
    std::vector<T> recv(count), want(count);
    for (std::size_t i = 0; i < count; ++i) want[i] = expected_reduction<T>(op, n, i);
    comm.all_reduce(std::span<const T>(send), std::span<T>(recv), op);
    CHECK(first_mismatch(recv, want) == -1);
    comm.all_reduce(std::span<T>(send), op);  // in place
    CHECK(first_mismatch(send, want) == -1);

    auto big = make_input<T>(me, count * un);
    std::vector<T> mine(count), want_rs(count);
    for (std::size_t i = 0; i < count; ++i) {
      want_rs[i] = expected_reduction<T>(op, n, static_cast<std::size_t>(me) * count + i);
    }
    comm.reduce_scatter(std::span<const T>(big), std::span<T>(mine), op);
    CHECK(first_mismatch(mine, want_rs) == -1);
  }
  std::vector<T> gathered(count * un), want_ag;
  for (int q = 0; q < n; ++q) append(want_ag, make_input<T>(q, count));
  auto send = make_input<T>(me, count);
  comm.all_gather(std::span<const T>(send), std::span<T>(gathered));
  CHECK(first_mismatch(gathered, want_ag) == -1);

  for (int root = 0; root < n; ++root) {
    auto buf = make_input<T>(me, count);
    comm.broadcast(std::span<T>(buf), root);
    CHECK(first_mismatch(buf, make_input<T>(root, count)) == -1);
  }

  auto a2a_send = make_input<T>(me, 3 * un);
  std::vector<T> a2a_recv(3 * un), want_a2a;
  for (int q = 0; q < n; ++q)
    append(want_a2a, make_input<T>(q, 3, static_cast<std::size_t>(me) * 3));
  comm.all_to_all(std::span<const T>(a2a_send), std::span<T>(a2a_recv));
  CHECK(first_mismatch(a2a_recv, want_a2a) == -1);

  auto sent = [](int s, int d) { return static_cast<std::size_t>((s + d) % 3); };
  auto value = [](int s, int d) { return convert<T>(static_cast<double>((s * 10 + d) % 60)); };
  std::vector<std::size_t> sc(un), rc(un);
  std::vector<T> v_send, v_want;
  for (int d = 0; d < n; ++d) {
    sc[static_cast<std::size_t>(d)] = sent(me, d);
    rc[static_cast<std::size_t>(d)] = sent(d, me);
    v_send.insert(v_send.end(), sent(me, d), value(me, d));
    v_want.insert(v_want.end(), sent(d, me), value(d, me));
  }
  std::vector<T> v_recv(v_want.size());
  comm.all_to_all_v(std::span<const T>(v_send), std::span<const std::size_t>(sc),
                    std::span<T>(v_recv), std::span<const std::size_t>(rc));
  CHECK(first_mismatch(v_recv, v_want) == -1);

  if (n > 1) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto out = make_input<T>(me, 4);
    std::vector<T> in(4);
    comm.group_start();  // a ring of blocking pairs would deadlock without the group
    comm.send(std::span<const T>(out), right, 3);
    comm.recv(std::span<T>(in), left, 3);
    comm.group_end();
    CHECK(first_mismatch(in, make_input<T>(left, 4)) == -1);
  }
}
}  // namespace

TEMPLATE_TEST_CASE("MpiComm: every op matches the closed form on the world and a split", "[mpi]",
                   COMM_TYPES) {
  auto world = MpiComm::world();
  check_all_ops<TestType>(world);
  auto halves = world.split(world.rank() % 2, world.rank(), "parity");
  check_all_ops<TestType>(halves);
}

TEST_CASE("MpiComm: all_reduce above the ring threshold runs libnbc's ring and stays exact",
          "[mpi]") {
  // The rule (mpi_algorithms.hpp): ring from 64 KiB below 4 ranks, from 1 MiB at 4 or more.
  CHECK(parallel::detail::iallreduce_algorithm(2, (64 << 10) - 4) == 0);
  CHECK(parallel::detail::iallreduce_algorithm(2, 64 << 10) == 1);
  CHECK(parallel::detail::iallreduce_algorithm(4, 512 << 10) == 0);
  CHECK(parallel::detail::iallreduce_algorithm(4, 1 << 20) == 1);
  auto world = MpiComm::world();
  const int n = world.size(), me = world.rank();
  for (std::size_t count : {std::size_t{1000}, std::size_t{(1 << 20) / 4 + 3}}) {
    INFO("count " << count);
    for (ReduceOp op : all_reduce_ops) {
      auto send = make_input<float>(me, count);
      std::vector<float> recv(count), want(count);
      for (std::size_t i = 0; i < count; ++i) want[i] = expected_reduction<float>(op, n, i);
      world.all_reduce(std::span<const float>(send), std::span<float>(recv), op);
      CHECK(first_mismatch(recv, want) == -1);
      world.all_reduce(std::span<float>(send), op);  // in place
      CHECK(first_mismatch(send, want) == -1);
    }
  }
  // Open MPI here has the control variable; binding it did not change the thread level.
  CHECK(parallel::detail::IallreduceAlgorithm::instance().active());
  CHECK(MpiComm::thread_level() == MPI_THREAD_MULTIPLE);
}

namespace {
/// Rank r's element i for the direct-exchange test: not small integers, so that sums round and
/// a fold in another order than rank order would show.
float inexact_input(int rank, std::size_t i) {
  return 0.1f * static_cast<float>(rank + 1) + 1e-3f * static_cast<float>(i % 97);
}

/// reduce_scatter (sum or avg) and all_gather of `chunk` elements per rank, each against the
/// rank-order fp32 fold of every rank's input, bit for bit, with and without aliased buffers.
template <class T>
void check_direct_exchange(MpiComm& comm, std::size_t chunk) {
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n), mine = static_cast<std::size_t>(me) * chunk;
  std::vector<T> send(un * chunk);
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = convert<T>(inexact_input(me, i));
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    INFO("group " << comm.name() << " chunk " << chunk << " op " << name_of(op));
    std::vector<T> want(chunk), wrong(chunk);
    auto fold = [&](std::size_t at) {  // MpiComm's fold: fp32, rank order, rounded once
      float acc = static_cast<float>(convert<T>(inexact_input(0, at)));
      for (int q = 1; q < n; ++q) acc = acc + static_cast<float>(convert<T>(inexact_input(q, at)));
      if (op == ReduceOp::avg) acc = acc / static_cast<float>(n);
      return convert<T>(acc);
    };
    for (std::size_t i = 0; i < chunk; ++i) {
      want[i] = fold(mine + i);
      wrong[i] = fold(((static_cast<std::size_t>(me) + 1) % un) * chunk + i);  // another chunk
    }
    std::vector<T> recv(chunk);
    comm.reduce_scatter(std::span<const T>(send), std::span<T>(recv), op);
    CHECK(first_mismatch(recv, want) == -1);
    if (n > 1) CHECK(first_mismatch(recv, wrong) != -1);  // negative control
    std::vector<T> in_place = send;  // NCCL's form: recv is this rank's chunk of send
    comm.reduce_scatter(std::span<const T>(in_place), std::span<T>(in_place).subspan(mine, chunk),
                        op);
    CHECK(first_mismatch(std::vector<T>(in_place.begin() + static_cast<long>(mine),
                                        in_place.begin() + static_cast<long>(mine + chunk)),
                         want) == -1);
  }
  std::vector<T> want_ag(un * chunk), gathered(un * chunk);
  for (int q = 0; q < n; ++q) {
    for (std::size_t i = 0; i < chunk; ++i) {
      want_ag[static_cast<std::size_t>(q) * chunk + i] = convert<T>(inexact_input(q, i));
    }
  }
  const std::vector<T> part(send.begin(), send.begin() + static_cast<long>(chunk));
  comm.all_gather(std::span<const T>(part), std::span<T>(gathered));
  CHECK(first_mismatch(gathered, want_ag) == -1);
  std::vector<T> in_place(un * chunk);
  std::copy(part.begin(), part.end(), in_place.begin() + static_cast<long>(mine));
  comm.all_gather(std::span<const T>(in_place).subspan(mine, chunk), std::span<T>(in_place));
  CHECK(first_mismatch(in_place, want_ag) == -1);
}
}  // namespace

TEMPLATE_TEST_CASE(
    "MpiComm: all_gather and reduce_scatter on small groups run as direct exchanges, exactly",
    "[mpi]", float, zero::bf16) {
  // The rule (mpi_algorithms.hpp): direct up to 8 ranks, libnbc above.
  CHECK(parallel::detail::direct_exchange(2));
  CHECK(parallel::detail::direct_exchange(8));
  CHECK_FALSE(parallel::detail::direct_exchange(9));
  auto world = MpiComm::world();
  auto halves = world.split(world.rank() % 2, world.rank(), "parity");
  // 64 KiB of f32 in all at 4 ranks, and 1 MiB + 3 elements per rank (sizes comm_bench times).
  for (std::size_t chunk : {std::size_t{4096}, std::size_t{(1 << 18) + 3}}) {
    check_direct_exchange<TestType>(world, chunk);
    check_direct_exchange<TestType>(halves, chunk);
  }
}

TEST_CASE("MpiComm: ProcessGroups' sub-communicators hold the Grid's ranks", "[mpi]") {
  auto world = MpiComm::world();
  const int n = world.size();
  const Grid grid = n % 4 == 0 ? Grid::for_world(n, 2, 1, 1, 2) : Grid::for_world(n, n, 1, 1, 1);
  ProcessGroups<MpiComm> groups(world, grid);
  for (AxisMask m : standard_masks()) {
    auto& comm = groups.get(m);
    INFO("mask " << m.to_string());
    std::vector<int> mine{world.rank()}, members(static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const int>(mine), std::span<int>(members));
    CHECK(members == grid.group_ranks(world.rank(), m));
    CHECK(comm.rank() == grid.key(world.rank(), m));
    CHECK(comm.name() == m.to_string());
  }
  auto none = world.split(world.rank() == 0 ? 0 : undefined_color, 0);
  CHECK(none.is_null() == (world.rank() != 0));
}

TEST_CASE("MpiComm: async ops complete through Work and overlap with compute", "[mpi]") {
  // The last rank joins only after rank 0 has issued the op and seen it pending (a message on
  // another communicator says so): if the async call blocked, rank 0 would never send it.
  auto world = MpiComm::world();
  const int n = world.size(), me = world.rank();
  auto side = world.split(0, me, "side");
  int go = 0;
  if (me == n - 1 && n > 1) side.recv(std::span<int>(&go, 1), 0, 7);
  std::vector<double> big(1 << 20, me + 1.0);
  auto work =
      world.all_reduce_async(std::span<const double>(big), std::span<double>(big), ReduceOp::sum);
  if (me == 0 && n > 1) {
    CHECK_FALSE(work.test());  // the last rank has not joined yet
    go = 1;
    side.send(std::span<int>(&go, 1), n - 1, 7);
  }
  double compute = 0;
  for (int i = 1; i <= 100000; ++i) compute += 1.0 / i;
  while (!work.test()) {
  }
  CHECK(big[12345] == n * (n + 1) / 2.0);
  CHECK(compute > 12.0);
  CHECK(MpiComm::thread_level() == MPI_THREAD_MULTIPLE);
}

TEST_CASE("MpiComm: a withheld receive and a withheld collective fail within the deadline",
          "[mpi]") {
  auto world = MpiComm::world();
  const int n = world.size(), me = world.rank();
  {
    auto comm = world.split(0, me, "p2p");
    comm.set_options(CommOptions{.timeout_s = 0.5});
    if (me == 0) {
      std::vector<float> v(8);
      const auto start = std::chrono::steady_clock::now();
      CHECK_THROWS_WITH(comm.recv(std::span<float>(v), 1, 4),
                        Contains("recv") && Contains("timed out after 0.5 s") &&
                            Contains("waiting for rank 1") && Contains("32 bytes of f32"));
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      CHECK(s >= 0.49);
      CHECK(s < 2.5);
    }
    world.barrier();
    comm.barrier();  // the receive was cancelled: the group still works
  }
  {
    auto late = world.split(0, me, "late");
    late.set_options(CommOptions{.timeout_s = 0.5});
    if (me != n - 1) {
      const auto start = std::chrono::steady_clock::now();
      // The census names the one rank that never joined, and the ones that did.
      const std::string missing = "never joined it";
      const std::string named = "(world ranks [" + std::to_string(n - 1) + "])";
      CHECK_THROWS_WITH(late.barrier(), Contains("barrier") && Contains("group 'late'") &&
                                            Contains("timed out after 0.5 s") &&
                                            Contains("world ranks [0, 1") && Contains(missing) &&
                                            Contains(named));
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      CHECK(s < 2.5);
      // The barrier is still posted: a later op could match its messages, so every op on this
      // group is refused at once, naming the op that timed out.
      std::vector<float> one(1, 1.0f);
      CHECK_THROWS_WITH(late.all_reduce(std::span<float>(one), ReduceOp::sum),
                        Contains("group 'late' is unusable") && Contains("barrier #0") &&
                            Contains("timed out earlier"));
      world.barrier();
    } else {
      world.barrier();  // the others have timed out; now join, so their requests complete
      late.barrier();
    }
    world.barrier();
  }
  {
    // The same for an all_gather, which runs as a direct exchange (mpi_direct.hpp). Small
    // messages go eagerly, so the late rank's exchange completes against the abandoned one.
    auto late = world.split(0, me, "late_gather");
    late.set_options(CommOptions{.timeout_s = 0.5});
    std::vector<float> mine(4, 1.0f), all(4 * static_cast<std::size_t>(n));
    if (me != n - 1) {
      const auto start = std::chrono::steady_clock::now();
      CHECK_THROWS_WITH(late.all_gather(std::span<const float>(mine), std::span<float>(all)),
                        Contains("all_gather") && Contains("group 'late_gather'") &&
                            Contains("timed out after 0.5 s") && Contains("never joined it") &&
                            Contains("(world ranks [" + std::to_string(n - 1) + "])"));
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      CHECK(s < 2.5);
      world.barrier();
    } else {
      world.barrier();
      late.all_gather(std::span<const float>(mine), std::span<float>(all));
    }
    world.barrier();
  }
}

TEST_CASE(
    "MpiComm: a receive that matched its message as it timed out never waits past the "
    "deadline and its grace, and keeps the data that came in whole",
    "[mpi]") {
  // A timed-out receive was cancelled and then waited for without a deadline. Cancelling does
  // nothing to a receive that matched a message already: a large one moves only while its
  // sender calls into MPI, so the wait hung while the sender did other work, and where the data
  // did land the caller got "timed out" with the message in its buffer.
  auto world = MpiComm::world();
  const int me = world.rank();
  auto comm = world.split(0, me, "matched");
  comm.set_options(CommOptions{.timeout_s = 0.4});  // census grace 0.2 s
  const std::size_t n = std::size_t{64} << 20;      // 256 MiB: a rendezvous message
  std::vector<float> buf(me <= 1 ? n : 0, me == 1 ? 2.5f : 0.0f);
  if (me == 1) {
    // Posted just before rank 0's deadline, so the deadline passes while the message moves.
    std::this_thread::sleep_for(std::chrono::milliseconds(370));
    auto work = comm.send_async(std::span<const float>(buf), 0, 9);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // no MPI calls meanwhile
    try {
      work.wait();
    } catch (const CommError&) {
      // rank 0's receive was cancelled before the message reached it (a loaded machine)
    }
  } else if (me == 0) {
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      comm.recv(std::span<float>(buf), 1, 9);
    } catch (const CommError& e) {
      error = e.what();
    }
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(error);
    CHECK(s < 1.2);  // 0.4 s, its grace of 0.2 s, slack; the sender calls MPI again at 1.8 s
    const bool whole = std::all_of(buf.begin(), buf.end(), [](float x) { return x == 2.5f; });
    if (error.empty()) {
      CHECK(whole);
    } else {
      CHECK_THAT(error, Contains("timed out after 0.4 s"));
      CHECK_FALSE(whole);  // a message that came in whole is no timeout
    }
  }
  world.barrier();  // rank 1's send is complete: nothing writes into buf any more
}

TEST_CASE("MpiComm: verify_sequence names both ranks' ops where the collective sequence diverges",
          "[mpi]") {
  auto world = MpiComm::world();
  const int me = world.rank();
  auto comm = world.split(0, me, "checked");
  comm.set_options(CommOptions{.timeout_s = 20, .verify_sequence = true});
  std::vector<float> buf(4, 1.0f);
  // Negative control: the same ops on every rank pass the check and still reduce.
  comm.all_reduce(std::span<float>(buf), ReduceOp::sum);
  CHECK(buf[0] == static_cast<float>(comm.size()));
  // Rank 1 issues a barrier where the others issue an all_reduce: every rank fails before any
  // data moves, and the message names both ops with their sequence numbers.
  if (me == 1) {
    CHECK_THROWS_WITH(comm.barrier(), Contains("diverged on group 'checked'") &&
                                          Contains("rank 1 (world rank 1) issued barrier #1") &&
                                          Contains("issued all_reduce #1 (4 elements of f32)"));
  } else {
    CHECK_THROWS_WITH(comm.all_reduce(std::span<float>(buf), ReduceOp::sum),
                      Contains("diverged on group 'checked'") &&
                          Contains("issued all_reduce #1 (4 elements of f32)") &&
                          Contains("rank 1 (world rank 1) issued barrier #1"));
  }
  // A count that differs on one rank is a divergence too (MPI would corrupt or truncate).
  std::vector<float> other(me == 0 ? 5 : 4, 1.0f);
  CHECK_THROWS_WITH(comm.all_reduce(std::span<float>(other), ReduceOp::sum),
                    Contains("all_reduce #2 (5 elements of f32)") &&
                        Contains("all_reduce #2 (4 elements of f32)"));
  // Nothing was posted, so the group still works.
  comm.all_reduce(std::span<float>(buf), ReduceOp::max);
  CHECK(buf[0] == static_cast<float>(comm.size()));
  world.barrier();
}

TEST_CASE("MpiComm: size mismatches are reported", "[mpi]") {
  auto world = MpiComm::world();
  std::vector<float> send(5), recv(3);
  CHECK_THROWS_WITH(world.all_gather(std::span<const float>(send), std::span<float>(recv)),
                    Contains("all_gather") && Contains("recv holds 3 elements"));
  if (world.size() >= 2 && world.rank() < 2) {
    std::vector<std::int32_t> msg(world.rank() == 0 ? 4 : 6);
    if (world.rank() == 0) {
      world.send(std::span<const std::int32_t>(msg), 1, 9);
    } else {
      CHECK_THROWS_WITH(world.recv(std::span<std::int32_t>(msg), 0, 9),
                        Contains("rank 0 sent 4 elements of i32") && Contains("expects 6"));
    }
  }
  world.barrier();
}

TEST_CASE("MpiComm: the logger counts nccl-tests bytes per op", "[mpi]") {
  auto world = MpiComm::world();
  auto logger = std::make_shared<CommLogger>();
  world.set_logger(logger);
  const int n = world.size();
  std::vector<float> a(256), big(256 * static_cast<std::size_t>(n));
  world.all_reduce(std::span<float>(a), ReduceOp::sum);
  world.reduce_scatter(std::span<const float>(big), std::span<float>(a), ReduceOp::sum);
  world.set_logger(nullptr);
  CHECK(logger->total(CommOp::all_reduce).bytes == 1024);
  CHECK(logger->total(CommOp::all_reduce).bus_bytes == Approx(1024 * 2.0 * (n - 1) / n));
  CHECK(logger->total(CommOp::reduce_scatter, "world").bytes == 1024u * static_cast<unsigned>(n));
}

TEST_CASE("MpiComm: verify_sequence counts collectives only, not sends and receives", "[mpi]") {
  // A pipeline's middle stages send and receive twice as often as its ends: numbered with the
  // collectives, the next all_reduce carried different numbers on different ranks and failed
  // the check.
  auto world = MpiComm::world();
  const int me = world.rank(), n = world.size();
  auto comm = world.split(0, me, "chain");
  comm.set_options(CommOptions{.timeout_s = 20, .verify_sequence = true});
  std::vector<float> token(3, 1.0f);
  if (me > 0) comm.recv(std::span<float>(token), me - 1, 5);
  if (me + 1 < n) comm.send(std::span<const float>(token), me + 1, 5);
  std::vector<float> buf(4, 1.0f);
  CHECK_NOTHROW(comm.all_reduce(std::span<float>(buf), ReduceOp::sum));
  CHECK(buf[0] == static_cast<float>(n));
  world.barrier();
}

TEST_CASE("MpiComm: verify_sequence checks all_to_all_v's counts pair by pair", "[mpi]") {
  // Each rank's own sizes are checked in any mode, but whether rank a's send_counts[b] equals
  // rank b's recv_counts[a] needs both ranks' counts: without the check MPI truncates the message
  // or leaves part of the receive buffer unwritten, on one rank only.
  auto world = MpiComm::world();
  const int me = world.rank(), n = world.size();
  auto comm = world.split(0, me, "exchange");
  comm.set_options(CommOptions{.timeout_s = 20, .verify_sequence = true});
  const auto exchange = [&](std::vector<std::size_t> send_counts) {
    std::vector<std::size_t> recv_counts(static_cast<std::size_t>(n), 1);
    std::size_t total = 0;
    for (std::size_t c : send_counts) total += c;
    std::vector<float> send(total, static_cast<float>(me)), recv(static_cast<std::size_t>(n));
    comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(send_counts),
                      std::span<float>(recv), std::span<const std::size_t>(recv_counts));
    return recv;
  };
  const std::vector<std::size_t> ones(static_cast<std::size_t>(n), 1);
  // Negative control: counts that agree pass and exchange.
  const std::vector<float> got = exchange(ones);
  for (int q = 0; q < n; ++q) CHECK(got[static_cast<std::size_t>(q)] == static_cast<float>(q));
  // Rank 0 sends 2 elements to rank 1, which expects 1: every rank fails with the same message.
  std::vector<std::size_t> skewed = ones;
  if (me == 0) skewed[1] = 2;
  CHECK_THROWS_WITH(exchange(skewed), Contains("all_to_all_v #") && Contains("group 'exchange'") &&
                                          Contains("rank 0 sends 2 elements to rank 1 but rank "
                                                   "1 expects 1 from it"));
  // Nothing was posted, so the group still works.
  CHECK(exchange(ones) == got);
  world.barrier();
}
