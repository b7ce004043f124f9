// The Engine 2 seams on LocalComm: stage slices equal the whole model (f64, stages 0-3, 1 and
// 2 ranks, accumulation 1 and 2, three split points) with a negative control and the order
// rules; process groups on a 2x2 (tp x dp) grid train each dp group as one process would, with
// traffic on the dp groups only; the policy set does not depend on the order of the tags; the
// engine calls its backend's kernels on the backend object (a recording backend).
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/engine/engine.hpp>

#include "../nn/recording_kernels.hpp"
#include "../parallel/comm_test_util.hpp"
#include "../support/recording_executor.hpp"
#include "seam_checks.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::parallel::testing::per_rank;

namespace {

constexpr int steps = 2;

template <int S>
void check_slices() {
  const int n = static_cast<int>(tiny().num_layers) + 2;
  for (int world : {1, 2}) {
    for (int accumulation : {1, 2}) {
      const auto want = reference_sgd(micro_rows * accumulation * world, steps, 1.0);
      for (int split : {1, 2, n - 1}) {
        INFO("stage " << S << " world " << world << " accumulation " << accumulation << " split "
                      << split);
        const auto errors = per_rank<double>(world, [&](LocalComm& comm) {
          return sliced_error<S>(comm, accumulation, steps, split, want);
        });
        CHECK(*std::max_element(errors.begin(), errors.end()) < 1e-12);
      }
    }
  }
}

}  // namespace

TEST_CASE("stage slices equal the whole model at stage 0", "[unit][engine][slices]") {
  check_slices<0>();
}
TEST_CASE("stage slices equal the whole model at stage 1", "[unit][engine][slices]") {
  check_slices<1>();
}
TEST_CASE("stage slices equal the whole model at stage 2", "[unit][engine][slices]") {
  check_slices<2>();
}
TEST_CASE("stage slices equal the whole model at stage 3", "[unit][engine][slices]") {
  check_slices<3>();
}

TEST_CASE("a wrong activation handed between slices is caught (negative control)",
          "[unit][engine][slices]") {
  const auto want = reference_sgd(micro_rows * 2, steps, 1.0);
  const auto errors = per_rank<double>(2, [&](LocalComm& comm) {
    return sliced_error<3>(comm, 1, steps, 2, want, /*perturb=*/1e-3);
  });
  CHECK(*std::max_element(errors.begin(), errors.end()) > 1e-9);
}

TEST_CASE("slices must run in order", "[unit][engine][slices]") {
  const auto messages = per_rank<std::vector<std::string>>(1, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    engine::Engine<nn::GPT<double>, ZeroStage<2>> eng(model, comm, sgd_lr1, seam_options(1));
    const GlobalBatch b(micro_rows, 0, tiny().vocab_size);
    const engine::MicroBatch mb = b.micro(0, 0, 1);
    std::vector<std::string> seen;
    auto attempt = [&](auto&& fn) {
      try {
        fn();
        seen.push_back("no error");
      } catch (const Error& e) {
        seen.push_back(e.what());
      }
    };
    const int n = eng.num_units();
    attempt([&] { eng.forward_units({1, n}, mb); });  // does not start at unit 0
    attempt([&] { eng.forward_units({0, 0}, mb); });  // empty
    attempt([&] { eng.backward_units({0, n}); });     // before any forward
    eng.forward_units({0, 2}, mb);
    attempt([&] { eng.forward_units({3, n}, mb); });  // skips unit 2
    attempt([&] { eng.backward_units({0, 2}); });     // forward not finished
    eng.forward_units({2, n}, mb);
    attempt([&] { eng.backward_units({0, 2}); });  // not from the top
    eng.backward_units({2, n});
    eng.backward_units({0, 2});
    eng.step();
    attempt([&] { eng.forward(mb); });  // in order again: fine
    return seen;
  });
  const auto& seen = messages[0];
  REQUIRE(seen.size() == 7);
  CHECK_THAT(seen[0], Catch::Contains("do not follow"));
  CHECK_THAT(seen[1], Catch::Contains("not a non-empty range"));
  CHECK_THAT(seen[2], Catch::Contains("forward of every unit must run first"));
  CHECK_THAT(seen[3], Catch::Contains("do not follow the forward run so far (next unit 2)"));
  CHECK_THAT(seen[4], Catch::Contains("forward of every unit must run first"));
  CHECK_THAT(seen[5], Catch::Contains("do not follow the backward run"));
  CHECK(seen[6] == "no error");
}

