// Collective bandwidth, reported as nccl-tests does (algbw = S/t, busbw = algbw * factor), one
// JSON object per line, each beside a baseline measured in the same run:
//   LocalComm: STREAM triad bandwidth with as many threads as ranks; the line gives the memory
//              traffic the collective caused (each byte read or written once) as a fraction.
//   MpiComm:   the raw MPI call (MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather) on the
//              same buffers; the line gives zero's time / raw time.
//
//   ./comm_bench [--ranks 2,4] [--min-bytes 1024] [--max-bytes 67108864] [--step 4]
//   mpiexec -n 4 ./comm_bench --backend mpi [--max-bytes ...]
// Under an MPI launcher (mpirun, mpiexec, srun with several tasks) the backend is mpi by default.
// Each size S is rounded down to whole floats on every rank (a multiple of 4 * ranks bytes), so
// that reduce_scatter and all_gather split it evenly and the bytes printed are the bytes moved.
// Times are the mean per op over the timed iterations, maximum over ranks (the slowest rank
// bounds a training step); MPI lines take the better of two alternating runs of each. Elements
// are f32 (all ones), reduction sum; "wrong" counts ranks whose result was off.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <parallel/comm/comm_op.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/launch_env.hpp>
#if defined(ZERO_WITH_MPI)
#include <parallel/comm/mpi_comm.hpp>
#endif

#include "../bench_flags.hpp"

namespace {

using zero::parallel::CommOp;
using zero::parallel::LocalComm;
using zero::parallel::ReduceOp;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string backend;  // "local" or "mpi"
  std::vector<int> ranks{2, 4};
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = 64ull << 20;
  std::size_t step = 4;
  bool ranks_given = false;  // --ranks, which only LocalComm's thread ranks can follow
};

/// "mpi" when an MPI launcher started this process, as train_gpt decides
/// (parallel::launched_by_mpi: OpenMPI, MPICH/Hydra, or one of several srun tasks), else "local".
std::string default_backend() {
  try {
    return zero::parallel::launched_by_mpi(zero::parallel::launch_env()) ? "mpi" : "local";
  } catch (const zero::Error& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    std::exit(2);
  }
}

Options parse(int argc, char** argv) {
  Options o;
  o.backend = default_backend();
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "comm_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--backend") {
      static const char* const backends[] = {"local", "mpi"};
      o.backend =
          backends[zero::bench::choice_arg("comm_bench", std::string(a), next(), {"local", "mpi"})];
    } else if (a == "--min-bytes")
      o.min_bytes =
          static_cast<std::size_t>(zero::bench::integer_arg("comm_bench", std::string(a), next()));
    else if (a == "--max-bytes")
      o.max_bytes =
          static_cast<std::size_t>(zero::bench::integer_arg("comm_bench", std::string(a), next()));
    else if (a == "--step")
      o.step = static_cast<std::size_t>(
          zero::bench::integer_arg("comm_bench", std::string(a), next(), 2));
    else if (a == "--ranks") {
      o.ranks_given = true;
      o.ranks.clear();
      std::string list = next();
      for (std::size_t p = 0; p < list.size();) {
        const auto comma = list.find(',', p);
        o.ranks.push_back(static_cast<int>(zero::bench::integer_arg(
            "comm_bench", "--ranks", list.substr(p, comma - p).c_str(), 1, 4096)));
        p = comma == std::string::npos ? list.size() : comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: comm_bench [--backend local|mpi] [--ranks 2,4] [--min-bytes N] "
                   "[--max-bytes N] [--step K]\n");
      std::exit(2);
    }
  }
  if (o.backend == "mpi" && o.ranks_given) {
    std::fprintf(stderr,
                 "comm_bench: --ranks sets LocalComm's thread ranks; with the MPI backend the "
                 "ranks are the launcher's processes (mpiexec -n N), so leave --ranks out\n");
    std::exit(2);
  }
  return o;
}

/// Timed iterations for S bytes: enough to amortise the clock, few for the big sizes.
int iterations(std::size_t bytes) {
  return static_cast<int>(
      std::clamp<std::size_t>((256ull << 20) / std::max<std::size_t>(bytes, 1), 5, 200));
}

constexpr CommOp ops[] = {CommOp::all_reduce, CommOp::reduce_scatter, CommOp::all_gather};

/// Every send element is 1, so every recv element must be n (reductions) or 1 (all_gather);
/// returns 1 when the first or last element is off (nccl-tests' #wrong, sampled).
int wrong_result(CommOp op, const std::vector<float>& recv, int n) {
  const float want = op == CommOp::all_gather ? 1.0f : static_cast<float>(n);
  return recv.front() != want || recv.back() != want;
}

