// Offload<CPU> (ZeRO-Offload) through the device seam, on a machine without a GPU: a device tag
// whose backend is the host's except that its pinned buffers are a type of their own, which only
// make_pinned_buffer can construct. An engine that put an offloaded master or gradient shard in
// device memory (or made a pinned buffer any other way) would not compile. After several steps
// the parameters equal those of the same run without offload, bit for bit (f32 and bf16, stages
// 1-3, 1 and 2 ranks, accumulation 2, clipping); memory_report() puts the master (and its bf16
// copy), the states and the gradient shard in host memory and nothing else; the optimizer runs on
// the host only after the host waited for the compute that wrote its gradient, and no pinned
// source of a copy up is written before the host waited for the copy; a step leaves each
// unit's update to the next forward (overlap_offload_update) with the same values; at stages 2-3
// the window's shards summed on the device (accumulate_grads_on_device) give the same values with
// one copy down a unit and window, and the accumulator in device memory; the delayed
// update (delayed_param_update) follows its one-step-late recurrence exactly, starts after its
// warm-up, leaves a checkpoint's save without effect on the run, and is refused where it cannot
// run; under ZeRO++ qgZ it trains as qgZ without offload, bit for bit; with offload_ratio below
// 1 (Twin-Flow) the last units keep their states in device memory, updated on the device's
// executor, the others as above, with the same values, and memory_report() equals the
// estimator's figure (the engine's and the one from the model alone); beside the delayed or
// deferred host update only the offloaded units' update moves (the delayed run follows its mixed
// recurrence exactly, the deferred one the plain run's values); zero::dispatch picks
// Offload<CPU> from the config's offload_optimizer.device for a device engine, and refuses nvme
// there.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/engine/engine.hpp>

#include "../support/per_rank.hpp"
#include "../support/recording_executor.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::per_rank;

// A device whose "pinned host memory" is host memory only its backend's make_pinned_buffer hands
// out, and whose communication stream runs its DMA copies (comm_copy_async) as late as the
// engine allows: only when compute next waits for it. A shard read, or a staging buffer rewritten,
// before that wait sees the wrong values, so the runs below would differ from the plain ones.
// A copy up from pinned memory on the compute stream (copy_async: a gather's source) runs at once
// but keeps the bytes it read: a real device may read them until the host next waits for
// compute, so a source the host wrote before that wait counts in sources_overwritten. Its fused
// executor (the recording executor, which refuses pinned memory) runs the updates of the units
// Offload<CPU> keeps on the device (offload_ratio).
struct PinnedTestDevice {};
struct PinnedTestBackend;

// The pinned buffers alive, by address (ranks run as threads, so guarded).
struct PinnedRanges {
  static inline std::mutex mutex;
  static inline std::map<const std::byte*, std::size_t> ranges;  // begin -> bytes
  static void add(const void* p, std::size_t bytes) {
    if (p == nullptr) return;
    const std::lock_guard lock(mutex);
    ranges[static_cast<const std::byte*>(p)] = bytes;
  }
  static void remove(const void* p) {
    if (p == nullptr) return;
    const std::lock_guard lock(mutex);
    ranges.erase(static_cast<const std::byte*>(p));
  }
  static bool contains(const void* p) {
    const auto* b = static_cast<const std::byte*>(p);
    const std::lock_guard lock(mutex);
    auto it = ranges.upper_bound(b);
    if (it == ranges.begin()) return false;
    --it;
    return b < it->first + it->second;
  }
};

template <class E>
class PinnedTestBuffer : public Buffer<E, Host> {
 public:
  PinnedTestBuffer() = default;
  PinnedTestBuffer(PinnedTestBuffer&&) noexcept = default;
  PinnedTestBuffer& operator=(PinnedTestBuffer&& other) noexcept {
    if (this != &other) PinnedRanges::remove(this->data());
    Buffer<E, Host>::operator=(std::move(other));
    return *this;
  }
  ~PinnedTestBuffer() { PinnedRanges::remove(this->data()); }

 private:
  friend struct PinnedTestBackend;
  explicit PinnedTestBuffer(std::size_t n) : Buffer<E, Host>(n) {
    PinnedRanges::add(this->data(), this->bytes());
  }
};

struct PinnedTestBackend : engine::HostBackend {
  template <class E>
  using PinnedBuffer = PinnedTestBuffer<E>;
  static inline std::atomic<int> pinned_buffers = 0;
  static inline std::atomic<int> host_waits = 0;
  static inline std::atomic<int> comm_copies = 0;
  static inline std::atomic<int> shard_sums = 0;
  static inline std::atomic<int> sources_overwritten = 0;

  template <class E>
  PinnedBuffer<E> make_pinned_buffer(std::size_t n) {
    ++pinned_buffers;
    return PinnedBuffer<E>(n);
  }
  static inline zero::testing::RecordingExecutor executor{
      [](const void* p) { return !PinnedRanges::contains(p); }};
  const optim::FusedExecutor* fused_executor() const { return &executor; }
  void host_waits_for_compute() {
    ++host_waits;
    // Every copy up has run on a real device by now: were their sources left as they read them?
    for (const PinnedRead& r : pinned_reads_) {
      if (!std::equal(r.bytes.begin(), r.bytes.end(), r.source)) ++sources_overwritten;
    }
    pinned_reads_.clear();
    HostBackend::host_waits_for_compute();
  }
  template <class E>
  void copy_async(std::span<E> dst, std::span<const E> src) {
    HostBackend::copy_async(dst, src);
    if (!src.empty() && PinnedRanges::contains(src.data())) {
      const auto* b = reinterpret_cast<const std::byte*>(src.data());
      pinned_reads_.push_back({b, std::vector<std::byte>(b, b + src.size_bytes()), false});
    }
  }
  template <class E>
  void comm_copy_async(std::span<E> dst, std::span<const E> src) {
    ++comm_copies;
    expect<ShapeError>(dst.size() == src.size(), "comm_copy_async: sizes differ");
    on_comm_.push_back([dst, src] { std::copy(src.begin(), src.end(), dst.begin()); });
    // A copy up issued before the comm stream last waited for compute has run before this one
    // writes its source; one issued after has not.
    const auto* d = reinterpret_cast<const std::byte*>(dst.data());
    std::erase_if(pinned_reads_, [&](const PinnedRead& r) {
      const bool overlaps = r.source < d + dst.size_bytes() && d < r.source + r.bytes.size();
      if (overlaps && !r.before_comm) ++sources_overwritten;  // unordered: a real race
      return overlaps;
    });
  }
  void comm_waits_for_compute() {
    for (PinnedRead& r : pinned_reads_) r.before_comm = true;
    HostBackend::comm_waits_for_compute();
  }
  template <class E>
  void sum_of_squares_into(std::span<double> slot, std::span<const E> v) {
    ++shard_sums;
    HostBackend::sum_of_squares_into(slot, v);
  }
  void compute_waits_for_comm() {
    run_copies();
    HostBackend::compute_waits_for_comm();
  }
  void compute_waits_for_comm_copies() {
    run_copies();
    HostBackend::compute_waits_for_comm_copies();
  }