TEMPLATE_TEST_CASE_SIG(
    "an engine over each dp group of a 2x2 grid equals the reference and talks on the dp "
    "groups, and on the tp groups only for the gradient-norm statistics",
    "[unit][engine][groups]", ((int S), S), 0, 1, 2, 3) {
  for (int accumulation : {1, 2}) {
    INFO("stage " << S << " accumulation " << accumulation);
    const auto runs = per_rank<GroupRun>(
        4, [&](LocalComm& world) { return grid_run<S>(world, /*tp=*/2, accumulation, steps); });
    for (const GroupRun& r : runs) {
      CHECK(r.error < 1e-10);
      CHECK(r.wrong_reference_error > 1e-3);  // negative control
      // The model replicates over tp (it is not split), so the only tp traffic is the engine's
      // all-reduce of the norm statistics (two doubles) at each boundary; at construction the
      // engine checks once over all its ranks (tp-dp) that their options agree.
      CHECK(r.groups == std::set<std::string>{"dp", "tp", "tp-dp"});
      CHECK(r.dp_bytes > 0);
      CHECK(r.tp_bytes == static_cast<std::uint64_t>(steps) * 2 * sizeof(double));
    }
  }
}

// Two orders of the same tags resolve to the same policies (and so the same behaviour).
using OneOrder =
    engine::EnginePolicies<nn::GPT<float>, ZeroStage<2>, Precision<f32>, Compute<Host>>;
using OtherOrder =
    engine::EnginePolicies<nn::GPT<float>, Compute<Host>, Precision<f32>, ZeroStage<2>>;
static_assert(OneOrder::stage == OtherOrder::stage);
static_assert(std::is_same_v<OneOrder::precision, OtherOrder::precision>);
static_assert(std::is_same_v<OneOrder::offload, OtherOrder::offload>);
static_assert(std::is_same_v<OneOrder::compute, OtherOrder::compute>);

TEST_CASE("two orders of the policy tags train identically", "[unit][engine]") {
  using A = engine::Engine<nn::GPT<float>, ZeroStage<3>, Precision<f32>>;
  using B = engine::Engine<nn::GPT<float>, Precision<f32>, ZeroStage<3>>;
  const auto results = per_rank<std::vector<std::vector<float>>>(2, [&](LocalComm& comm) {
    std::vector<std::vector<float>> out;
    auto train = [&]<class E>(std::type_identity<E>) {
      nn::GPT<float> model(tiny());
      E eng(model, comm, adamw_config(3, 1, 1.0));
      for (int step = 0; step < 2; ++step) {
        const GlobalBatch b(micro_rows * 2, step, tiny().vocab_size);
        eng.forward(b.micro(0, comm.rank(), 2));
        eng.backward();
        eng.step();
      }
      for (int u = 0; u < eng.num_units(); ++u) out.push_back(eng.gather_unit_values(u));
    };
    train(std::type_identity<A>{});
    train(std::type_identity<B>{});
    return out;
  });
  for (const auto& r : results) {
    const std::size_t half = r.size() / 2;
    for (std::size_t u = 0; u < half; ++u) CHECK(r[u] == r[half + u]);  // bit for bit
  }
}

// A device tag whose backend is the host's with every kernel a member (not static), counting its
// calls: an engine that called a kernel through the type (Backend::accumulate) would not compile,
// and one that skipped the backend would leave a count at zero. A device backend (CudaBackend)
// needs the object: its kernels run on its streams, and its buffers are made on its compute
// stream. So this backend's DeviceBuffer can only be made by its make_buffer: an engine that
// constructed one by size (on the default stream) would not compile either.
struct RecordingDevice {};

struct RecordingBackend;

