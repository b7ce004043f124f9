// A built-in optimizer on a device (no offload), through the device seam on a machine without a
// GPU: a device tag whose backend is the host's plus a fused executor (the recording executor,
// which runs the passes on the host's scalar path and refuses any pointer the backend did not
// make). The engine must move each optimizer's states into the backend's buffers and hand every
// pass to the executor: after several steps the parameters equal those of the host engine bit
// for bit (f32 and bf16, stages 0-3, 1 and 2 ranks, accumulation 2, clipping; SGD with momentum
// and Adagrad with a non-zero initial accumulator too), every element of every shard went
// through the executor once per step, memory_report() counts the states where the host engine
// does and the optimizers hold none of their own. LAMB, whose norms are summed on the host, is a
// ConfigError. The tag's memory counts as a device's (DeviceKind::cuda), so a checkpoint must
// stage the master slices and states through the backend's host copies: a run saved after two
// steps and resumed in a fresh engine takes the third step exactly as the run that went on. The
// global norm waits for the device once a step: every unit's sum of squares goes into its slot
// in the device's memory (sum_of_squares_into) and none comes back alone (sum_of_squares).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <filesystem>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/engine/engine.hpp>

#include "../support/per_rank.hpp"
#include "../support/recording_executor.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::RecordingExecutor;
using zero::testing::thrown_message;

// A device whose memory is what its backend's make_buffer made (host memory that the engine must
// treat as a device's), and whose optimizer passes run on the recording executor.
struct ExecutorTestDevice {};
struct ExecutorTestMemory : Host {
  static constexpr DeviceKind kind = DeviceKind::cuda;
};

struct ExecutorTestBackend : engine::HostBackend {
  using Device = ExecutorTestMemory;
  template <class E>
  void copy_to_host(std::span<E> dst, std::span<const E> src) {
    if (fail_copies_down) throw std::runtime_error("a copy down failed");
    ++copies;
    ++copies_down_here;
    HostBackend::copy_to_host(dst, src);
  }
  template <class E>
  void copy_from_host(std::span<E> dst, std::span<const E> src) {
    ++copies;
    HostBackend::copy_from_host(dst, src);
  }
  static inline std::atomic<int> copies = 0;
  static inline thread_local int copies_down_here = 0;       // this rank's (thread's) copies down
  static inline thread_local bool fail_copies_down = false;  // this rank's copies down throw

  template <class E>
  double sum_of_squares(std::span<const E> v) {
    ++waiting_sums;
    return HostBackend::sum_of_squares(v);
  }
  template <class E>
  void sum_of_squares_into(std::span<double> slot, std::span<const E> v) {
    ++slot_sums;
    HostBackend::sum_of_squares_into(slot, v);
  }
  static inline std::atomic<int> waiting_sums = 0, slot_sums = 0;

  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    DeviceBuffer<E> b = HostBackend::make_buffer<E>(n);
    const std::lock_guard lock(mutex);
    made.emplace_back(reinterpret_cast<const char*>(b.data()), b.bytes());
    return b;
  }
  const optim::FusedExecutor* fused_executor() const { return &executor; }

  // Every buffer make_buffer handed out in the current run (ranks are threads).
  static bool owns(const void* p) {
    const std::lock_guard lock(mutex);
    const auto* c = static_cast<const char*>(p);
    return std::any_of(made.begin(), made.end(),
                       [&](const auto& b) { return c >= b.first && c < b.first + b.second; });
  }
  static void reset() {
    made.clear();
    executor.elements = 0;
    waiting_sums = 0;
    slot_sums = 0;
  }
  static inline std::mutex mutex;
  static inline std::vector<std::pair<const char*, std::size_t>> made;
  static inline RecordingExecutor executor{&ExecutorTestBackend::owns};
};

template <>
struct zero::engine::backend_for<ExecutorTestDevice> {
  using type = ExecutorTestBackend;
};