 private:
  void run_copies() {
    for (auto& copy : on_comm_) copy();
    on_comm_.clear();
  }
  std::vector<std::function<void()>> on_comm_;  // the comm stream's copies not yet run
  struct PinnedRead {
    const std::byte* source;
    std::vector<std::byte> bytes;  // what the copy read
    bool before_comm = false;      // the comm stream has since waited for compute
  };
  std::vector<PinnedRead> pinned_reads_;  // copies up the host has not waited for yet
};

template <>
struct zero::engine::backend_for<PinnedTestDevice> {
  using type = PinnedTestBackend;
};

namespace {

constexpr int steps = 3;
constexpr int accumulation = 2;

struct Run {
  std::vector<std::vector<float>> units;  // every unit's values after the steps
  engine::MemoryReport report;
  int num_units = 0;
  int offloaded_units = 0;                   // Offload<CPU>: the units not kept on the device
  std::int64_t kept_elems = 0;               // ... and the shard elements of those kept there
  engine::MemoryEstimate estimate;           // the engine's memory_estimate()
  engine::MemoryEstimate estimate_of_model;  // Offload<CPU>: the estimator's from the model alone
};

template <class Eng>
Run train(LocalComm& comm, const Config& config,
          const engine::EngineOptions& options = tiny_options()) {
  Run out;
  out.units = train_tiny_gpt<Eng>(
      comm, config, steps, accumulation,
      [&](Eng& eng) {
        out.report = eng.memory_report();
        out.num_units = eng.num_units();
        for (int u = 0; u < eng.num_units(); ++u) {
          if (eng.unit_offloaded(u)) {
            ++out.offloaded_units;
          } else {
            out.kept_elems += eng.partition(u).shard_numel();
          }
        }
        out.estimate = eng.memory_estimate();
        if constexpr (Eng::offload_cpu) {
          nn::GPT<typename Eng::T> model(tiny());
          engine::MemoryEstimateInput in = engine::model_estimate_input(
              model, Eng::stage, engine::ShardGroups{.dense = comm.size(), .experts = comm.size()},
              options.with_config(config, comm.size()));
          in.precision = dtype_of<typename Eng::T>;
          in.optimizer_state_bytes = engine::optimizer_state_bytes(*config.optimizer);
          in.offload_optimizer = OffloadDevice::cpu;
          out.estimate_of_model = engine::estimate_model_states(in);
        }
      },
      options);
  return out;
}

Config cpu_offload_config(int stage, bool bf16) {
  Config c = adamw_config(stage, accumulation, 0.5);
  c.bf16_enabled = bf16;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::cpu;
  c.zero_optimization.offload_optimizer.pin_memory = true;
  return c;
}

// Offload<CPU> with offload_ratio below 1 against the plain run: the same values; some units
// kept on the device and some offloaded; the host holds less than under full offload and the
// offloaded units' buffers alone are pinned; the kept units' updates ran on the executor, every
// shard element once a step, the offloaded ones' on the host.
template <bool bf16, int S>
void check_kept_units(const std::vector<Run>& plain, const std::vector<Run>& offloaded,
                      bool on_device) {
  const int world = static_cast<int>(plain.size());
  std::int64_t kept_elems = 0;
  for (int r = 0; r < world; ++r) {
    const Run& p = plain[static_cast<std::size_t>(r)];
    const Run& o = offloaded[static_cast<std::size_t>(r)];
    CHECK(o.units == p.units);  // bit for bit
    CHECK(o.offloaded_units > 0);
    CHECK(o.offloaded_units < o.num_units);
    // Full offload moves the master, its states and the gradient shard (master-sized), and in
    // bf16 adds the master's compute copy (half its bytes).
    const std::size_t full = 2 * p.report.master_bytes + p.report.optimizer_bytes +
                             (bf16 ? p.report.master_bytes / 2 : 0);
    CHECK(o.report.host_bytes > 0);
    CHECK(o.report.host_bytes < full);
    kept_elems += o.kept_elems;
  }
  const int offloaded_units = offloaded[0].offloaded_units;
  CHECK(PinnedTestBackend::pinned_buffers == (bf16 ? 3 : 2) * offloaded_units * world);
  const int copies = steps * offloaded_units * world * (S == 1 || on_device ? 1 : accumulation);
  CHECK(PinnedTestBackend::comm_copies == copies);
  // The offloaded units' sums are taken on their way down, the kept ones' once a step.
  const int kept_units = offloaded[0].num_units - offloaded_units;
  CHECK(PinnedTestBackend::shard_sums == copies + steps * kept_units * world);
  CHECK(PinnedTestBackend::sources_overwritten == 0);
  CHECK(PinnedTestBackend::executor.elements == static_cast<std::size_t>(steps * kept_elems));
}

// on_device: EngineOptions::accumulate_grads_on_device (stages 2-3); ratio:
// EngineOptions::offload_ratio (below 1: check_kept_units checks the units kept on the device
// instead of the memory and copy counts of full offload).
template <class T, int S>
void check_cpu_offload(bool on_device = false, double ratio = 1.0) {
  constexpr bool bf16 = std::is_same_v<T, zero::bf16>;
  using Plain = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>>;
  using Offloaded = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  for (int world : {1, 2}) {
    INFO("stage " << S << (bf16 ? " bf16" : " f32") << " world " << world
                  << (on_device ? " accumulating on the device" : "") << " offload_ratio "
                  << ratio);
    Config plain_config = adamw_config(S, accumulation, 0.5);
    plain_config.bf16_enabled = bf16;
    const auto plain =
        per_rank<Run>(world, [&](LocalComm& comm) { return train<Plain>(comm, plain_config); });
    PinnedTestBackend::pinned_buffers = 0;
    PinnedTestBackend::host_waits = 0;
    PinnedTestBackend::comm_copies = 0;
    PinnedTestBackend::shard_sums = 0;
    PinnedTestBackend::sources_overwritten = 0;
    PinnedTestBackend::executor.elements = 0;
    engine::EngineOptions options = tiny_options();
    options.accumulate_grads_on_device = on_device;
    options.offload_ratio = ratio;
    const auto offloaded = per_rank<Run>(world, [&](LocalComm& comm) {
      return train<Offloaded>(comm, cpu_offload_config(S, bf16), options);
    });
    for (const Run& o : offloaded) {
      // The estimator counts what the engine holds at rest, from the engine and from the model.
      CHECK(static_cast<double>(o.report.total() - o.report.scratch_bytes) ==
            o.estimate.device_at_rest + o.estimate.host);
      CHECK(static_cast<double>(o.report.host_bytes) == o.estimate.host);
      CHECK(o.estimate_of_model.host == o.estimate.host);
      CHECK(o.estimate_of_model.device_at_rest == o.estimate.device_at_rest);
    }
    if (ratio < 1.0) {
      check_kept_units<bf16, S>(plain, offloaded, on_device);
      continue;
    }
    CHECK(PinnedTestBackend::executor.elements == 0);
    for (int r = 0; r < world; ++r) {
      const Run& p = plain[static_cast<std::size_t>(r)];
      const Run& o = offloaded[static_cast<std::size_t>(r)];
      CHECK(o.units == p.units);  // bit for bit
      // The master slice, its optimizer states, the gradient shard (a master-sized fp32 slice)
      // and, in bf16, the slice's bf16 copy (half the master's bytes, counted with it) are in
      // host memory, and nothing else is: the device holds what the run without offload holds
      // beside them (scratch aside: a gather copies the pinned values into a device scratch,
      // where the plain f32 run reads the slice itself).
      const std::size_t copy_bytes = bf16 ? p.report.master_bytes / 2 : 0;
      const auto moved = [](const engine::MemoryReport& m) {
        return 2 * m.master_bytes + m.optimizer_bytes;
      };
      CHECK(p.report.host_bytes == 0);
      CHECK(o.report.master_bytes == p.report.master_bytes + copy_bytes);
      CHECK(o.report.optimizer_bytes == p.report.optimizer_bytes);
      CHECK(o.report.host_bytes == moved(p.report) + copy_bytes);
      // On the device, accumulate_grads_on_device adds an fp32 shard, the size of the gradient
      // shard the run without offload holds there (its grad_accumulator_bytes at stages 2-3).
      const std::size_t accumulator = on_device ? p.report.grad_accumulator_bytes : 0;
      CHECK(o.report.device_bytes() - o.report.scratch_bytes ==
            p.report.total() - p.report.scratch_bytes - moved(p.report) + accumulator);
    }
    // Two pinned buffers per unit and rank (master and gradient shard), three in bf16 (its
    // compute copy); one host wait per step and rank before the optimizer reads what the device
    // wrote, and in bf16 one per unit and rank before the host first rounds the initial master
    // into the compute copy (the updates write it after that).
    const int units = offloaded[0].num_units;
    CHECK(PinnedTestBackend::pinned_buffers == (bf16 ? 3 : 2) * units * world);
    CHECK(PinnedTestBackend::host_waits == (steps + (bf16 ? units : 0)) * world);
    // Each unit's reduced shard reaches its pinned shard by DMA copies: one a window at stage 1
    // (the reduction at the boundary), one a micro-step at stages 2-3 (every fold, through the
    // staging buffer; a later micro-step's copies the pinned shard up first), one a window there
    // too when the window's folds sum on the device. Each copy's source is summed on the way for
    // the norm; the runs above equal the plain ones (clipping included) only if the last sum of
    // each window is the one the norm takes.
    const int copies = steps * units * world * (S == 1 || on_device ? 1 : accumulation);
    CHECK(PinnedTestBackend::comm_copies == copies);
    CHECK(PinnedTestBackend::shard_sums == copies);
    // No pinned source of a copy up (a gather's slice, a shard added to) was written before the
    // host waited for the copy.
    CHECK(PinnedTestBackend::sources_overwritten == 0);
  }
}

}  // namespace

