// A device engine's communicator may move device memory only (NcclComm). This runs an engine
// whose backend says so (comm_reads_host_memory false) over a communicator that records every
// byte it is handed outside the memory that backend allocates: training (the step's statistics),
// sum_over_data_parallel, gather_unit_values, a checkpoint saved and loaded (its sizes, text and
// outcome), and a weights export (its outcome) must hand it the backend's buffers only
// (HostValueComm stages the host's values through them), with the same values as the host
// engine over LocalComm.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/engine/engine.hpp>
#include <zero/engine/engine_weights.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::per_rank;

namespace {

// The address ranges TrackedDevice has allocated and not yet freed.
class DeviceRanges {
 public:
  static void add(const void* p, std::size_t bytes) {
    const std::lock_guard lock(mutex_);
    ranges_[static_cast<const char*>(p)] = bytes;
  }
  static void remove(const void* p) noexcept {
    const std::lock_guard lock(mutex_);
    ranges_.erase(static_cast<const char*>(p));
  }
  // True when [p, p + bytes) lies in one allocation.
  static bool contains(const void* p, std::size_t bytes) {
    const std::lock_guard lock(mutex_);
    const char* c = static_cast<const char*>(p);
    auto it = ranges_.upper_bound(c);
    if (it == ranges_.begin()) return false;
    --it;
    return c + bytes <= it->first + it->second;
  }

 private:
  static inline std::mutex mutex_;
  static inline std::map<const char*, std::size_t> ranges_;
};

// Host memory whose allocations DeviceRanges records: "device memory" a communicator can tell
// from the host's.
struct TrackedDevice {
  static constexpr DeviceKind kind = DeviceKind::host;
  using Stream = Host::Stream;
  using Event = Host::Event;
  static constexpr std::size_t default_alignment = Host::default_alignment;
  static Stream& default_stream() { return Host::default_stream(); }
  static void* allocate(std::size_t bytes, std::size_t alignment, Stream& s) {
    void* p = Host::allocate(bytes, alignment, s);
    if (p != nullptr) DeviceRanges::add(p, bytes);
    return p;
  }
  static void deallocate(void* p, std::size_t bytes, Stream& s) noexcept {
    if (p != nullptr) DeviceRanges::remove(p);
    Host::deallocate(p, bytes, s);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, Stream& s) {
    Host::copy(dst, src, bytes, s);
  }
  static void fill_bytes(void* dst, int value, std::size_t bytes, Stream& s) {
    Host::fill_bytes(dst, value, bytes, s);
  }
};
static_assert(Device<TrackedDevice>);

// LocalComm's mover, recording each op that moved memory TrackedDevice did not allocate (it
// still moves it, so a failing run ends instead of hanging).
class DeviceOnlyMover : public parallel::HostMover {
 public:
  static constexpr std::string_view comm_name = "DeviceOnlyComm";
  static inline std::atomic<int> host_moves = 0;
  static inline std::mutex mutex;
  static inline std::vector<std::string> host_ops;  // the first few, for the failure message

  explicit DeviceOnlyMover(Place place = {}) : HostMover(place) {}
  void begin(const parallel::detail::OpContext& ctx, parallel::CommClock::time_point deadline) {
    op_ = ctx.describe();
    HostMover::begin(ctx, deadline);
  }
  void copy(void* dst, const void* src, std::size_t bytes) {
    check(dst, bytes);
    check(src, bytes);
    HostMover::copy(dst, src, bytes);
  }
  template <class T>
  void reduce(parallel::ReduceOp op, const T* const* inputs, int ranks, std::size_t count,
              T* const* outputs, int n_outputs) {
    for (int r = 0; r < ranks; ++r) check(inputs[r], count * sizeof(T));
    for (int o = 0; o < n_outputs; ++o) check(outputs[o], count * sizeof(T));
    HostMover::reduce<T>(op, inputs, ranks, count, outputs, n_outputs);
  }
  void to_host(void* dst, const void* src, std::size_t bytes,
               const parallel::detail::OpContext& ctx, parallel::CommClock::time_point deadline) {
    check(src, bytes);
    HostMover::to_host(dst, src, bytes, ctx, deadline);
  }
  void from_host(void* dst, const void* src, std::size_t bytes,
                 const parallel::detail::OpContext& ctx, parallel::CommClock::time_point deadline) {
    check(dst, bytes);
    HostMover::from_host(dst, src, bytes, ctx, deadline);
  }

 private:
  void check(const void* p, std::size_t bytes) {
    if (bytes == 0 || DeviceRanges::contains(p, bytes)) return;
    ++host_moves;
    const std::lock_guard lock(mutex);
    if (host_ops.size() < 8) host_ops.push_back(op_);
  }
  std::string op_;
};
using DeviceOnlyComm = parallel::BasicLocalComm<DeviceOnlyMover>;

}  // namespace