// Host memory that only RecordingBackend::make_buffer can allocate.
template <class E>
class RecordedBuffer : public Buffer<E, Host> {
 public:
  RecordedBuffer() = default;

 private:
  friend struct RecordingBackend;
  explicit RecordedBuffer(std::size_t n) : Buffer<E, Host>(n) {}
};

struct RecordingBackend : engine::HostBackend {
  template <class E>
  using DeviceBuffer = RecordedBuffer<E>;
  enum Kernel {
    accumulate_k,
    convert_k,
    scale_k,
    clear_k,
    squares_k,
    comm_waits_k,
    compute_waits_k,
    copy_waits_k,
    buffers_k,
    arenas_k,
    to_device_k,
    to_host_k,
    kernels_n
  };
  static inline std::atomic<int> calls[kernels_n] = {};
  // Calls the model's layers made through this backend's kernel sets (all ranks).
  static inline std::atomic<long> layer_calls = 0;

  std::unique_ptr<BumpArena> make_arena(std::size_t bytes, std::string name) {
    ++calls[arenas_k];
    return HostBackend::make_arena(bytes, std::move(name));
  }
  template <class T>
  std::unique_ptr<nn::Kernels<T>> make_layer_kernels() {
    return std::make_unique<test::RecordingKernels<T>>(DeviceKind::host, &layer_calls);
  }

  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    ++calls[buffers_k];
    return DeviceBuffer<E>(n);
  }
  void compute_waits_for_comm() {
    ++calls[compute_waits_k];
    if (in_steps) ++compute_waits_in_steps;
    HostBackend::compute_waits_for_comm();
  }
  void compute_waits_for_comm_copies() {
    ++calls[copy_waits_k];
    HostBackend::compute_waits_for_comm_copies();
  }
  // Set on a rank's thread while it trains (not while it builds the engine or reads the values
  // back), and the whole-stream waits made then (all ranks).
  static inline thread_local bool in_steps = false;
  static inline std::atomic<int> compute_waits_in_steps = 0;

  template <class E>
  void copy_from_host(std::span<E> dst, std::span<const E> src) {
    ++calls[to_device_k];
    HostBackend::copy_from_host(dst, src);
  }
  template <class E>
  void copy_to_host(std::span<E> dst, std::span<const E> src) {
    ++calls[to_host_k];
    HostBackend::copy_to_host(dst, src);
  }

  template <class A, class G>
  void accumulate(std::span<A> acc, std::span<const G> g, double factor = 1.0,
                  engine::Fold fold = engine::Fold::add) {
    ++calls[accumulate_k];
    HostBackend::accumulate(acc, g, factor, fold);
  }
  template <class O, class I>
  void convert_into(std::span<O> out, std::span<const I> in) {
    ++calls[convert_k];
    HostBackend::convert_into(out, in);
  }
  template <class E>
  void scale(std::span<E> v, double factor) {
    ++calls[scale_k];
    HostBackend::scale(v, factor);
  }
  template <class E>
  void clear(std::span<E> v) {
    ++calls[clear_k];
    HostBackend::clear(v);
  }
  template <class E>
  double sum_of_squares(std::span<const E> v) {
    ++calls[squares_k];
    return HostBackend::sum_of_squares(v);
  }
  template <class E>
  void sum_of_squares_into(std::span<double> slot, std::span<const E> v) {
    ++calls[squares_k];
    HostBackend::sum_of_squares_into(slot, v);
  }
  void comm_waits_for_compute() {
    ++calls[comm_waits_k];
    HostBackend::comm_waits_for_compute();
  }
};

template <>
struct zero::engine::backend_for<RecordingDevice> {
  using type = RecordingBackend;
};