TEST_CASE("Offload<CPU> trains as without offload, with its states in host memory (stage 1)",
          "[unit][engine][offload]") {
  check_cpu_offload<float, 1>();
  check_cpu_offload<bf16, 1>();
}
TEST_CASE("Offload<CPU> trains as without offload, with its states in host memory (stage 2)",
          "[unit][engine][offload]") {
  check_cpu_offload<float, 2>();
  check_cpu_offload<bf16, 2>();
}
TEST_CASE("Offload<CPU> trains as without offload, with its states in host memory (stage 3)",
          "[unit][engine][offload]") {
  check_cpu_offload<float, 3>();
  check_cpu_offload<bf16, 3>();
}
TEST_CASE("Offload<CPU> summing a window's gradient shards on the device trains as without offload",
          "[unit][engine][offload]") {
  check_cpu_offload<float, 2>(/*on_device=*/true);
  check_cpu_offload<bf16, 2>(/*on_device=*/true);
  check_cpu_offload<float, 3>(/*on_device=*/true);
  check_cpu_offload<bf16, 3>(/*on_device=*/true);
}

TEST_CASE(
    "Offload<CPU> with offload_ratio keeps the last units on the device, with the same values",
    "[unit][engine][offload]") {
  for (const double ratio : {0.5, 0.8}) {
    check_cpu_offload<float, 1>(false, ratio);
    check_cpu_offload<bf16, 1>(false, ratio);
    check_cpu_offload<float, 2>(false, ratio);
    check_cpu_offload<bf16, 2>(true, ratio);
    check_cpu_offload<float, 3>(true, ratio);
    check_cpu_offload<bf16, 3>(false, ratio);
  }
}