/// bytes rounded down to whole floats on each of n ranks (0 when less than one float each).
std::size_t whole_bytes(std::size_t bytes, int n) {
  const std::size_t unit = sizeof(float) * static_cast<std::size_t>(n);
  return bytes / unit * unit;
}

/// Floats per rank in the send buffer and the recv buffer for op when S = bytes.
std::pair<std::size_t, std::size_t> buffer_elems(CommOp op, std::size_t bytes, int n) {
  const std::size_t total = bytes / sizeof(float), un = static_cast<std::size_t>(n);
  switch (op) {
    case CommOp::reduce_scatter:
      return {total, total / un};
    case CommOp::all_gather:
      return {total / un, total};
    default:
      return {total, total};
  }
}

/// Memory traffic of op on LocalComm over all ranks, in multiples of S: all_reduce and
/// all_gather read and write every rank's S once (2n); reduce_scatter reads every rank's S and
/// writes S/n per rank (n + 1).
double traffic_factor(CommOp op, int n) {
  return op == CommOp::reduce_scatter ? n + 1.0 : 2.0 * n;
}

/// Results printed with a wrong count above 0 (main then exits 1).
int wrong_results = 0;

/// One JSON line; "config" and "value" (the time, us) are the benchmarks' convention, which
/// scripts/bench-compare.py reads.
void print(CommOp op, const char* backend, int n, std::size_t bytes, double seconds,
           const char* baseline_key, double baseline, const char* extra_key, double extra,
           int wrong) {
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  const std::string name(zero::parallel::name_of(op));
  std::printf(
      "{\"bench\":\"comm\",\"config\":{\"op\":\"%s\",\"backend\":\"%s\",\"ranks\":%d,"
      "\"bytes\":%zu},\"value\":%.2f,"
      "\"unit\":\"us\",\"op\":\"%s\",\"backend\":\"%s\",\"ranks\":%d,\"bytes\":%zu,"
      "\"time_us\":%.2f,\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f,\"%s\":%.3f,\"%s\":%.3f,"
      "\"wrong\":%d}\n",
      name.c_str(), backend, n, bytes, seconds * 1e6, name.c_str(), backend, n, bytes,
      seconds * 1e6, algbw, algbw * zero::parallel::bus_factor(op, n), baseline_key, baseline,
      extra_key, extra, wrong);
  std::fflush(stdout);
  if (wrong > 0) ++wrong_results;
}

// ---- STREAM triad baseline -------------------------------------------------------------------

/// Best-of-5 triad a = b + 3c bandwidth in GB/s with threads threads on arrays far beyond the
/// caches (24 bytes per element: two reads and one write, STREAM's count).
double stream_triad_gbps(int threads) {
  const std::size_t n = 16ull << 20;  // 3 x 128 MiB
  // Not value-initialised: the pages stay untouched until the threads below first write them.
  const auto a = std::make_unique_for_overwrite<double[]>(n);
  const auto b = std::make_unique_for_overwrite<double[]>(n);
  const auto c = std::make_unique_for_overwrite<double[]>(n);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::latch start(threads + 1);
    std::vector<std::thread> pool;
    Clock::time_point t0;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const std::size_t lo = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
        const std::size_t hi =
            n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
        if (rep == 0) {  // first touch by the thread that uses the pages
          for (std::size_t i = lo; i < hi; ++i) b[i] = 1.0, c[i] = 2.0, a[i] = 0.0;
        }
        start.arrive_and_wait();
        for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0 * c[i];
      });
    }
    start.arrive_and_wait();
    t0 = Clock::now();
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (rep > 0) best = std::max(best, 24.0 * static_cast<double>(n) / s / 1e9);
  }
  if (a[n / 2] != 7.0) std::fprintf(stderr, "stream check failed\n");
  return best;
}

// ---- LocalComm ---------------------------------------------------------------------------------

