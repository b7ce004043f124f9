// LocalComm collectives: every op x element type x world size 1..8 against closed forms.

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <latch>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/comm/text_collectives.hpp>

#include "comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using namespace zero::parallel::testing;

#define COMM_TYPES double, float, zero::bf16, zero::f16, std::int32_t, std::int64_t, std::uint8_t

TEMPLATE_TEST_CASE("LocalComm all_reduce matches the closed form for every op and world size",
                   "[unit][comm]", COMM_TYPES) {
  using T = TestType;
  constexpr std::size_t count = 37;  // not a multiple of the rank count: uneven chunks
  for (int n = 1; n <= 8; ++n) {
    for (ReduceOp op : all_reduce_ops) {
      for (bool in_place : {false, true}) {
        auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
          auto send = make_input<T>(comm.rank(), count);
          if (in_place) {
            comm.all_reduce(std::span<T>(send), op);
            return send;
          }
          std::vector<T> recv(count);
          comm.all_reduce(std::span<const T>(send), std::span<T>(recv), op);
          return recv;
        });
        std::vector<T> want(count);
        for (std::size_t i = 0; i < count; ++i) want[i] = expected_reduction<T>(op, n, i);
        INFO("n=" << n << " op=" << name_of(op) << " in_place=" << in_place);
        for (int r = 0; r < n; ++r)
          CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want) == -1);
      }
    }
  }
}

TEMPLATE_TEST_CASE("LocalComm reduce_scatter gives rank r the reduction of chunk r", "[unit][comm]",
                   COMM_TYPES) {
  using T = TestType;
  constexpr std::size_t count = 13;
  for (int n = 1; n <= 8; ++n) {
    for (ReduceOp op : all_reduce_ops) {
      auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
        auto send = make_input<T>(comm.rank(), count * static_cast<std::size_t>(n));
        std::vector<T> recv(count);
        comm.reduce_scatter(std::span<const T>(send), std::span<T>(recv), op);
        return recv;
      });
      INFO("n=" << n << " op=" << name_of(op));
      for (int r = 0; r < n; ++r) {
        std::vector<T> want(count);
        for (std::size_t i = 0; i < count; ++i) {
          want[i] = expected_reduction<T>(op, n, static_cast<std::size_t>(r) * count + i);
        }
        CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want) == -1);
      }
    }
  }
}

TEMPLATE_TEST_CASE("LocalComm all_gather and broadcast move every rank's data", "[unit][comm]",
                   COMM_TYPES) {
  using T = TestType;
  constexpr std::size_t count = 11;
  for (int n = 1; n <= 8; ++n) {
    for (bool in_place : {false, true}) {
      auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
        std::vector<T> recv(count * static_cast<std::size_t>(n));
        auto send = make_input<T>(comm.rank(), count);
        if (in_place) {
          // NCCL's in-place form: the send buffer is this rank's chunk of recv.
          auto mine =
              std::span<T>(recv).subspan(static_cast<std::size_t>(comm.rank()) * count, count);
          std::copy(send.begin(), send.end(), mine.begin());
          comm.all_gather(std::span<const T>(mine), std::span<T>(recv));
        } else {
          comm.all_gather(std::span<const T>(send), std::span<T>(recv));
        }
        return recv;
      });
      std::vector<T> want;
      for (int q = 0; q < n; ++q) {
        auto chunk = make_input<T>(q, count);
        append(want, chunk);
      }
      INFO("all_gather n=" << n << " in_place=" << in_place);
      for (int r = 0; r < n; ++r)
        CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want) == -1);
    }
    for (int root = 0; root < n; ++root) {
      auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
        auto buf = make_input<T>(comm.rank(), count);
        comm.broadcast(std::span<T>(buf), root);
        return buf;
      });
      INFO("broadcast n=" << n << " root=" << root);
      for (int r = 0; r < n; ++r) {
        CHECK(first_mismatch(got[static_cast<std::size_t>(r)], make_input<T>(root, count)) == -1);
      }
    }
  }
}