TEST_CASE("offload_ratio is refused where it cannot keep units on the device",
          "[unit][engine][offload]") {
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  using Plain = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>>;
  LocalComm::run(1, [](LocalComm& comm) {
    const auto refused = [&](const Config& config, auto make, double ratio, auto&& change,
                             const char* why) {
      INFO("offload_ratio " << ratio << ": " << why);
      engine::EngineOptions options = tiny_options();
      options.offload_ratio = ratio;
      change(options);
      nn::GPT<bf16> model(tiny());
      CHECK_THAT(testing::thrown_message([&] { make(model, config, options); }),
                 Catch::Contains("offload_ratio") && Catch::Contains(why));
    };
    const auto offloaded = [&](nn::GPT<bf16>& model, const Config& c,
                               const engine::EngineOptions& o) {
      Offloaded eng(model, comm, c, o);
    };
    const auto plain = [&](nn::GPT<bf16>& model, const Config& c, const engine::EngineOptions& o) {
      Plain eng(model, comm, c, o);
    };
    const auto same = [](engine::EngineOptions&) {};
    const Config config = cpu_offload_config(2, true);
    refused(config, offloaded, 0.0, same, "(0, 1]");
    refused(config, offloaded, 1.5, same, "(0, 1]");
    Config none = config;
    none.zero_optimization.offload_optimizer.device = OffloadDevice::none;
    refused(none, plain, 0.5, same, "no Offload<CPU>");
    Config lamb = config;
    lamb.optimizer->type = "LAMB";
    refused(lamb, offloaded, 0.5, same, "'LAMB'");
  });
  // The config's ratio reaches the options where the optimizer is offloaded to the CPU.
  Config c = cpu_offload_config(2, true);
  c.zero_optimization.offload_optimizer.ratio = 0.25;
  CHECK(engine::EngineOptions{}.with_config(c, 1).offload_ratio == 0.25);
  c.zero_optimization.offload_optimizer.device = OffloadDevice::none;
  CHECK(engine::EngineOptions{}.with_config(c, 1).offload_ratio == 1.0);
  // The config's default (1) leaves an option set in code as it is.
  c = cpu_offload_config(2, true);
  engine::EngineOptions set;
  set.offload_ratio = 0.5;
  CHECK(set.with_config(c, 1).offload_ratio == 0.5);
}

TEST_CASE("Offload<CPU> under ZeRO++ qgZ trains as qgZ without offload, bit for bit",
          "[unit][engine][offload]") {
  // The quantized all-to-all's mean lands where the reduce-scatter's would, so the folds into
  // the pinned shards (each micro-step, or summed on the device once a window) take it as they
  // take the plain one.
  const auto check = [&]<int S>(std::integral_constant<int, S>) {
    using Plain = engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>>;
    using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Offload<CPU>,
                                     Compute<PinnedTestDevice>>;
    Config plain_config = adamw_config(S, accumulation, 0.5);
    plain_config.bf16_enabled = true;
    engine::EngineOptions options = tiny_options();
    const auto exact = per_rank<Run>(
        2, [&](LocalComm& comm) { return train<Plain>(comm, plain_config, options); });
    options.quantized_gradients = true;
    const auto plain = per_rank<Run>(
        2, [&](LocalComm& comm) { return train<Plain>(comm, plain_config, options); });
    CHECK(plain[0].units != exact[0].units);  // the gradients were quantized
    for (const bool on_device : {false, true}) {
      INFO("stage " << S << (on_device ? ", summed on the device" : ", pinned folds"));
      options.accumulate_grads_on_device = on_device;
      const auto offloaded = per_rank<Run>(2, [&](LocalComm& comm) {
        return train<Offloaded>(comm, cpu_offload_config(S, true), options);
      });
      for (std::size_t r = 0; r < plain.size(); ++r) CHECK(offloaded[r].units == plain[r].units);
    }
  };
  check(std::integral_constant<int, 2>{});
  check(std::integral_constant<int, 3>{});
}

namespace {

// accumulate_grads_on_device beside the other ways of moving the host update (delayed by a step,
// deferred to the next forward): the same values bit for bit as without it, at 2 ranks.
template <int S>
void check_on_device_with_moved_updates() {
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  for (const bool delayed : {true, false}) {
    INFO("stage " << S << (delayed ? " delayed" : " deferred"));
    const auto run = [&](bool on_device) {
      engine::EngineOptions options = tiny_options();
      options.delayed_param_update = delayed;
      options.overlap_offload_update = !delayed;
      options.accumulate_grads_on_device = on_device;
      return per_rank<Run>(2, [&](LocalComm& comm) {
        return train<Offloaded>(comm, cpu_offload_config(S, true), options);
      });
    };
    const auto pinned = run(false), on_device = run(true);
    for (std::size_t r = 0; r < pinned.size(); ++r) CHECK(on_device[r].units == pinned[r].units);
  }
}

}  // namespace

TEST_CASE("summing on the device leaves the delayed and deferred host updates' values as they were",
          "[unit][engine][offload]") {
  check_on_device_with_moved_updates<2>();
  check_on_device_with_moved_updates<3>();
}