namespace {

// Two optimizer steps of a bf16 GPT over f32 masters (accumulation 2, clipping at 0.5) on
// Compute<Device>; the units' masters after them.
template <class Device, int S>
std::vector<std::vector<float>> train_bf16(LocalComm& comm) {
  nn::GPT<bf16> model(tiny());
  Config config = adamw_config(S, 2, 0.5);
  config.bf16_enabled = true;
  engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Compute<Device>> eng(model, comm,
                                                                                    config);
  RecordingBackend::in_steps = true;
  for (int step = 0; step < 2; ++step) {
    const GlobalBatch b(micro_rows * 4, step, tiny().vocab_size);
    for (int m = 0; m < 2; ++m) {
      eng.forward(b.micro(m, comm.rank(), 2));
      eng.backward();
    }
    eng.step();
  }
  eng.synchronize();  // the gathers the last update started
  RecordingBackend::in_steps = false;
  std::vector<std::vector<float>> out;
  for (int u = 0; u < eng.num_units(); ++u) out.push_back(eng.gather_unit_values(u));
  return out;
}

template <int S>
void check_recording_backend() {
  using Masters = std::vector<std::vector<float>>;
  const auto host = per_rank<Masters>(2, [](LocalComm& comm) { return train_bf16<Host, S>(comm); });
  for (auto& c : RecordingBackend::calls) c = 0;
  RecordingBackend::layer_calls = 0;
  RecordingBackend::compute_waits_in_steps = 0;
  const auto recorded =
      per_rank<Masters>(2, [](LocalComm& comm) { return train_bf16<RecordingDevice, S>(comm); });
  INFO("stage " << S);
  CHECK(recorded == host);  // the same kernels, bit for bit
  // Stage 1 folds each micro-step's bf16 gradient into the f32 accumulator, stage 3 adds the
  // reduced gradient into its shard; both round each updated master slice for its gather, take
  // the sum of squares for clipping and order comm after compute. Neither clears an accumulator:
  // each window's first fold starts it (Fold::start). (scale serves expert units and optimizers
  // given as functions: not reached here.)
  CHECK(RecordingBackend::calls[RecordingBackend::accumulate_k] > 0);
  CHECK(RecordingBackend::calls[RecordingBackend::convert_k] > 0);
  CHECK(RecordingBackend::calls[RecordingBackend::clear_k] == 0);
  CHECK(RecordingBackend::calls[RecordingBackend::squares_k] > 0);
  CHECK(RecordingBackend::calls[RecordingBackend::comm_waits_k] > 0);
  // Every buffer came from make_buffer (the type allows nothing else). Every gather and
  // reduction is ordered after compute when it starts, but compute never waits for the whole
  // comm stream while training: a collective's Work completes with its data on the device, and
  // such a wait would hold the units behind the collectives issued since (the next units'
  // reductions, the gathers prefetched ahead). (This communicator reads host memory, so the
  // step's statistics are not staged, which would wait once a step.) No DMA copies are made
  // without Offload<CPU>, so none is waited for.
  CHECK(RecordingBackend::calls[RecordingBackend::buffers_k] > 0);
  CHECK(RecordingBackend::compute_waits_in_steps == 0);
  CHECK(RecordingBackend::calls[RecordingBackend::copy_waits_k] == 0);
  // The units ran on the backend's kernel set, in the backend's activation arenas (one a rank).
  CHECK(RecordingBackend::layer_calls > 0);
  CHECK(RecordingBackend::calls[RecordingBackend::arenas_k] == 2);
  // Initial values went in, and the values read back came out, through the backend's copies.
  CHECK(RecordingBackend::calls[RecordingBackend::to_device_k] > 0);
  CHECK(RecordingBackend::calls[RecordingBackend::to_host_k] > 0);
}

}  // namespace

// A device tag whose backend reports a set amount of free device memory (the host's reports none).
struct SmallDevice {};
/// A host backend that reports a device: the free bytes and the device's identity that the rank
/// thread building the engine set.
struct SmallDeviceBackend : engine::HostBackend {
  static inline thread_local std::size_t free_here = 0;
  static inline thread_local std::uint64_t device_here = 0;
  std::optional<std::size_t> free_device_bytes() const { return free_here; }
  std::uint64_t device_identity() const { return device_here; }
};
template <>
struct zero::engine::backend_for<SmallDevice> {
  using type = SmallDeviceBackend;
};