TEMPLATE_TEST_CASE("LocalComm all_to_all and all_to_all_v transpose chunks", "[unit][comm]",
                   COMM_TYPES) {
  using T = TestType;
  constexpr std::size_t count = 3;
  for (int n = 1; n <= 8; ++n) {
    const auto un = static_cast<std::size_t>(n);
    // Rank r's chunk for rank q holds input_value(r, q*count + i).
    auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
      auto send = make_input<T>(comm.rank(), count * un);
      std::vector<T> recv(count * un);
      comm.all_to_all(std::span<const T>(send), std::span<T>(recv));
      return recv;
    });
    for (int r = 0; r < n; ++r) {
      std::vector<T> want;
      for (int q = 0; q < n; ++q) {
        auto chunk = make_input<T>(q, count, static_cast<std::size_t>(r) * count);
        append(want, chunk);
      }
      INFO("all_to_all n=" << n << " rank " << r);
      CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want) == -1);
    }
    // Variable: rank s sends (s + d) % 3 elements to rank d, valued s*100 + d (mod 256 for u8).
    auto sent = [](int s, int d) { return static_cast<std::size_t>((s + d) % 3); };
    auto value = [](int s, int d) { return convert<T>(static_cast<double>((s * 10 + d) % 60)); };
    auto got_v = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
      const int me = comm.rank();
      std::vector<std::size_t> send_counts(un), recv_counts(un);
      std::vector<T> send;
      for (int d = 0; d < n; ++d) {
        send_counts[static_cast<std::size_t>(d)] = sent(me, d);
        recv_counts[static_cast<std::size_t>(d)] = sent(d, me);
        send.insert(send.end(), sent(me, d), value(me, d));
      }
      std::vector<T> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}));
      comm.all_to_all_v(std::span<const T>(send), std::span<const std::size_t>(send_counts),
                        std::span<T>(recv), std::span<const std::size_t>(recv_counts));
      return recv;
    });
    for (int r = 0; r < n; ++r) {
      std::vector<T> want;
      for (int s = 0; s < n; ++s) want.insert(want.end(), sent(s, r), value(s, r));
      INFO("all_to_all_v n=" << n << " rank " << r);
      CHECK(first_mismatch(got_v[static_cast<std::size_t>(r)], want) == -1);
    }
  }
}

TEMPLATE_TEST_CASE("LocalComm async ops give the blocking results", "[unit][comm]", COMM_TYPES) {
  using T = TestType;
  constexpr std::size_t count = 9;
  for (int n : {1, 3, 4}) {
    const auto un = static_cast<std::size_t>(n);
    auto got = per_rank<std::vector<T>>(n, [&](LocalComm& comm) {
      auto a = make_input<T>(comm.rank(), count);
      std::vector<T> reduced(count), scattered(count), gathered(count * un), alltoall(count * un);
      auto big = make_input<T>(comm.rank(), count * un);
      auto w1 = comm.all_reduce_async(std::span<const T>(a), std::span<T>(reduced), ReduceOp::sum);
      auto w2 = comm.reduce_scatter_async(std::span<const T>(big), std::span<T>(scattered),
                                          ReduceOp::max);
      auto w3 = comm.all_gather_async(std::span<const T>(a), std::span<T>(gathered));
      auto w4 = comm.all_to_all_async(std::span<const T>(big), std::span<T>(alltoall));
      auto w5 = comm.barrier_async();
      w5.wait();
      w1.wait();
      w2.wait();
      w3.wait();
      w4.wait();
      std::vector<T> out = reduced;
      append(out, scattered);
      append(out, gathered);
      append(out, alltoall);
      return out;
    });
    for (int r = 0; r < n; ++r) {
      std::vector<T> want;
      for (std::size_t i = 0; i < count; ++i)
        want.push_back(expected_reduction<T>(ReduceOp::sum, n, i));
      for (std::size_t i = 0; i < count; ++i) {
        want.push_back(
            expected_reduction<T>(ReduceOp::max, n, static_cast<std::size_t>(r) * count + i));
      }
      for (int q = 0; q < n; ++q) {
        auto c = make_input<T>(q, count);
        append(want, c);
      }
      for (int q = 0; q < n; ++q) {
        auto c = make_input<T>(q, count, static_cast<std::size_t>(r) * count);
        append(want, c);
      }
      INFO("n=" << n << " rank " << r);
      CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want) == -1);
    }
  }
}