namespace {

// offload_ratio beside the host update deferred to the next forward or delayed a step (AdamW, 2
// ranks): the units kept on the device update in step(), on the executor, every step (each of
// their shard elements once a step), and only the offloaded units' update moves. Deferred, the
// values are the plain run's bit for bit; delayed, they are not (the offloaded units lag a
// step: check_delayed_twin_flow follows that recurrence exactly).
template <class T, int S>
void check_ratio_with_moved_updates() {
  constexpr bool bf16 = std::is_same_v<T, zero::bf16>;
  using Plain = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>>;
  using Offloaded = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  Config plain_config = adamw_config(S, accumulation, 0.5);
  plain_config.bf16_enabled = bf16;
  const auto plain =
      per_rank<Run>(2, [&](LocalComm& comm) { return train<Plain>(comm, plain_config); });
  for (const bool delayed : {false, true}) {
    if (delayed && S == 3 && !bf16) continue;  // refused: a stage-3 gather reads the f32 master
    INFO("stage " << S << (bf16 ? " bf16" : " f32") << (delayed ? " delayed" : " deferred"));
    PinnedTestBackend::executor.elements = 0;
    PinnedTestBackend::sources_overwritten = 0;
    engine::EngineOptions options = tiny_options();
    options.offload_ratio = 0.5;
    options.delayed_param_update = delayed;
    options.overlap_offload_update = !delayed;
    const auto offloaded = per_rank<Run>(2, [&](LocalComm& comm) {
      return train<Offloaded>(comm, cpu_offload_config(S, bf16), options);
    });
    std::int64_t kept_elems = 0;
    for (std::size_t r = 0; r < plain.size(); ++r) {
      const Run& o = offloaded[r];
      CHECK(o.offloaded_units > 0);
      CHECK(o.offloaded_units < o.num_units);
      kept_elems += o.kept_elems;
      CHECK(static_cast<double>(o.report.total() - o.report.scratch_bytes) ==
            o.estimate.device_at_rest + o.estimate.host);
      CHECK(static_cast<double>(o.report.host_bytes) == o.estimate.host);
      CHECK(o.estimate_of_model.host == o.estimate.host);
      if (delayed) {
        CHECK(o.units != plain[r].units);
      } else {
        CHECK(o.units == plain[r].units);  // bit for bit
      }
    }
    CHECK(PinnedTestBackend::executor.elements == static_cast<std::size_t>(steps * kept_elems));
    CHECK(PinnedTestBackend::sources_overwritten == 0);
  }
}

}  // namespace

TEST_CASE(
    "offload_ratio beside the deferred or delayed host update moves only the offloaded units'",
    "[unit][engine][offload]") {
  check_ratio_with_moved_updates<float, 1>();
  check_ratio_with_moved_updates<bf16, 2>();
  check_ratio_with_moved_updates<float, 2>();
  check_ratio_with_moved_updates<bf16, 3>();
}

namespace {

// Two Offload<CPU> engines on one rank, one deferring its units' updates to the next forward
// (overlap_offload_update), one updating every unit in step() (the default): after each step the
// deferring one has every unit left to apply, a forward of the first unit applies what that unit
// needs before its gather (only that at stage 2; stage 3 also the units it prefetches), the rest of
// the forward the others, and losses, parameters and optimizer states stay equal bit for bit;
// reading the state (gather_unit_values, optimizer(u)) right after a step applies what is left
// first. What one rank saw (Catch's checks run on the main thread, after the ranks).
struct DeferredRun {
  int units = 0;
  std::vector<int> after_step, after_first_unit, after_forward;  // deferred_updates()
  int losses_differ = 0;
  int eager_deferred = 0;  // deferred_updates() of the eager engine after its steps
  int left_before_read = 0, left_after_read = 0;
  std::vector<std::vector<float>> values_d, values_e, states_d, states_e;
};

template <int S>
void check_deferred_update() {
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  constexpr int world = 2;
  PinnedTestBackend::sources_overwritten = 0;
  const auto runs = per_rank<DeferredRun>(world, [&](LocalComm& comm) {
    const Config config = cpu_offload_config(S, true);
    engine::EngineOptions deferring = tiny_options();
    deferring.overlap_offload_update = true;
    engine::EngineOptions eager = deferring;
    eager.overlap_offload_update = false;
    nn::GPT<bf16> model_d(tiny()), model_e(tiny());
    Offloaded d(model_d, comm, config, deferring);
    Offloaded e(model_e, comm, config, eager);
    DeferredRun out;
    const int n = out.units = d.num_units();
    for (int step = 0; step < steps; ++step) {
      const GlobalBatch b(micro_rows * accumulation * world, step, tiny().vocab_size);
      for (int m = 0; m < accumulation; ++m) {
        const engine::MicroBatch batch = b.micro(m, comm.rank(), world);
        if (step > 0 && m == 0) {
          out.after_step.push_back(d.deferred_updates());
          const Tensor<bf16> x = d.forward_units({0, 1}, batch);
          out.after_first_unit.push_back(d.deferred_updates());
          d.forward_units({1, n}, batch, x);
        } else {
          d.forward(batch);
        }
        out.after_forward.push_back(d.deferred_updates());
        if (static_cast<float>(d.loss()) != static_cast<float>(e.forward(batch))) {
          ++out.losses_differ;
        }
        d.backward();
        e.backward();
      }
      d.step();
      e.step();
      out.eager_deferred += e.deferred_updates();
    }
    // Reading values or states applies what the last step left.
    out.left_before_read = d.deferred_updates();
    for (int u = 0; u < n; ++u) {
      out.values_d.push_back(d.gather_unit_values(u));
      out.values_e.push_back(e.gather_unit_values(u));
    }
    out.left_after_read = d.deferred_updates();
    for (int u = 0; u < n; ++u) {
      for (const std::string& name : e.optimizer(u).state_names()) {
        const std::span<float> sd = d.optimizer(u).state(name), se = e.optimizer(u).state(name);
        out.states_d.emplace_back(sd.begin(), sd.end());
        out.states_e.emplace_back(se.begin(), se.end());
      }
    }
    return out;
  });
  // A deferred update writes a unit's slice only after the copies up of the last window.
  CHECK(PinnedTestBackend::sources_overwritten == 0);
  for (const DeferredRun& r : runs) {
    INFO("stage " << S);
    const int n = r.units;
    CHECK(r.after_step == std::vector<int>(steps - 1, n));
    for (const int left : r.after_first_unit) {
      // Stage 2 applies unit 0's alone; stage 3's prefetch also those it gathers ahead.
      if constexpr (S == 2) {
        CHECK(left == n - 1);
      } else {
        CHECK(left < n);
      }
    }
    CHECK(r.after_forward == std::vector<int>(steps * accumulation, 0));
    CHECK(r.losses_differ == 0);
    CHECK(r.eager_deferred == 0);
    CHECK(r.left_before_read == n);
    CHECK(r.left_after_read == 0);
    CHECK(r.values_d == r.values_e);  // bit for bit
    CHECK(r.states_d == r.states_e);
    CHECK_FALSE(r.states_d.empty());
  }
}

}  // namespace

TEST_CASE("Offload<CPU> defers each unit's update to the next forward, with the same values",
          "[unit][engine][offload]") {
  check_deferred_update<2>();
  check_deferred_update<3>();
}