namespace {

constexpr int steps = 3;
constexpr int accumulation = 2;

struct Run {
  std::vector<std::vector<float>> units;
  engine::MemoryReport report;
  std::size_t optimizer_numel = 0;      // elements the optimizers update per step
  std::size_t optimizer_own_bytes = 0;  // state the optimizers keep themselves
};

template <class Eng>
Run train(LocalComm& comm, const Config& config) {
  Run out;
  out.units = train_tiny_gpt<Eng>(comm, config, steps, accumulation, [&](Eng& eng) {
    out.report = eng.memory_report();
    for (int u = 0; u < eng.num_units(); ++u) {
      out.optimizer_numel += eng.optimizer(u).numel();
      out.optimizer_own_bytes += eng.optimizer(u).state_bytes();
    }
  });
  return out;
}

template <class T, int S>
void check_device_optimizer(const Config& config, std::initializer_list<int> worlds) {
  using HostEngine = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>>;
  using DeviceEngine =
      engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Compute<ExecutorTestDevice>>;
  static_assert(DeviceEngine::device_optimizer && !HostEngine::device_optimizer);
  static_assert(!DeviceEngine::host_reads_states && HostEngine::host_reads_states);
  for (int world : worlds) {
    INFO("stage " << S << (std::is_same_v<T, zero::bf16> ? " bf16 " : " f32 ")
                  << config.optimizer->type << " world " << world);
    const auto host =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<HostEngine>(comm, config); });
    ExecutorTestBackend::reset();
    const auto device =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<DeviceEngine>(comm, config); });
    std::size_t numel = 0;
    for (int r = 0; r < world; ++r) {
      const Run& h = host[static_cast<std::size_t>(r)];
      const Run& d = device[static_cast<std::size_t>(r)];
      CHECK(d.units == h.units);  // bit for bit
      CHECK(d.report.optimizer_bytes == h.report.optimizer_bytes);
      CHECK(d.report.total() == h.report.total());
      CHECK(h.optimizer_own_bytes == h.report.optimizer_bytes);
      CHECK(d.optimizer_own_bytes == 0);  // the unit's device buffers hold them
      numel += d.optimizer_numel;
    }
    CHECK(ExecutorTestBackend::executor.elements == steps * numel);
    // One slot sum a unit, rank and step; no sum waited for alone.
    CHECK(ExecutorTestBackend::waiting_sums == 0);
    CHECK(ExecutorTestBackend::slot_sums ==
          steps * world * static_cast<int>(device[0].units.size()));
  }
}

Config with_optimizer(Config c, const std::string& json) {
  c.optimizer = Config::from_json_string(R"({"optimizer": )" + json + "}").optimizer;
  return c;
}

}  // namespace

TEST_CASE("A device optimizer: every stage trains as the host engine (f32)", "[unit][engine]") {
  check_device_optimizer<float, 0>(adamw_config(0, accumulation, 0.5), {1, 2});
  check_device_optimizer<float, 1>(adamw_config(1, accumulation, 0.5), {2});
  check_device_optimizer<float, 2>(adamw_config(2, accumulation, 0.5), {2});
  check_device_optimizer<float, 3>(adamw_config(3, accumulation, 0.5), {1, 2});
}

TEST_CASE("A device optimizer: every stage trains as the host engine (bf16)", "[unit][engine]") {
  const auto bf16_config = [](int stage) {
    Config c = adamw_config(stage, accumulation, 0.5);
    c.bf16_enabled = true;
    return c;
  };
  check_device_optimizer<zero::bf16, 0>(bf16_config(0), {2});
  check_device_optimizer<zero::bf16, 1>(bf16_config(1), {1, 2});
  check_device_optimizer<zero::bf16, 2>(bf16_config(2), {2});
  check_device_optimizer<zero::bf16, 3>(bf16_config(3), {2});
}