TEST_CASE("LocalComm async all_reduce returns before the peers join, so compute overlaps",
          "[unit][comm]") {
  // Rank 1 joins only after rank 0 has issued the op, seen it pending and finished computing:
  // if the async call blocked, rank 0 would time out instead.
  std::latch rank0_computed(1);
  struct Result {
    bool pending_after_issue = false;
    double compute = 0;
    float reduced = 0;
  };
  auto got = per_rank<Result>(
      2,
      [&](LocalComm& comm) {
        Result res;
        std::vector<float> buf(1 << 16, static_cast<float>(comm.rank() + 1));
        if (comm.rank() == 0) {
          auto work = comm.all_reduce_async(std::span<const float>(buf), std::span<float>(buf),
                                            ReduceOp::sum);
          res.pending_after_issue = !work.test();
          for (int i = 1; i <= 1000; ++i) res.compute += 1.0 / i;  // the overlapped compute
          rank0_computed.count_down();
          work.wait();
        } else {
          rank0_computed.wait();
          comm.all_reduce(std::span<float>(buf), ReduceOp::sum);
        }
        res.reduced = buf[123];
        return res;
      },
      CommOptions{.timeout_s = 20});
  CHECK(got[0].pending_after_issue);
  CHECK(got[0].compute > 7.48);
  CHECK(got[0].reduced == 3.0f);
  CHECK(got[1].reduced == 3.0f);
}

TEST_CASE("LocalComm send/recv and grouped exchanges", "[unit][comm]") {
  for (int n = 2; n <= 8; ++n) {
    // Ring: everyone sends to the right and receives from the left inside one group, so the
    // order within the group does not matter.
    auto got = per_rank<std::vector<std::int64_t>>(n, [&](LocalComm& comm) {
      const int right = (comm.rank() + 1) % n, left = (comm.rank() + n - 1) % n;
      std::vector<std::int64_t> out{comm.rank() * 10, comm.rank() * 10 + 1}, in(2), in2(2);
      comm.group_start();
      comm.recv(std::span<std::int64_t>(in), left, 7);
      comm.send(std::span<const std::int64_t>(out), right, 7);
      comm.group_end();
      // Plain send then recv: sends are eager, so this cannot deadlock either.
      comm.send(std::span<const std::int64_t>(out), left, 8);
      comm.recv(std::span<std::int64_t>(in2), right, 8);
      auto w = comm.send_async(std::span<const std::int64_t>(out), right, 9);
      std::vector<std::int64_t> in3(2);
      auto w2 = comm.recv_async(std::span<std::int64_t>(in3), left, 9);
      w.wait();
      w2.wait();
      append(in, in2);
      append(in, in3);
      return in;
    });
    for (int r = 0; r < n; ++r) {
      const std::int64_t left = (r + n - 1) % n, right = (r + 1) % n;
      CHECK(got[static_cast<std::size_t>(r)] ==
            std::vector<std::int64_t>{left * 10, left * 10 + 1, right * 10, right * 10 + 1,
                                      left * 10, left * 10 + 1});
    }
  }
}

TEST_CASE("LocalComm: a grouped receive that fails, with receives after it, breaks the group",
          "[unit][comm]") {
  // The first failing receive skipped the rest of the group and the ranks went on: the skipped
  // messages stayed queued for later receives of the same tags. Now the group is broken, so
  // every later op fails at once, a receive whose message is already queued included (tag 2
  // is sent first, so it is queued before the grouped receive of tag 1 fails).
  const auto errors = per_rank<std::vector<std::string>>(
      2,
      [](LocalComm& comm) {
        std::vector<std::string> seen;
        const auto attempt = [&](auto&& op) {
          try {
            op();
            seen.emplace_back();
          } catch (const CommError& e) {
            seen.emplace_back(e.what());
          }
        };
        std::vector<float> a(4, 1.0f), b(4, 2.0f), wrong(3), in(4);
        if (comm.rank() == 1) {
          attempt([&] {
            comm.send(std::span<const float>(b), 0, 2);
            comm.send(std::span<const float>(a), 0, 1);
          });
        } else {
          attempt([&] {
            comm.group_start();
            comm.recv(std::span<float>(wrong), 1, 1);  // 3 elements: the sender sent 4
            comm.recv(std::span<float>(in), 1, 2);
            comm.group_end();
          });
        }
        attempt([&] { comm.barrier(); });  // the next step's collective
        if (comm.rank() == 0) attempt([&] { comm.recv(std::span<float>(in), 1, 2); });
        return seen;
      },
      CommOptions{.timeout_s = 5});
  CHECK(errors[1][0].empty());  // sends are eager
  CHECK_THAT(errors[0][0], Catch::Contains("rank 1 sent 4 elements"));
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK_THAT(errors[static_cast<std::size_t>(r)][1],
               Catch::Contains("a grouped receive failed with 1 receives of its group not taken"));
  }
  REQUIRE(errors[0].size() == 3);
  CHECK_THAT(errors[0][2],
             Catch::Contains("a grouped receive failed with 1 receives of its group not taken"));
}