namespace {

// Builds a bf16 GPT engine at stage S on Compute<SmallDevice> on each of 2 ranks, rank r seeing
// free_of[r] bytes free on device device_of[r]: each rank's error message, empty where
// construction succeeded.
template <int S>
std::vector<std::string> build_on_small_device(std::array<std::size_t, 2> free_of,
                                               std::array<std::uint64_t, 2> device_of = {1, 2}) {
  return per_rank<std::string>(2, [&](LocalComm& comm) -> std::string {
    const auto r = static_cast<std::size_t>(comm.rank());
    SmallDeviceBackend::free_here = free_of[r];
    SmallDeviceBackend::device_here = device_of[r];
    nn::GPT<bf16> model(tiny());
    Config config = adamw_config(S, 1, 1.0);
    config.bf16_enabled = true;
    try {
      engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Compute<SmallDevice>> eng(
          model, comm, config);
      return "";
    } catch (const OutOfMemoryError& e) {
      return e.what();
    }
  });
}

// The estimator's figures for tiny() in bf16 with Adam over 2 ranks: at stage 3 every unit may
// be gathered at once (the default prefetch budget covers this small model), and the default
// 2 pending reductions each hold a unit's gradient.
struct SmallDeviceFigures {
  double stage3 = 0, stage0 = 0;
};
SmallDeviceFigures small_device_figures() {
  nn::GPT<bf16> sizing(tiny());
  engine::MemoryEstimateInput in;
  for (int u = 0; u < sizing.num_units(); ++u) {
    std::int64_t n = 0;
    for (const auto& spec : sizing.unit_params(u)) n += spec.shape.numel();
    in.params += n;
    in.largest_unit_params = std::max(in.largest_unit_params, n);
  }
  in.gpus_per_node = 2;
  in.live_units = sizing.num_units();
  in.pending_reductions = 2;
  SmallDeviceFigures f;
  f.stage3 = engine::estimate_model_states(in).device_peak();
  in.stage = 0;
  in.live_units = 1;
  in.pending_reductions = 0;
  f.stage0 = engine::estimate_model_states(in).device_peak();
  return f;
}

}  // namespace

TEST_CASE("too little device memory for the layout: OutOfMemoryError before allocating",
          "[unit][engine]") {
  const auto [stage3, stage0] = small_device_figures();
  REQUIRE(stage3 < stage0);
  // Far too little: every rank says what the layout needs, what is free, and what to change.
  for (const std::string& message : build_on_small_device<3>({4096, 4096})) {
    INFO(message);
    CHECK(message.find("of device memory") != std::string::npos);
    CHECK(message.find("ZeRO stage 3 over 2 ranks") != std::string::npos);
    CHECK(message.find("0.00 MiB free") != std::string::npos);
    CHECK(message.find("Offload<CPU>") != std::string::npos);
  }
  // Enough for stage 3 but not for stage 0 (every rank then holds the whole model's states).
  const auto between = static_cast<std::size_t>((stage3 + stage0) / 2);
  for (const std::string& message : build_on_small_device<3>({between, between})) {
    CHECK(message.empty());
  }
  for (const std::string& message : build_on_small_device<0>({between, between})) {
    INFO(message);
    CHECK(message.find("ZeRO stage 0 over 2 ranks") != std::string::npos);
  }
  // Just below the stage-3 figure, which counts the gradients the pending reductions hold.
  const auto just_below = static_cast<std::size_t>(stage3) - 1;
  for (const std::string& message : build_on_small_device<3>({just_below, just_below})) {
    INFO(message);
    CHECK(message.find("pending reductions hold") != std::string::npos);
  }
}

TEST_CASE("ranks that share a device need its figure each, one rank short stops every rank",
          "[unit][engine]") {
  const double stage3 = small_device_figures().stage3;
  const auto one_rank = static_cast<std::size_t>(stage3 * 1.5);  // one rank's figure, not two
  // On two devices it fits; on one (CudaLocalComm's threads on one GPU) it does not, and each
  // rank names the count.
  for (const std::string& message : build_on_small_device<3>({one_rank, one_rank}, {5, 6})) {
    CHECK(message.empty());
  }
  for (const std::string& message : build_on_small_device<3>({one_rank, one_rank}, {5, 5})) {
    INFO(message);
    CHECK(message.find("times the 2 ranks on this device") != std::string::npos);
  }
  // Rank 1 alone is short: rank 0, which fits, throws too (it would otherwise allocate and then
  // wait in a collective for rank 1), naming the rank that lacks memory.
  const auto got = build_on_small_device<3>({one_rank, 4096});
  INFO(got[0] << "\n" << got[1]);
  CHECK(got[0].find("ranks [1] have too little free device memory") != std::string::npos);
  CHECK(got[1].find("0.00 MiB free") != std::string::npos);
}