TEST_CASE("bf16 stage 0 rounds its parameters in the optimizer's pass: the bits of stage 1",
          "[unit][engine]") {
  // Stage 0 keeps whole bf16 parameters beside the fp32 master and has the fused AdamW write
  // them as it updates (FusedIo::write_back); stage 1 gathers them from the updated slices. On
  // the host and through the device seam, at 1 and 2 ranks, the runs agree bit for bit, so a
  // parameter the pass left stale (it would be read by the next step's forward) shows.
  Config c = adamw_config(0, accumulation, 0.5);
  c.bf16_enabled = true;
  Config stage1 = adamw_config(1, accumulation, 0.5);
  stage1.bf16_enabled = true;
  using Stage0 = engine::Engine<nn::GPT<zero::bf16>, ZeroStage<0>, Precision<zero::bf16>>;
  using Stage1 = engine::Engine<nn::GPT<zero::bf16>, ZeroStage<1>, Precision<zero::bf16>>;
  using DeviceStage0 = engine::Engine<nn::GPT<zero::bf16>, ZeroStage<0>, Precision<zero::bf16>,
                                      Compute<ExecutorTestDevice>>;
  for (int world : {1, 2}) {
    INFO("world " << world);
    const auto zero_host =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<Stage0>(comm, c); });
    const auto one =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<Stage1>(comm, stage1); });
    ExecutorTestBackend::reset();
    const auto zero_device =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<DeviceStage0>(comm, c); });
    for (int r = 0; r < world; ++r) {
      const auto k = static_cast<std::size_t>(r);
      CHECK(zero_host[k].units == one[k].units);
      CHECK(zero_device[k].units == one[k].units);
    }
  }
}

TEST_CASE("A device optimizer: states start from the optimizer's initial values",
          "[unit][engine]") {
  // SGD's momentum buffer and Adagrad's accumulator (0.1, not zero) move to the device with
  // the values the optimizer gave them.
  check_device_optimizer<float, 1>(
      with_optimizer(adamw_config(1, accumulation, 0.5),
                     R"({"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}})"),
      {2});
  check_device_optimizer<float, 2>(with_optimizer(adamw_config(2, accumulation, 0.5),
                                                  R"({"type": "Adagrad", "params": {"lr": 0.01,
                          "initial_accumulator_value": 0.1}})"),
                                   {2});
}

TEST_CASE("A device optimizer: LAMB is refused", "[unit][engine]") {
  using DeviceEngine =
      engine::Engine<nn::GPT<float>, ZeroStage<1>, Precision<float>, Compute<ExecutorTestDevice>>;
  const Config config = with_optimizer(adamw_config(1, accumulation, 0.5),
                                       R"({"type": "LAMB", "params": {"lr": 0.01}})");
  const auto message = per_rank<std::string>(1, [&](LocalComm& comm) {
    return thrown_message([&] {
      nn::GPT<float> model(tiny());
      DeviceEngine eng(model, comm, config);
    });
  });
  CHECK_THAT(message[0], Catch::Contains("'LAMB'") && Catch::Contains("Offload<CPU>"));
}

namespace {
template <int Stage>
void check_staged_checkpoint() {
  using DeviceEngine = engine::Engine<nn::GPT<float>, ZeroStage<Stage>, Precision<float>,
                                      Compute<ExecutorTestDevice>>;
  zero::testing::TempDir tmp("device-optimizer-ckpt");
  const Config config = adamw_config(Stage, accumulation, 0.5);
  constexpr int world = 2;
  struct Out {
    std::vector<std::vector<float>> units;
    int save_copies = 0, load_copies = 0, save_copies_down_here = 0;
  };
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  const auto went_on = per_rank<Out>(world, [&](LocalComm& comm) {
    Out out;
    nn::GPT<float> model(tiny());
    DeviceEngine eng(model, comm, config, options);
    train_steps(eng, comm, 0, 2, accumulation);
    // The count is shared by the ranks' threads: each reads its start between two barriers, so
    // no rank has begun its save's copies then (at stage 0 rank 1 copies nothing and, reading
    // its start late, could count none of rank 0's).
    comm.barrier();
    const int before = ExecutorTestBackend::copies;
    const int before_here = ExecutorTestBackend::copies_down_here;
    comm.barrier();
    eng.save_checkpoint(tmp.path(), "two", {});
    out.save_copies_down_here = ExecutorTestBackend::copies_down_here - before_here;
    comm.barrier();
    out.save_copies = ExecutorTestBackend::copies - before;
    out.units = train_steps(eng, comm, 2, 3, accumulation);
    return out;
  });
  const auto resumed = per_rank<Out>(world, [&](LocalComm& comm) {
    Out out;
    nn::GPT<float> model(tiny());
    DeviceEngine eng(model, comm, config, options);
    comm.barrier();
    const int before = ExecutorTestBackend::copies;
    comm.barrier();
    eng.load_checkpoint(tmp.path(), "two");
    comm.barrier();
    out.load_copies = ExecutorTestBackend::copies - before;
    out.units = train_steps(eng, comm, 2, 3, accumulation);
    return out;
  });
  for (int r = 0; r < world; ++r) {
    const Out& a = went_on[static_cast<std::size_t>(r)];
    const Out& b = resumed[static_cast<std::size_t>(r)];
    CHECK(b.units == a.units);  // the master slices and AdamW's states came back bit for bit
    CHECK(a.save_copies > 0);   // down to the host for the save
    CHECK(b.load_copies > 0);   // up from the host after the load
    // Each rank stages what it saves: its shard, or at stage 0 rank 0 the whole units and the
    // other ranks nothing (they used to copy every unit down and drop it).
    if (Stage == 0 && r > 0) {
      CHECK(a.save_copies_down_here == 0);
    } else {
      CHECK(a.save_copies_down_here > 0);
    }
  }
}
}  // namespace