TEST_CASE("LocalComm split builds ordered sub-groups, undefined color gives a null comm",
          "[unit][comm]") {
  const int n = 8;
  struct Result {
    int sub_rank, sub_size;
    std::vector<int> members;
    bool null_comm;
    std::vector<int> nested;
  };
  auto got = per_rank<Result>(n, [&](LocalComm& comm) {
    Result res{};
    // Even and odd ranks, ordered by descending world rank (key = -rank).
    auto sub = comm.split(comm.rank() % 2, -comm.rank(), "parity");
    res.sub_rank = sub.rank();
    res.sub_size = sub.size();
    std::vector<int> mine{comm.rank()};
    res.members.resize(static_cast<std::size_t>(sub.size()));
    sub.all_gather(std::span<const int>(mine), std::span<int>(res.members));
    auto none = comm.split(comm.rank() < 3 ? 0 : undefined_color, 0);
    res.null_comm = none.is_null();
    if (!none.is_null()) none.barrier();
    // A split of a split: pairs inside each parity group.
    auto pair = sub.split(sub.rank() / 2, sub.rank());
    res.nested.resize(2);
    pair.all_gather(std::span<const int>(mine), std::span<int>(res.nested));
    return res;
  });
  CHECK(got[0].members == std::vector<int>{6, 4, 2, 0});
  CHECK(got[1].members == std::vector<int>{7, 5, 3, 1});
  CHECK(got[6].sub_rank == 0);
  CHECK(got[0].sub_rank == 3);
  CHECK(got[5].sub_size == 4);
  for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)].null_comm == (r >= 3));
  CHECK(got[0].nested == std::vector<int>{2, 0});
  CHECK(got[6].nested == std::vector<int>{6, 4});
  CHECK(got[3].nested == std::vector<int>{3, 1});
}

TEST_CASE("LocalComm reductions are in rank order, so runs are bitwise reproducible",
          "[unit][comm]") {
  const int n = 5;
  constexpr std::size_t count = 10007;
  auto inputs = [](int rank) {
    std::mt19937 gen(static_cast<unsigned>(1234 + rank));
    std::normal_distribution<float> dist(0.0f, 1e3f);
    std::vector<float> v(count);
    for (auto& x : v) x = dist(gen);
    return v;
  };
  auto once = [&] {
    return per_rank<std::vector<float>>(n, [&](LocalComm& comm) {
      auto v = inputs(comm.rank());
      comm.all_reduce(std::span<float>(v), ReduceOp::sum);
      return v;
    });
  };
  auto a = once(), b = once();
  std::vector<float> serial = inputs(0);
  for (int r = 1; r < n; ++r) {
    auto v = inputs(r);
    for (std::size_t i = 0; i < count; ++i) serial[i] += v[i];
  }
  for (int r = 0; r < n; ++r) {
    CHECK(first_mismatch(a[static_cast<std::size_t>(r)], b[static_cast<std::size_t>(r)]) == -1);
    CHECK(first_mismatch(a[static_cast<std::size_t>(r)], serial) == -1);
  }
}