namespace {

// The delayed parameter update (delayed_param_update) against the same recurrence through a
// callback (train_delayed): window k of both runs at the same parameters (the losses are equal
// bit for bit), and after n delayed steps and synchronize() the parameters equal the callback's
// after n + 1. The delayed run also waits for its update in the middle of each window
// (synchronize() after the first micro-step), which must not change the window: at stage 3 its
// second micro-step gathers every unit again. A control without any delay must lose that
// equality.
template <class T, int S>
void check_delayed_update() {
  constexpr int run_steps = 4;
  for (int world : {1, 2}) {
    INFO("stage " << S << (std::is_same_v<T, bf16> ? " bf16" : " f32") << " world " << world);
    using Offloaded = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Offload<CPU>,
                                     Compute<PinnedTestDevice>>;
    PinnedTestBackend::sources_overwritten = 0;
    const auto delayed = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::engine, run_steps, accumulation, true);
    });
    // The update in flight writes no slice a copy up may still read (below fp32 it writes the
    // other compute copy; in f32 the copies are waited for first).
    CHECK(PinnedTestBackend::sources_overwritten == 0);
    const auto reference = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::callback, run_steps + 1, accumulation);
    });
    const auto undelayed = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::none, run_steps, accumulation);
    });
    for (int r = 0; r < world; ++r) {
      const DelayedRun& d = delayed[static_cast<std::size_t>(r)];
      const DelayedRun& ref = reference[static_cast<std::size_t>(r)];
      const DelayedRun& none = undelayed[static_cast<std::size_t>(r)];
      const std::vector<float> ref_losses(ref.losses.begin(),
                                          ref.losses.begin() + run_steps * accumulation);
      CHECK(d.losses == ref_losses);  // bit for bit
      CHECK(d.units == ref.units);
      CHECK(none.units != d.units);  // the control: the delay changes the run
      CHECK(d.in_flight_after_step == run_steps);
      CHECK(d.in_flight_after_read == 0);
      CHECK(ref.in_flight_after_step == 0);
      // One fp32 gradient shard more a unit (a master slice's bytes) and, in bf16, one bf16
      // copy more (the master and its copy are 6 bytes an element), in host memory.
      const std::size_t shard_bytes =
          std::is_same_v<T, bf16> ? none.report.master_bytes * 2 / 3 : none.report.master_bytes;
      const std::size_t copy_bytes = std::is_same_v<T, bf16> ? none.report.master_bytes / 3 : 0;
      CHECK(d.report.host_bytes == none.report.host_bytes + shard_bytes + copy_bytes);
      CHECK(d.report.grad_accumulator_bytes == none.report.grad_accumulator_bytes + shard_bytes);
      CHECK(d.report.master_bytes == none.report.master_bytes + copy_bytes);
    }
  }
}

}  // namespace

TEST_CASE("Offload<CPU>'s delayed parameter update applies each step's gradient one step late",
          "[unit][engine][offload]") {
  check_delayed_update<float, 1>();
  check_delayed_update<bf16, 1>();
  check_delayed_update<float, 2>();
  check_delayed_update<bf16, 2>();
  check_delayed_update<bf16, 3>();  // f32 is refused at stage 3 (below)
}

namespace {

// The delayed update with offload_ratio 0.5 (Twin-Flow): the units kept on the device update in
// step() and only the offloaded ones a step late, P_t+1 = update(P_t, grad(P_t)) for the first
// and update(P_t, grad(P_t-1)) for the others, with the forward reading both. The reference is
// the callback delaying only the offloaded units (train_delayed): the losses of every window
// equal bit for bit, and the units after synchronize(). Waiting for the update in the middle of
// a window changes nothing. Two controls: the delayed run without kept units (ratio 1), and the
// callback delaying every unit, must each lose that equality. The kept units have no second
// gradient shard or copy: memory_report() equals the estimator's figure, and the host holds
// less than at ratio 1.
template <class T, int S>
void check_delayed_twin_flow() {
  constexpr int run_steps = 4;
  constexpr double ratio = 0.5;
  for (int world : {1, 2}) {
    INFO("stage " << S << (std::is_same_v<T, bf16> ? " bf16" : " f32") << " world " << world);
    using Offloaded = engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Offload<CPU>,
                                     Compute<PinnedTestDevice>>;
    PinnedTestBackend::sources_overwritten = 0;
    const auto delayed = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::engine, run_steps, accumulation, true, ratio);
    });
    CHECK(PinnedTestBackend::sources_overwritten == 0);
    const auto reference = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::callback, run_steps + 1, accumulation, false,
                                      ratio);
    });
    const auto all_delayed = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::engine, run_steps, accumulation);
    });
    const auto all_late = per_rank<DelayedRun>(world, [&](LocalComm& comm) {
      return train_delayed<Offloaded>(comm, Delay::callback, run_steps + 1, accumulation);
    });
    for (int r = 0; r < world; ++r) {
      const DelayedRun& d = delayed[static_cast<std::size_t>(r)];
      const DelayedRun& ref = reference[static_cast<std::size_t>(r)];
      const std::vector<float> ref_losses(ref.losses.begin(),
                                          ref.losses.begin() + run_steps * accumulation);
      CHECK(d.kept_units > 0);
      CHECK(d.kept_units < static_cast<int>(d.units.size()));
      CHECK(d.losses == ref_losses);  // bit for bit
      CHECK(d.units == ref.units);
      CHECK(all_delayed[static_cast<std::size_t>(r)].units != d.units);
      CHECK(all_late[static_cast<std::size_t>(r)].units != ref.units);
      CHECK(d.in_flight_after_step == run_steps);
      CHECK(d.in_flight_after_read == 0);
      CHECK(static_cast<double>(d.report.total() - d.report.scratch_bytes) ==
            d.estimate.device_at_rest + d.estimate.host);
      CHECK(static_cast<double>(d.report.host_bytes) == d.estimate.host);
      CHECK(d.report.host_bytes < all_delayed[static_cast<std::size_t>(r)].report.host_bytes);
    }
  }
}

}  // namespace