void bench_local(const Options& o) {
  for (int n : o.ranks) {
    const double stream = stream_triad_gbps(n);
    for (CommOp op : ops) {
      for (std::size_t size = o.min_bytes; size <= o.max_bytes; size *= o.step) {
        const std::size_t bytes = whole_bytes(size, n);
        if (bytes == 0) continue;
        const auto [send_elems, recv_elems] = buffer_elems(op, bytes, n);
        const int iters = iterations(bytes);
        std::vector<double> seconds(static_cast<std::size_t>(n));
        std::vector<int> wrong(static_cast<std::size_t>(n));
        LocalComm::run(n, [&](LocalComm& comm) {
          std::vector<float> send(send_elems, 1.0f), recv(recv_elems, 0.0f);  // first touch here
          auto run_once = [&] {
            if (op == CommOp::all_reduce) {
              comm.all_reduce(std::span<const float>(send), std::span<float>(recv), ReduceOp::sum);
            } else if (op == CommOp::reduce_scatter) {
              comm.reduce_scatter(std::span<const float>(send), std::span<float>(recv),
                                  ReduceOp::sum);
            } else {
              comm.all_gather(std::span<const float>(send), std::span<float>(recv));
            }
          };
          run_once();  // warm-up
          comm.barrier();
          const auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) run_once();
          comm.barrier();
          seconds[static_cast<std::size_t>(comm.rank())] =
              std::chrono::duration<double>(Clock::now() - t0).count() / iters;
          wrong[static_cast<std::size_t>(comm.rank())] = wrong_result(op, recv, n);
        });
        const double t = *std::max_element(seconds.begin(), seconds.end());
        const double mem_gbps = traffic_factor(op, n) * static_cast<double>(bytes) / t / 1e9;
        print(op, "local", n, bytes, t, "stream_gbps", stream, "fraction_of_stream",
              mem_gbps / stream, std::accumulate(wrong.begin(), wrong.end(), 0));
      }
    }
  }
}

// ---- MpiComm -----------------------------------------------------------------------------------

#if defined(ZERO_WITH_MPI)
void bench_mpi(const Options& o, int& argc, char**& argv) {
  auto world = zero::parallel::MpiComm::world(argc, argv);
  const int n = world.size();
  const MPI_Comm raw = world.native_handle();
  for (CommOp op : ops) {
    for (std::size_t size = o.min_bytes; size <= o.max_bytes; size *= o.step) {
      const std::size_t bytes = whole_bytes(size, n);
      if (bytes == 0) continue;
      const auto [send_elems, recv_elems] = buffer_elems(op, bytes, n);
      std::vector<float> send(send_elems, 1.0f), recv(recv_elems, 0.0f);
      const int iters = iterations(bytes);
      auto zero_once = [&] {
        if (op == CommOp::all_reduce) {
          world.all_reduce(std::span<const float>(send), std::span<float>(recv), ReduceOp::sum);
        } else if (op == CommOp::reduce_scatter) {
          world.reduce_scatter(std::span<const float>(send), std::span<float>(recv), ReduceOp::sum);
        } else {
          world.all_gather(std::span<const float>(send), std::span<float>(recv));
        }
      };
      auto raw_once = [&] {
        const int rc = static_cast<int>(recv_elems), sc = static_cast<int>(send_elems);
        if (op == CommOp::all_reduce) {
          MPI_Allreduce(send.data(), recv.data(), sc, MPI_FLOAT, MPI_SUM, raw);
        } else if (op == CommOp::reduce_scatter) {
          MPI_Reduce_scatter_block(send.data(), recv.data(), rc, MPI_FLOAT, MPI_SUM, raw);
        } else {
          MPI_Allgather(send.data(), sc, MPI_FLOAT, recv.data(), sc, MPI_FLOAT, raw);
        }
      };
      auto timed = [&](auto&& once) {
        once();
        MPI_Barrier(raw);
        const auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) once();
        double t = std::chrono::duration<double>(Clock::now() - t0).count() / iters, worst = 0;
        MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, raw);
        return worst;
      };
      // Alternate so that drift on a shared machine hits both alike.
      const double t_raw1 = timed(raw_once), t_zero1 = timed(zero_once);
      const double t_raw2 = timed(raw_once), t_zero2 = timed(zero_once);
      const double t_zero = std::min(t_zero1, t_zero2), t_raw = std::min(t_raw1, t_raw2);
      zero_once();  // the last op checked is zero's
      int wrong = wrong_result(op, recv, n), wrong_total = 0;
      MPI_Allreduce(&wrong, &wrong_total, 1, MPI_INT, MPI_SUM, raw);
      if (world.rank() == 0) {
        print(op, "mpi", n, bytes, t_zero, "raw_mpi_time_us", t_raw * 1e6, "time_ratio_vs_raw",
              t_zero / t_raw, wrong_total);
      }
    }
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.backend == "mpi") {
#if defined(ZERO_WITH_MPI)
    bench_mpi(o, argc, argv);
    return wrong_results > 0 ? 1 : 0;
#else
    std::fprintf(stderr, "comm_bench: built without MPI\n");
    return 1;
#endif
  }
  bench_local(o);
  if (wrong_results > 0) {
    std::fprintf(stderr, "comm_bench: %d results were wrong\n", wrong_results);
    return 1;
  }
  return 0;
}