TEST_CASE("LocalComm sums bf16 and f16 in fp32 and rounds once", "[unit][comm]") {
  // 256 + 7 * 1: fp32 accumulation gives 263, which rounds to 264 in bf16; rounding after every
  // rank would stay at 256 (256 + 1 ties to even at 256).
  auto got = per_rank<float>(8, [](LocalComm& comm) {
    std::vector<bf16> v{bf16(comm.rank() == 0 ? 256.0f : 1.0f)};
    comm.all_reduce(std::span<bf16>(v), ReduceOp::sum);
    return static_cast<float>(v[0]);
  });
  for (float x : got) CHECK(x == 264.0f);
  // f16: 2048 + 7 * 1 = 2055 -> 2056 (f16 spacing is 2 above 2048).
  auto got16 = per_rank<float>(8, [](LocalComm& comm) {
    std::vector<f16> v{f16(comm.rank() == 0 ? 2048.0f : 1.0f)};
    comm.all_reduce(std::span<f16>(v), ReduceOp::sum);
    return static_cast<float>(v[0]);
  });
  for (float x : got16) CHECK(x == 2056.0f);
}

TEST_CASE("Negative control: a wrong closed form is caught by the comparison", "[unit][comm]") {
  const int n = 4;
  constexpr std::size_t count = 8;
  auto got = per_rank<std::vector<float>>(n, [&](LocalComm& comm) {
    auto v = make_input<float>(comm.rank(), count);
    comm.all_reduce(std::span<float>(v), ReduceOp::sum);
    return v;
  });
  std::vector<float> right(count), missing_rank(count), doubled_rank(count);
  for (std::size_t i = 0; i < count; ++i) {
    right[i] = expected_reduction<float>(ReduceOp::sum, n, i);
    missing_rank[i] = expected_reduction<float>(ReduceOp::sum, n - 1, i);  // a dropped rank
    doubled_rank[i] = right[i] + static_cast<float>(input_value(0, i));    // rank 0 twice
  }
  CHECK(first_mismatch(got[0], right) == -1);
  CHECK(first_mismatch(got[0], missing_rank) == 0);
  CHECK(first_mismatch(got[0], doubled_rank) == 0);
}

namespace {

/// What one rank's CountingMover saw.
struct MoverTally {
  int begins = 0, ends = 0;
  std::size_t copied = 0, folded = 0, to_host = 0, from_host = 0;  // bytes, elements, bytes
};

/// HostMover with a tally of every move, so a test can tell that BasicLocalComm moves each
/// byte through its mover (a plain memcpy beside it would be missing from the tally, and would
/// crash on device memory in CudaLocalComm).
class CountingMover : public HostMover {
 public:
  static constexpr std::string_view comm_name = "CountingLocalComm";
  using HostMover::HostMover;
  void begin(const parallel::detail::OpContext&, CommClock::time_point) { ++tally.begins; }
  void copy(void* dst, const void* src, std::size_t bytes) {
    tally.copied += bytes;
    HostMover::copy(dst, src, bytes);
  }
  template <class T>
  void reduce(ReduceOp op, const T* const* in, int ranks, std::size_t count, T* const* out,
              int n_out) {
    tally.folded += count * static_cast<std::size_t>(n_out);
    HostMover::reduce<T>(op, in, ranks, count, out, n_out);
  }
  void end(const parallel::detail::OpContext&, CommClock::time_point) { ++tally.ends; }
  void to_host(void* dst, const void* src, std::size_t bytes,
               const parallel::detail::OpContext& ctx, CommClock::time_point deadline) {
    tally.to_host += bytes;
    HostMover::to_host(dst, src, bytes, ctx, deadline);
  }
  void from_host(void* dst, const void* src, std::size_t bytes,
                 const parallel::detail::OpContext& ctx, CommClock::time_point deadline) {
    tally.from_host += bytes;
    HostMover::from_host(dst, src, bytes, ctx, deadline);
  }