TEST_CASE("A device optimizer: checkpoints stage the states through host copies",
          "[unit][engine]") {
  check_staged_checkpoint<2>();
  check_staged_checkpoint<0>();
}

TEST_CASE("A device optimizer: a save whose staging fails on one rank fails on every rank",
          "[unit][engine]") {
  // Rank 1's copies down throw while it writes its segments (a save streams each unit's staged
  // states into its shard file). Rank 0 must not wait for rank 1 in the save's collectives: both
  // throw, nothing is published, and the next save works.
  using DeviceEngine =
      engine::Engine<nn::GPT<float>, ZeroStage<2>, Precision<float>, Compute<ExecutorTestDevice>>;
  zero::testing::TempDir tmp("device-optimizer-save-fail");
  const auto seen_by = per_rank<std::vector<std::string>>(
      2,
      [&](LocalComm& comm) {
        std::vector<std::string> seen;
        nn::GPT<float> model(tiny());
        engine::EngineOptions options;
        options.activation_bytes = 32 << 20;
        DeviceEngine eng(model, comm, adamw_config(2, accumulation, 0.5), options);
        train_steps(eng, comm, 0, 1, accumulation);
        ExecutorTestBackend::fail_copies_down = comm.rank() == 1;
        seen.push_back(thrown_message([&] { eng.save_checkpoint(tmp.path(), "one", {}); }));
        ExecutorTestBackend::fail_copies_down = false;
        seen.push_back(thrown_message([&] { eng.save_checkpoint(tmp.path(), "two", {}); }));
        return seen;
      },
      parallel::CommOptions{.timeout_s = 20});
  for (const auto& seen : seen_by) {
    REQUIRE(seen.size() == 2);
    CHECK_THAT(seen[0], Catch::Contains("nothing was published") &&
                            Catch::Contains("rank 1: a copy down failed"));
    CHECK(seen[1] == zero::testing::nothing_thrown);
  }
  CHECK_FALSE(std::filesystem::exists(tmp.path() / "one"));
  CHECK(std::filesystem::exists(tmp.path() / "two"));
}

TEST_CASE("A device optimizer: stage 3 at 4 ranks holds about a quarter of stage 0's states",
          "[unit][engine]") {
  // bf16 with AdamW: stage 0 holds 4 + 8 + 4 + 2 + 2 = 20 bytes per parameter (master, states,
  // fp32 accumulator, whole params and grads), stage 3 at rest 16 / 4 = 4 (master, states and
  // gradient shards; no parameters gathered between steps). Padding to whole shards adds a little.
  const auto model_states = [](int stage) {
    Config c = adamw_config(stage, accumulation, 0.5);
    c.bf16_enabled = true;
    const auto run = with_stage(stage, [&]<int S>(std::integral_constant<int, S>) {
      using DeviceEngine = engine::Engine<nn::GPT<zero::bf16>, ZeroStage<S>, Precision<zero::bf16>,
                                          Compute<ExecutorTestDevice>>;
      return per_rank<Run>(4, [&](LocalComm& comm) { return train<DeviceEngine>(comm, c); });
    });
    const engine::MemoryReport& r = run[0].report;
    return static_cast<double>(r.total() - r.scratch_bytes);
  };
  const double ratio = model_states(3) / model_states(0);
  INFO("stage 3 / stage 0 model states at 4 ranks: " << ratio);
  CHECK(ratio >= 0.15);
  CHECK(ratio <= 0.3);
}