TEST_CASE("Offload<CPU>'s delayed update with offload_ratio delays only the offloaded units",
          "[unit][engine][offload]") {
  check_delayed_twin_flow<float, 1>();
  check_delayed_twin_flow<bf16, 1>();
  check_delayed_twin_flow<float, 2>();
  check_delayed_twin_flow<bf16, 2>();
  check_delayed_twin_flow<bf16, 3>();
}

TEST_CASE("Offload<CPU>'s delayed update starts after its warm-up and leaves checkpoints whole",
          "[unit][engine][offload]") {
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  constexpr int run_steps = 4, warmup = 2;
  const zero::testing::TempDir dir("delayed-update");
  struct Runs {
    std::vector<float> eager, delayed, saving;  // every micro-step's loss
    std::vector<int> in_flight;
    std::vector<std::vector<float>> units_eager, units_delayed, units_saving;
  };
  const auto runs = per_rank<Runs>(2, [&](LocalComm& comm) {
    const Config config = cpu_offload_config(2, true);
    const engine::EngineOptions eager = tiny_options();
    engine::EngineOptions delaying = eager;
    delaying.delayed_param_update = true;
    delaying.delayed_update_after = warmup;
    nn::GPT<bf16> model_e(tiny()), model_d(tiny()), model_s(tiny());
    Offloaded e(model_e, comm, config, eager), d(model_d, comm, config, delaying),
        s(model_s, comm, config, delaying);
    Runs out;
    for (int step = 0; step < run_steps; ++step) {
      const GlobalBatch b(micro_rows * accumulation * 2, step, tiny().vocab_size);
      for (int m = 0; m < accumulation; ++m) {
        const engine::MicroBatch batch = b.micro(m, comm.rank(), 2);
        out.eager.push_back(static_cast<float>(e.forward(batch)));
        out.delayed.push_back(static_cast<float>(d.forward(batch)));
        out.saving.push_back(static_cast<float>(s.forward(batch)));
        e.backward();
        d.backward();
        s.backward();
      }
      e.step();
      d.step();
      s.step();
      out.in_flight.push_back(d.update_in_flight() ? 1 : 0);
      // A save waits for the update in flight and writes it, without changing what the run
      // does next.
      if (step == warmup) s.save_checkpoint(dir.path(), "delayed");
    }
    for (int u = 0; u < d.num_units(); ++u) {
      out.units_eager.push_back(e.gather_unit_values(u));
      out.units_delayed.push_back(d.gather_unit_values(u));
      out.units_saving.push_back(s.gather_unit_values(u));
    }
    return out;
  });
  for (const Runs& r : runs) {
    // Steps 1-2 update in step(); from step 3 on the update runs one step late, so the windows
    // up to the third run at the same parameters, and the fourth at those of two updates
    // (where the eager run has three): the parameters after it differ.
    CHECK(r.in_flight == std::vector<int>{0, 0, 1, 1});
    const auto windows = [](const std::vector<float>& l, int w) {
      return std::vector<float>(l.begin(), l.begin() + w * accumulation);
    };
    CHECK(windows(r.delayed, 3) == windows(r.eager, 3));
    CHECK(r.units_delayed != r.units_eager);
    CHECK(r.saving == r.delayed);
    CHECK(r.units_saving == r.units_delayed);
  }
}

TEST_CASE("an update that fails on its own thread stops the run until a checkpoint is loaded",
          "[unit][engine][offload]") {
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  const zero::testing::TempDir dir("delayed-update-failure");
  LocalComm::run(1, [&](LocalComm& comm) {
    engine::EngineOptions options = tiny_options();
    options.delayed_param_update = true;
    int updates = 0;
    auto failing = [&](int u, std::span<float> param, std::span<const float> grad) {
      if (u == 1 && (++updates == 2 || updates == 4))
        throw std::runtime_error("host update failed");
      for (std::size_t i = 0; i < param.size(); ++i) param[i] -= 0.01F * grad[i];
    };
    nn::GPT<bf16> model(tiny());
    Offloaded eng(model, comm, failing, options);
    const GlobalBatch b(micro_rows, 0, tiny().vocab_size);
    const auto train_step = [&] {
      eng.forward(b.micro(0, 0, 1));
      eng.backward();
      eng.step();
    };
    train_step();  // its update (the first) runs beside the next window
    eng.save_checkpoint(dir.path(), "first");
    train_step();  // waits for the first; the second fails on its thread
    CHECK(eng.update_in_flight());
    CHECK(eng.broken_reason().empty());
    eng.forward(b.micro(0, 0, 1));
    eng.backward();
    CHECK_THROWS_WITH(eng.step(), Catch::Contains("host update failed"));
    CHECK_FALSE(eng.update_in_flight());
    CHECK_THAT(eng.broken_reason(), Catch::Contains("host update failed"));
    CHECK_THROWS_WITH(eng.forward(b.micro(0, 0, 1)), Catch::Contains("inconsistent"));
    eng.load_checkpoint(dir.path(), "first");
    CHECK(eng.broken_reason().empty());
    train_step();  // the run goes on from the checkpoint
    CHECK(eng.update_in_flight());
    // The fourth update fails too, and a load is the first call to wait for it: the load is
    // the way back, so it goes on (it used to rethrow and load nothing).
    train_step();
    CHECK(eng.update_in_flight());
    eng.load_checkpoint(dir.path(), "first");
    CHECK_FALSE(eng.update_in_flight());
    CHECK(eng.broken_reason().empty());
    train_step();
    CHECK(eng.update_in_flight());
    eng.synchronize();
    CHECK(eng.broken_reason().empty());
  });
}

namespace {

// Builds a bf16 stage-2 engine without offload under options: what it threw (the refusal of
// an option that only Offload<CPU> has).
std::string refused_without_offload(LocalComm& comm, nn::GPT<bf16>& model,
                                    const engine::EngineOptions& options) {
  Config plain = cpu_offload_config(2, true);
  plain.zero_optimization.offload_optimizer.device = OffloadDevice::none;
  return testing::thrown_message([&] {
    engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>> eng(model, comm, plain, options);
  });
}

}  // namespace