  MoverTally tally;
};

/// One rank's outputs of one of each collective and a send/recv pair, concatenated, and its
/// mover's tally (empty on LocalComm).
struct EveryOp {
  std::vector<float> values;
  MoverTally tally;
};

constexpr std::size_t every_op_count = 10;  // uneven all_reduce chunks over 3 ranks: 3, 3, 4

template <class Comm>
EveryOp run_every_op(Comm& comm) {
  constexpr std::size_t count = every_op_count;
  const int me = comm.rank();
  const auto n = static_cast<std::size_t>(comm.size());
  const auto in = make_input<float>(me, count), wide = make_input<float>(me, n * count);
  std::vector<float> out(count), scattered(count), gathered(n * count), transposed(n * count);
  comm.all_reduce(std::span<const float>(in), std::span<float>(out), ReduceOp::sum);
  comm.reduce_scatter(std::span<const float>(wide), std::span<float>(scattered), ReduceOp::max);
  comm.all_gather(std::span<const float>(in), std::span<float>(gathered));
  std::vector<float> mine = in;
  comm.broadcast(std::span<float>(mine), 1);
  comm.all_to_all(std::span<const float>(wide), std::span<float>(transposed));
  if (me == 0) comm.send(std::span<const float>(in), 2, 7);
  if (me == 2) comm.recv(std::span<float>(mine), 0, 7);
  EveryOp result;
  for (const auto* part : {&out, &scattered, &gathered, &mine, &transposed}) {
    result.values.insert(result.values.end(), part->begin(), part->end());
  }
  if constexpr (requires { comm.mover().tally; }) result.tally = comm.mover().tally;
  return result;
}

}  // namespace

TEST_CASE("BasicLocalComm moves every byte through its mover and names it in errors",
          "[unit][comm]") {
  using CountingComm = BasicLocalComm<CountingMover>;
  static_assert(Communicator<CountingComm>);
  constexpr int n = 3;
  constexpr std::size_t count = every_op_count;
  auto got = per_rank<EveryOp, CountingComm>(n, [](CountingComm& c) { return run_every_op(c); });
  auto want = per_rank<EveryOp>(n, [](LocalComm& c) { return run_every_op(c); });
  // Each rank folded its own share (its all_reduce chunk into n outputs, its reduce_scatter
  // output) and copied its own outputs: all_gather's n chunks, broadcast's buffer off the root,
  // all_to_all's n chunks; the send went to the host mailbox and the receive came from it.
  const std::size_t f = sizeof(float);
  const std::size_t chunk[n] = {3, 3, 4};
  for (int r = 0; r < n; ++r) {
    const EveryOp& g = got[static_cast<std::size_t>(r)];
    INFO("rank " << r);
    CHECK(first_mismatch(g.values, want[static_cast<std::size_t>(r)].values) == -1);
    CHECK(g.tally.begins == 5);  // five collectives; send and recv are not rendezvous
    CHECK(g.tally.ends == 5);
    CHECK(g.tally.folded == chunk[r] * n + count);
    const std::size_t bcast = r == 1 ? 0 : count * f;
    CHECK(g.tally.copied == n * count * f + bcast + n * count * f);
    CHECK(g.tally.to_host == (r == 0 ? count * f : 0));
    CHECK(g.tally.from_host == (r == 2 ? count * f : 0));
  }
  // Errors carry the mover's name.
  auto messages = per_rank<std::string, CountingComm>(2, [](CountingComm& comm) {
    return zero::testing::thrown_message([&] {
      std::vector<float> v(static_cast<std::size_t>(comm.rank()) + 1);
      comm.all_reduce(std::span<float>(v), ReduceOp::sum);
    });
  });
  CHECK_THAT(messages[0], Catch::Contains("CountingLocalComm: all_reduce #0"));
  CHECK_THAT(messages[0], Catch::Contains("mismatched buffers"));
}

namespace {

/// What GateMover's held fold waits on, shared by one test's ranks.
struct Gate {
  std::latch in_body{1};
  std::mutex m;
  std::condition_variable cv;
  bool peer_returned = false;  // rank 0 came back from the op
  bool seen_returned = false;  // rank 1's fold, when it finished, saw that
};

/// HostMover whose fold on the rank with role 1 holds until its peer returns from the op, or
/// long enough to tell that the peer does not.
class GateMover : public HostMover {
 public:
  static constexpr std::string_view comm_name = "GateLocalComm";
  using HostMover::HostMover;
  template <class T>
  void reduce(ReduceOp op, const T* const* in, int ranks, std::size_t count, T* const* out,
              int n_out) {
    if (role == 1 && gate != nullptr) {
      gate->in_body.count_down();
      std::unique_lock lock(gate->m);
      gate->cv.wait_for(lock, std::chrono::milliseconds(500), [&] { return gate->peer_returned; });
      gate->seen_returned = gate->peer_returned;
    }
    HostMover::reduce<T>(op, in, ranks, count, out, n_out);
  }