// A device whose buffers are TrackedDevice memory and whose communicator cannot read the host's.
struct TrackedComputeDevice {};
struct TrackedBackend : engine::HostBackend {
  template <class E>
  using DeviceBuffer = Buffer<E, TrackedDevice>;
  static constexpr bool comm_reads_host_memory = false;
  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    return DeviceBuffer<E>(n);
  }
};
template <>
struct zero::engine::backend_for<TrackedComputeDevice> {
  using type = TrackedBackend;
};

namespace {

constexpr int world = 2;
constexpr int steps = 2;
constexpr int accumulation = 2;

struct HostValuesRun {
  std::vector<std::vector<float>> trained;  // every unit after training
  std::vector<std::vector<float>> loaded;   // the same, in a fresh engine loaded from the save
  double summed = 0;                        // sum_over_data_parallel of rank + 1
  int client_value = 0;                     // the client state the load returned
  std::size_t exported = 0;                 // tensors save_gpt2_weights wrote
};

Config host_values_config(int stage) {
  Config c = adamw_config(stage, accumulation, 0.5);
  c.bf16_enabled = true;
  return c;
}

template <int S>
void check_host_values() {
  using Plain = engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>>;
  using Tracked =
      engine::Engine<nn::GPT<bf16>, ZeroStage<S>, Precision<bf16>, Compute<TrackedComputeDevice>>;
  const Config config = host_values_config(S);
  const auto plain = per_rank<std::vector<std::vector<float>>>(world, [&](LocalComm& comm) {
    return train_tiny_gpt<Plain>(comm, config, steps, accumulation, [](Plain&) {});
  });
  zero::testing::TempDir tmp("engine-host-values");
  DeviceOnlyMover::host_moves = 0;
  DeviceOnlyMover::host_ops.clear();
  const auto runs = per_rank<HostValuesRun, DeviceOnlyComm>(world, [&](DeviceOnlyComm& comm) {
    HostValuesRun out;
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    nn::GPT<bf16> model(tiny());
    Tracked eng(model, comm, config, options);
    out.trained = train_steps(eng, comm, 0, steps, accumulation);
    double value = comm.rank() + 1.0;
    eng.sum_over_data_parallel(std::span<double>(&value, 1));
    out.summed = value;
    eng.save_checkpoint(tmp.path() / "ckpt", "step2", nlohmann::json{{"seen", 17}});
    out.exported = engine::save_gpt2_weights(eng, tmp.path() / "gpt2.safetensors").tensors;

    nn::GPT<bf16> fresh_model(tiny());
    Tracked fresh(fresh_model, comm, config, options);
    out.client_value = fresh.load_checkpoint(tmp.path() / "ckpt").value("seen", 0);
    for (int u = 0; u < fresh.num_units(); ++u) out.loaded.push_back(fresh.gather_unit_values(u));
    return out;
  });
  INFO("stage " << S);
  {
    const std::lock_guard lock(DeviceOnlyMover::mutex);
    for (const std::string& op : DeviceOnlyMover::host_ops) UNSCOPED_INFO("host memory in " << op);
  }
  CHECK(DeviceOnlyMover::host_moves == 0);
  for (int r = 0; r < world; ++r) {
    const HostValuesRun& run = runs[static_cast<std::size_t>(r)];
    CHECK(run.trained == plain[static_cast<std::size_t>(r)]);  // bit for bit
    CHECK(run.loaded == run.trained);
    CHECK(run.summed == 3.0);
    CHECK(run.client_value == 17);
    CHECK(run.exported > 0);
  }
}

}  // namespace

TEST_CASE("a device engine hands its communicator device memory only, host values staged",
          "[unit][engine][checkpoint]") {
  check_host_values<1>();
  check_host_values<3>();
}

TEST_CASE("DeviceOnlyComm records host memory handed to it (the control)", "[unit][engine]") {
  DeviceOnlyMover::host_moves = 0;
  const auto got = per_rank<double, DeviceOnlyComm>(2, [](DeviceOnlyComm& comm) {
    std::vector<double> values{comm.rank() + 1.0};
    comm.all_reduce(std::span<double>(values), parallel::ReduceOp::sum);
    return values[0];
  });
  CHECK(got == std::vector<double>{3.0, 3.0});
  CHECK(DeviceOnlyMover::host_moves > 0);
  // The same op on TrackedDevice memory is not counted.
  DeviceOnlyMover::host_moves = 0;
  const auto tracked = per_rank<double, DeviceOnlyComm>(2, [](DeviceOnlyComm& comm) {
    Buffer<double, TrackedDevice> values(1);
    values.data()[0] = comm.rank() + 1.0;
    comm.all_reduce(std::span<double>(values.data(), 1), parallel::ReduceOp::sum);
    return values.data()[0];
  });
  CHECK(tracked == std::vector<double>{3.0, 3.0});
  CHECK(DeviceOnlyMover::host_moves == 0);
}