TEST_CASE("HostBackend::make_buffer: zeroed, ordered on the compute stream", "[unit][engine]") {
  engine::HostBackend backend;
  auto b = backend.make_buffer<float>(1000);
  CHECK(&b.stream() == &backend.compute_stream());
  CHECK(b.size() == 1000);
  CHECK(std::all_of(b.data(), b.data() + b.size(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("HostBackend::accumulate: Fold::start equals a clear then an add, bit for bit",
          "[unit][engine]") {
  // A window's first fold ignores what the accumulator held; a negative zero still becomes +0,
  // as adding it to a cleared accumulator makes it.
  const std::vector<bf16> g = {bf16(-0.0f), bf16(1.5f), bf16(-3.25f), bf16(0.0f), bf16(1e-3f)};
  for (const double factor : {1.0, 0.5, -2.0}) {
    std::vector<float> started(g.size(), 7.0f), cleared(g.size(), 7.0f);
    engine::HostBackend::accumulate(std::span<float>(started), std::span<const bf16>(g), factor,
                                    engine::Fold::start);
    engine::HostBackend::clear(std::span<float>(cleared));
    engine::HostBackend::accumulate(std::span<float>(cleared), std::span<const bf16>(g), factor);
    for (std::size_t i = 0; i < g.size(); ++i) {
      CHECK(std::bit_cast<std::uint32_t>(started[i]) == std::bit_cast<std::uint32_t>(cleared[i]));
    }
    CHECK_FALSE(std::signbit(started[0]));
  }
}

TEST_CASE("the engine calls its backend's kernels on the backend object", "[unit][engine]") {
  check_recording_backend<1>();
  check_recording_backend<3>();
}

TEST_CASE("a micro-step's arena must be memory of its kernels' device", "[unit][engine][kernels]") {
  Arena<> arena(1 << 16, "host activations");
  test::RecordingKernels<float> device_kernels(DeviceKind::cuda);
  std::vector<std::int32_t> tokens(8, 1);
  engine::MicroBatch batch{tokens.data(), tokens.data(), 2, 4};
  CHECK_THROWS_WITH(batch.context<float>(arena, true, 0, &device_kernels),
                    Catch::Contains("'host activations' is host memory") &&
                        Catch::Contains("kernels run on the cuda device"));
  // On the host's kernels the batch's own ids are used as they are.
  test::RecordingKernels<float> host_kernels;
  const nn::StepContext<float> ctx = batch.context<float>(arena, true, 0, &host_kernels);
  CHECK(ctx.kernels == &host_kernels);
  CHECK(ctx.tokens == tokens.data());
  CHECK(arena.used_bytes() == 0);
}

// A device tag whose buffers count their bytes while they live: what an engine holds of its
// device's memory, by rank (each rank's engine makes and frees its buffers on its own thread).
// Its optimizer passes run on an executor, as on a GPU, so the optimizer's states live in the
// units' buffers too (without one they stay in the optimizer's host vectors).
struct CountedDevice {};
struct CountedBackend;

// The bytes of the CountedBuffers alive on this thread.
inline thread_local std::int64_t counted_device_bytes = 0;

// Host memory that only CountedBackend::make_buffer can allocate; its bytes count while it lives
// (a move hands them over with the memory).
template <class E>
class CountedBuffer : public Buffer<E, Host> {
 public:
  CountedBuffer() = default;
  CountedBuffer(CountedBuffer&&) noexcept = default;
  CountedBuffer& operator=(CountedBuffer&& other) noexcept {
    if (this != &other) {
      counted_device_bytes -= static_cast<std::int64_t>(this->bytes());
      Buffer<E, Host>::operator=(std::move(other));
    }
    return *this;
  }
  ~CountedBuffer() { counted_device_bytes -= static_cast<std::int64_t>(this->bytes()); }

 private:
  friend struct CountedBackend;
  explicit CountedBuffer(std::size_t n) : Buffer<E, Host>(n) {
    counted_device_bytes += static_cast<std::int64_t>(this->bytes());
  }
};

struct CountedBackend : engine::HostBackend {
  template <class E>
  using DeviceBuffer = CountedBuffer<E>;
  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    return DeviceBuffer<E>(n);
  }
  const optim::FusedExecutor* fused_executor() const { return &executor; }
  static inline testing::RecordingExecutor executor{std::function<bool(const void*)>{}};
};

template <>
struct zero::engine::backend_for<CountedDevice> {
  using type = CountedBackend;
};

namespace {

struct HeldBytes {
  std::int64_t at_rest = 0;   // the engine's buffers alive after its steps
  std::int64_t reported = 0;  // memory_report().device_bytes() then
  std::int64_t left = 0;      // alive once the engine is gone
  std::int64_t whole = 0;     // memory_report().whole_param_bytes + whole_grad_bytes
  std::int64_t sharded = 0;   // memory_report().sharded_state_bytes()
};

// Two steps (accumulation 2, clipping) of a tiny GPT in T at stage S on Compute<CountedDevice>,
// each rank's bytes held at rest and reported.
template <class T, int S>
std::vector<HeldBytes> held_bytes(int world) {
  return per_rank<HeldBytes>(world, [](LocalComm& comm) {
    HeldBytes held;
    const std::int64_t before = counted_device_bytes;
    {
      Config config = adamw_config(S, 2, 0.5);
      config.bf16_enabled = std::is_same_v<T, bf16>;
      engine::EngineOptions options = tiny_options();
      options.persistence_threshold = 0;  // stage 3 holds no unit gathered between steps
      train_tiny_gpt<
          engine::Engine<nn::GPT<T>, ZeroStage<S>, Precision<T>, Compute<CountedDevice>>>(
          comm, config, 2, 2,
          [&](auto& eng) {
            held.at_rest = counted_device_bytes - before;
            const engine::MemoryReport r = eng.memory_report();
            held.reported = static_cast<std::int64_t>(r.device_bytes());
            held.whole = static_cast<std::int64_t>(r.whole_param_bytes + r.whole_grad_bytes);
            held.sharded = static_cast<std::int64_t>(r.sharded_state_bytes());
          },
          options);
    }
    held.left = counted_device_bytes - before;
    return held;
  });
}

template <class T, int S>
void check_held_bytes(int world) {
  INFO("stage " << S << (std::is_same_v<T, bf16> ? " bf16" : " f32") << " world " << world);
  for (const HeldBytes& h : held_bytes<T, S>(world)) {
    CHECK(h.at_rest > 0);
    CHECK(h.at_rest == h.reported);  // every byte the engine holds, and no more
    CHECK(h.left == 0);              // and it gives them all back
  }
}

}  // namespace

TEST_CASE("memory_report() counts every device byte the engine holds at rest, and no more",
          "[unit][engine]") {
  for (int world : {1, 2}) {
    check_held_bytes<float, 0>(world);
    check_held_bytes<float, 1>(world);
    check_held_bytes<float, 2>(world);
    check_held_bytes<float, 3>(world);
    check_held_bytes<bf16, 0>(world);
    check_held_bytes<bf16, 2>(world);
    check_held_bytes<bf16, 3>(world);
  }
  // At 4 ranks stage 3 holds a quarter of stage 0's model states (its whole parameters and
  // gradients are gathered only while a unit runs).
  const std::vector<HeldBytes> stage0 = held_bytes<bf16, 0>(4), stage3 = held_bytes<bf16, 3>(4);
  CHECK(stage3[0].whole == 0);
  CHECK(4 * stage3[0].sharded == stage0[0].sharded);
  CHECK(stage3[0].at_rest < stage0[0].at_rest / 4 + stage0[0].at_rest / 50);
}