  int role = -1;
  Gate* gate = nullptr;
};

}  // namespace

TEST_CASE("a rank leaves a collective only once its peers have finished with its buffers",
          "[unit][comm]") {
  // World rank 2 fails while rank 1 still folds into rank 0's output of an all-reduce over the
  // group {0, 1}. Rank 0 returned at the world's abort, freeing buffers rank 1 was writing.
  using GateComm = BasicLocalComm<GateMover>;
  Gate gate;
  CHECK_THROWS_WITH(GateComm::run(3,
                                  [&](GateComm& world) {
                                    GateComm pair = world.split(
                                        world.rank() < 2 ? 0 : undefined_color, world.rank());
                                    if (world.rank() == 2) {
                                      gate.in_body.wait();
                                      throw std::runtime_error("rank 2 fails");
                                    }
                                    pair.mover().role = pair.rank();
                                    pair.mover().gate = &gate;
                                    std::vector<float> in(1 << 12, 1.0f), out(in.size());
                                    try {
                                      pair.all_reduce(std::span<const float>(in),
                                                      std::span<float>(out), ReduceOp::sum);
                                    } catch (const CommError&) {
                                    }
                                    if (pair.rank() == 0) {
                                      std::lock_guard lock(gate.m);
                                      gate.peer_returned = true;
                                      gate.cv.notify_all();
                                    }
                                  }),
                    Catch::Contains("rank 2 fails"));
  CHECK_FALSE(gate.seen_returned);
}

TEST_CASE("LocalComm: a u8 average divides by the rank count, not by it wrapped to 8 bits",
          "[unit][comm]") {
  // The count was cast to the element type: 0 at 256 ranks (a division by zero) and 1 at 257
  // (the sum returned as the average). NCCL keeps it an int.
  for (const int n : {255, 256, 257}) {
    INFO(n << " ranks");
    const auto got = per_rank<int>(n, [](LocalComm& comm) {
      std::vector<std::uint8_t> v{static_cast<std::uint8_t>(comm.rank() == 0 ? 255 : 0),
                                  static_cast<std::uint8_t>(comm.rank() == 0 ? 254 : 0)};
      comm.all_reduce(std::span<std::uint8_t>(v), ReduceOp::avg);
      return v[0] * 1000 + v[1];
    });
    // 255 / n and 254 / n in integer division: 1 and 0 at 255 ranks, 0 and 0 above.
    CHECK(got[0] == (n == 255 ? 1000 : 0));
    CHECK(got[static_cast<std::size_t>(n - 1)] == got[0]);
  }
}

TEST_CASE(
    "Text collectives: every rank gets every rank's string in rank order, empty ones too, the "
    "root's broadcast and the first non-empty one",
    "[unit][comm]") {
  const std::vector<std::string> sent = {"", "a", "hello, stages", ""};
  struct Seen {
    std::vector<std::string> gathered;
    std::string from_root, first;
  };
  const auto got = per_rank<Seen>(4, [&](LocalComm& comm) {
    const std::string& mine = sent[static_cast<std::size_t>(comm.rank())];
    return Seen{zero::parallel::all_gather_text(comm, mine),
                zero::parallel::broadcast_text(comm, mine, 2),
                zero::parallel::first_nonempty_text(comm, mine)};
  });
  for (const Seen& g : got) {
    CHECK(g.gathered == sent);
    CHECK(g.from_root == "hello, stages");
    CHECK(g.first == "a");  // rank 1's: rank 0 sent nothing, rank 2 came later
  }
  // All empty: no bytes to gather or broadcast.
  const auto none = per_rank<Seen>(2, [](LocalComm& comm) {
    return Seen{zero::parallel::all_gather_text(comm, ""),
                zero::parallel::broadcast_text(comm, "", 0),
                zero::parallel::first_nonempty_text(comm, "")};
  });
  for (const Seen& g : none) {
    CHECK(g.gathered == std::vector<std::string>{"", ""});
    CHECK(g.from_root.empty());
    CHECK(g.first.empty());
  }
}