TEST_CASE("delayed_param_update is refused where it cannot delay the update",
          "[unit][engine][offload]") {
  LocalComm::run(1, [](LocalComm& comm) {
    engine::EngineOptions options = tiny_options();
    options.delayed_param_update = true;
    nn::GPT<bf16> model(tiny());
    // In f32 a stage-3 gather reads the master slice the update writes.
    using Stage3 = engine::Engine<nn::GPT<float>, ZeroStage<3>, Precision<float>, Offload<CPU>,
                                  Compute<PinnedTestDevice>>;
    nn::GPT<float> model_f32(tiny());
    CHECK_THROWS_WITH(Stage3(model_f32, comm, cpu_offload_config(3, false), options),
                      Catch::Contains("stage 3 below fp32, not stage 3 in f32"));
    CHECK_THAT(refused_without_offload(comm, model, options), Catch::Contains("Offload<CPU>"));
    using Stage2 = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>, Offload<CPU>,
                                  Compute<PinnedTestDevice>>;
    engine::EngineOptions both = options;
    both.overlap_offload_update = true;
    CHECK_THROWS_WITH(Stage2(model, comm, cpu_offload_config(2, true), both),
                      Catch::Contains("overlap_offload_update"));
    engine::EngineOptions negative = options;
    negative.delayed_update_after = -1;
    CHECK_THROWS_WITH(Stage2(model, comm, cpu_offload_config(2, true), negative),
                      Catch::Contains("must not be negative"));
  });
}

TEST_CASE(
    "Offload<CPU> with LAMB over shards trains as without offload, and moving its update out of "
    "step() is refused",
    "[unit][engine][offload]") {
  // LAMB sums each whole tensor's norms over the shard group between its passes: in step(), on
  // the thread that drives the communicators. A delayed update (its own thread) or a deferred
  // one (inside the next forward) would issue those sums beside the exchange's ops.
  using Plain = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>>;
  using Offloaded = engine::Engine<nn::GPT<bf16>, ZeroStage<2>, Precision<bf16>, Offload<CPU>,
                                   Compute<PinnedTestDevice>>;
  const auto lamb = [](Config c) {
    c.optimizer->type = "LAMB";  // AdamW's lr, betas, eps and weight_decay are LAMB's too
    return c;
  };
  Config plain_config = lamb(adamw_config(2, accumulation, 0.5));
  plain_config.bf16_enabled = true;
  const Config offload_config = lamb(cpu_offload_config(2, true));
  struct Seen {
    Run plain, offloaded;
    std::string delayed, deferred;
  };
  const auto seen = per_rank<Seen>(2, [&](LocalComm& comm) {
    Seen out;
    out.plain = train<Plain>(comm, plain_config);
    out.offloaded = train<Offloaded>(comm, offload_config);
    nn::GPT<bf16> model(tiny());
    engine::EngineOptions delayed = tiny_options(), deferred = tiny_options();
    delayed.delayed_param_update = true;
    deferred.overlap_offload_update = true;
    out.delayed =
        testing::thrown_message([&] { Offloaded eng(model, comm, offload_config, delayed); });
    out.deferred =
        testing::thrown_message([&] { Offloaded eng(model, comm, offload_config, deferred); });
    return out;
  });
  for (const Seen& s : seen) {
    CHECK(s.offloaded.units == s.plain.units);  // bit for bit
    CHECK_THAT(s.delayed, Catch::Contains("LAMB over ZeRO shards") &&
                              Catch::Contains("delayed_param_update does not allow"));
    CHECK_THAT(s.deferred, Catch::Contains("overlap_offload_update does not allow"));
  }
  // On one rank nothing is summed, and the delayed update is LAMB's to use.
  LocalComm::run(1, [&](LocalComm& comm) {
    nn::GPT<bf16> model(tiny());
    engine::EngineOptions delayed = tiny_options();
    delayed.delayed_param_update = true;
    CHECK(testing::thrown_message([&] { Offloaded eng(model, comm, offload_config, delayed); }) ==
          testing::nothing_thrown);
  });
}

TEST_CASE("accumulate_grads_on_device is refused where there is nothing to sum on the device",
          "[unit][engine][offload]") {
  LocalComm::run(1, [](LocalComm& comm) {
    engine::EngineOptions options = tiny_options();
    options.accumulate_grads_on_device = true;
    nn::GPT<bf16> model(tiny());
    using Stage1 = engine::Engine<nn::GPT<bf16>, ZeroStage<1>, Precision<bf16>, Offload<CPU>,
                                  Compute<PinnedTestDevice>>;
    CHECK_THROWS_WITH(Stage1(model, comm, cpu_offload_config(1, true), options),
                      Catch::Contains("stage 1 sums its whole gradient there already"));
    CHECK_THAT(refused_without_offload(comm, model, options),
               Catch::Contains("stage 2 without Offload<CPU>"));
  });
}

TEST_CASE("zero::dispatch picks Offload<CPU> for a device engine from offload_optimizer.device",
          "[unit][engine][offload]") {
  const auto offload_of = [](const Config& config) {
    return zero::dispatch<nn::GPT<bf16>, Precision<bf16>, Compute<PinnedTestDevice>>(
        config, []<class E>(std::type_identity<E>) {
          return std::string(name_of(offload_device_of<typename E::policies::offload>));
        });
  };
  Config config = cpu_offload_config(2, true);
  CHECK(offload_of(config) == "cpu");
  config.zero_optimization.offload_optimizer.device = OffloadDevice::none;
  CHECK(offload_of(config) == "none");
  // offload_param alone moves the master slice, which is where the parameters rest (stage 3).
  Config params_only = cpu_offload_config(3, true);
  params_only.zero_optimization.offload_optimizer.device = OffloadDevice::none;
  params_only.zero_optimization.offload_param.device = OffloadDevice::cpu;
  CHECK(offload_of(params_only) == "cpu");
  // Stage 0 keeps whole states on every rank: nothing is partitioned to offload.
  Config stage0 = cpu_offload_config(0, true);
  CHECK_THROWS_WITH(offload_of(stage0), Catch::Contains("0 cannot offload"));
  // NVMe swaps host states: a device engine refuses it instead of swapping device memory.
  Config nvme = cpu_offload_config(2, true);
  nvme.zero_optimization.offload_optimizer.device = OffloadDevice::nvme;
  CHECK_THROWS_WITH(offload_of(nvme), Catch::Contains("nvme") && Catch::Contains("cpu"));
}
