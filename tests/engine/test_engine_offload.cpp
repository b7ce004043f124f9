// Offload<NVMe> with Compute<Host>: the fp32 master and the optimizer states live in files
// (io_uring + O_DIRECT, or pread/pwrite where io_uring is missing) and stream through the swapper's
// buffers at each step. After several steps the parameters equal those of the same run without
// offload, bit for bit, at stages 1-3 and world sizes 1, 2 and 4; the states' memory is gone from
// memory_report(); a checkpoint saved from an offloading engine resumes in a plain one and back; an
// I/O failure in a step (EIO, disk full) raises a clear error, stops the engine from saving its
// inconsistent state over the last checkpoint, and that checkpoint resumes the run exactly.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>

#include <zero/engine/engine_weights.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;

namespace {

Config offload_config(int stage, const std::filesystem::path& nvme, double lr = 0.001) {
  Config c = adamw_config(stage, 1, 1.0);
  c.optimizer->params["lr"] = {lr};
  if (!nvme.empty()) {
    c.zero_optimization.offload_optimizer.device = OffloadDevice::nvme;
    c.zero_optimization.offload_optimizer.nvme_path = nvme.string();
    c.zero_optimization.offload_optimizer.buffer_count = 2;
  }
  return c;
}

struct Result {
  std::vector<float> params;
  engine::MemoryReport report;
  offload::TensorReadStats reads;  ///< of the master slices, over the steps
  int units = 0;
};

template <class T, int S, class... Extra>
Result train_as(int world, const Config& cfg, int steps, const std::filesystem::path& ckpt = {},
                bool save = false, int first_step = 0) {
  Result out;
  LocalComm::run(world, [&](LocalComm& comm) {
    nn::GPT<T> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<T>, ZeroStage<S>, Extra...> eng(model, comm, cfg, options);
    if (!ckpt.empty() && !save) eng.load_checkpoint(ckpt);
    for (int step = first_step; step < steps; ++step) {
      const GlobalBatch b(micro_rows * world, step, tiny().vocab_size);
      eng.forward(b.micro(0, comm.rank(), world));
      eng.backward();
      eng.step();
    }
    const auto reads = eng.nvme_read_stats();
    if (save) eng.save_checkpoint(ckpt, "t");
    std::vector<float> mine;
    for (int u = 0; u < eng.num_units(); ++u) {
      const auto v = eng.gather_unit_values(u);
      mine.insert(mine.end(), v.begin(), v.end());
    }
    if (comm.rank() == 0) {
      out.params = mine;
      out.report = eng.memory_report();
      out.reads = reads;
      out.units = eng.num_units();
    }
  });
  return out;
}

template <int S, class... Extra>
Result train(int world, const Config& cfg, int steps, const std::filesystem::path& ckpt = {},
             bool save = false, int first_step = 0) {
  return train_as<float, S, Extra...>(world, cfg, steps, ckpt, save, first_step);
}

// Runs fn; keeps what it raised in error, and in code the errno of an NvmeIoError.
template <class Fn>
void keep_raised(Fn&& fn, std::string& error, int& code) {
  try {
    fn();
  } catch (const offload::NvmeIoError& e) {
    error = e.what();
    code = e.error_code();
  } catch (const Error& e) {
    error = e.what();
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <int S>
void check_stage(const std::filesystem::path& nvme) {
  for (int world : {1, 2, 4}) {
    INFO("stage " << S << " world " << world);
    const auto plain = train<S>(world, offload_config(S, {}), 3);
    const auto offloaded = train<S, Offload<NVMe>>(world, offload_config(S, nvme), 3);
    CHECK(same_bits(plain.params, offloaded.params));
    // The fp32 master and the states are in files: 12 bytes per element of the slice.
    CHECK(offloaded.report.optimizer_bytes == 0);
    CHECK(offloaded.report.master_bytes == 0);
    CHECK(offloaded.report.offloaded_bytes >=
          plain.report.optimizer_bytes + plain.report.master_bytes);
    CHECK(offloaded.report.grad_accumulator_bytes == plain.report.grad_accumulator_bytes);
    const auto wrong = train<S, Offload<NVMe>>(world, offload_config(S, nvme, 0.002), 3);
    CHECK_FALSE(same_bits(plain.params, wrong.params));  // negative control
  }
}

}  // namespace

TEST_CASE("Offload<NVMe> trains exactly like no offload at stages 1-3 and 1, 2, 4 ranks",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme", "/var/tmp");
  check_stage<1>(nvme.path());
  check_stage<2>(nvme.path());
  check_stage<3>(nvme.path());
  // Every swap file is removed with its engine.
  const auto swap = nvme.path() / "zero_swap";
  const bool clean = !std::filesystem::exists(swap) ||
                     std::filesystem::recursive_directory_iterator(swap) ==
                         std::filesystem::recursive_directory_iterator() ||
                     std::none_of(std::filesystem::recursive_directory_iterator(swap),
                                  std::filesystem::recursive_directory_iterator(),
                                  [](const auto& e) { return e.is_regular_file(); });
  CHECK(clean);
}

TEST_CASE("checkpoints move between offloading and plain engines", "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-ckpt", "/var/tmp");
  const auto ckpt = nvme.path() / "ckpt";
  const auto uninterrupted = train<3>(2, offload_config(3, {}), 4);
  train<3, Offload<NVMe>>(2, offload_config(3, nvme.path()), 2, ckpt, true);
  const auto resumed_plain = train<2>(2, offload_config(2, {}), 4, ckpt, false, 2);
  CHECK(std::ranges::equal(resumed_plain.params, uninterrupted.params,
                           [](float a, float b) { return std::abs(a - b) < 2e-5f; }));
  train<1>(2, offload_config(1, {}), 2, ckpt, true);
  const auto resumed_nvme =
      train<3, Offload<NVMe>>(2, offload_config(3, nvme.path()), 4, ckpt, false, 2);
  CHECK(std::ranges::equal(resumed_nvme.params, uninterrupted.params,
                           [](float a, float b) { return std::abs(a - b) < 2e-5f; }));
}

TEST_CASE("an I/O failure in an offloaded step raises and the last checkpoint stays loadable",
          "[unit][engine][offload]") {
  const int error = GENERATE(EIO, ENOSPC);
  const int world = GENERATE(1, 2);
  // Every rank's disk fails, or only the last rank's: the others' update went through, and they
  // must raise too rather than wait for gathers the failed rank never starts.
  const bool one_rank = GENERATE(false, true);
  if (one_rank && world == 1) return;
  INFO("errno " << error << ", world " << world << (one_rank ? ", last rank only" : ""));
  zero::testing::TempDir nvme("engine-nvme-fault", "/var/tmp");
  const auto ckpt = nvme.path() / "ckpt";
  Config cfg = offload_config(2, nvme.path());
  cfg.comm_timeout_s = 30;  // a rank left waiting fails the test in seconds, not minutes
  cfg.comm_timeout_given = true;
  const auto uninterrupted = train<2>(world, offload_config(2, {}), 4);
  struct RankOutcome {
    std::string step_error, save_error, forward_error;
    int error_code = 0;
    bool saved_bad = true, reloaded_equal = false;
    std::vector<float> params;
  };
  std::vector<RankOutcome> outcome(static_cast<std::size_t>(world));
  LocalComm::run(world, [&](LocalComm& comm) {
    RankOutcome& mine = outcome[static_cast<std::size_t>(comm.rank())];
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    const auto faults = std::make_shared<offload::FaultInjector>(
        std::numeric_limits<std::uint64_t>::max(), error, offload::IoOp::write);
    options.nvme_faults = faults;
    engine::Engine<nn::GPT<float>, ZeroStage<2>, Offload<NVMe>> eng(model, comm, cfg, options);
    auto run_step = [&](int step) {
      const GlobalBatch b(micro_rows * world, step, tiny().vocab_size);
      eng.forward(b.micro(0, comm.rank(), world));
      eng.backward();
      eng.step();
    };
    auto params = [&] {
      std::vector<float> all;
      for (int u = 0; u < eng.num_units(); ++u) {
        const auto v = eng.gather_unit_values(u);
        all.insert(all.end(), v.begin(), v.end());
      }
      return all;
    };
    run_step(0);
    run_step(1);
    eng.save_checkpoint(ckpt, "good");
    const std::vector<float> good = params();
    // The second state write of the next step fails.
    if (!one_rank || comm.rank() == world - 1) faults->arm(1);
    keep_raised([&] { run_step(2); }, mine.step_error, mine.error_code);
    try {
      eng.save_checkpoint(ckpt, "bad");
    } catch (const Error& e) {
      mine.save_error = e.what();
    }
    mine.saved_bad = std::filesystem::exists(ckpt / "bad");
    try {
      run_step(2);
    } catch (const Error& e) {
      mine.forward_error = e.what();
    }
    // The last checkpoint brings back the state saved, and the run continues exactly.
    eng.load_checkpoint(ckpt);
    mine.reloaded_equal = params() == good;
    run_step(2);
    run_step(3);
    mine.params = params();
  });
  for (int rank = 0; rank < world; ++rank) {
    const RankOutcome& r = outcome[static_cast<std::size_t>(rank)];
    INFO("rank " << rank << ": " << r.step_error);
    if (!one_rank || rank == world - 1) {
      CHECK(r.error_code == error);
      CHECK_THAT(r.step_error,
                 Catch::Contains("zero_swap") && Catch::Contains(std::strerror(error)));
    } else {
      CHECK_THAT(r.step_error, Catch::Contains("offloaded update failed on rank 1") &&
                                   Catch::Contains(std::strerror(error)) &&
                                   Catch::Contains("load a checkpoint"));
    }
    CHECK_THAT(r.save_error, Catch::Contains("save_checkpoint('bad')") &&
                                 Catch::Contains("stopped part-way") &&
                                 Catch::Contains(std::strerror(error)));
    CHECK_THAT(r.forward_error, Catch::Contains("load a checkpoint"));
    CHECK_FALSE(r.saved_bad);
    CHECK(r.reloaded_equal);
    CHECK(same_bits(r.params, uninterrupted.params));
  }
}

TEST_CASE("GPT-2 weights go in and out of an engine whose master is in files",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-weights", "/var/tmp");
  const auto file = nvme.path() / "w.safetensors";
  std::vector<std::vector<float>> plain_values, offloaded_values, reloaded_values, after_clash;
  std::string clash_error;
  LocalComm::run(2, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    options.persistence_threshold = 0;  // every stage-3 gather reads its slice from the file
    engine::Engine<nn::GPT<float>, ZeroStage<3>> plain(model, comm, offload_config(3, {}), options);
    engine::Engine<nn::GPT<float>, ZeroStage<3>, Offload<NVMe>> offloaded(
        model, comm, offload_config(3, nvme.path()), options);
    for (int u = 0; u < plain.num_units(); ++u) {
      const auto a = plain.gather_unit_values(u), b = offloaded.gather_unit_values(u);
      if (comm.rank() == 0) {
        plain_values.push_back(a);
        offloaded_values.push_back(b);
      }
    }
    engine::save_gpt2_weights(offloaded, file);
    options.seed = 99;  // another start, replaced by the file
    // A second engine on the same nvme_path would share the first one's files: refused.
    using OffloadEngine = engine::Engine<nn::GPT<float>, ZeroStage<3>, Offload<NVMe>>;
    std::string clash;
    try {
      OffloadEngine same_path(model, comm, offload_config(3, nvme.path()), options);
    } catch (const ConfigError& e) {
      clash = e.what();
    }
    if (comm.rank() == 0) clash_error = clash;
    for (int u = 0; u < offloaded.num_units(); ++u) {
      const auto v = offloaded.gather_unit_values(u);  // the first engine's files are untouched
      if (comm.rank() == 0) after_clash.push_back(v);
    }
    std::filesystem::create_directories(nvme.path() / "other");
    OffloadEngine other(model, comm, offload_config(3, nvme.path() / "other"), options);
    engine::load_gpt2_weights(other, file);
    for (int u = 0; u < other.num_units(); ++u) {
      const auto v = other.gather_unit_values(u);
      if (comm.rank() == 0) reloaded_values.push_back(v);
    }
  });
  CHECK(offloaded_values == plain_values);  // the same initial master, read back from files
  CHECK(reloaded_values == plain_values);
  CHECK_THAT(clash_error, Catch::Contains("in use by another swapper"));
  CHECK(after_clash == plain_values);
}

TEST_CASE("offload_param selects the same NVMe offload and is refused without it",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-param", "/var/tmp");
  Config param_only = offload_config(3, {});
  param_only.zero_optimization.offload_param.device = OffloadDevice::nvme;
  param_only.zero_optimization.offload_param.nvme_path = nvme.path().string();
  const auto plain = train<3>(2, offload_config(3, {}), 3);
  const auto offloaded = train<3, Offload<NVMe>>(2, param_only, 3);
  CHECK(same_bits(plain.params, offloaded.params));
  CHECK(offloaded.report.master_bytes == 0);
  // A config that puts parameters on NVMe is refused by an engine built without offload.
  CHECK_THROWS_WITH(train<3>(1, param_only, 1),
                    Catch::Contains("offload_param.device") && Catch::Contains("Offload<none>"));
}

namespace {

// A stage-3 config whose every unit is gathered for its forward and backward (none persistent),
// with the master and states in files under nvme (none: no offload), buffer_count 4 (three reads
// ahead at once), and stage3_prefetch_bucket_size prefetch.
Config read_ahead_config(const std::filesystem::path& nvme, std::int64_t prefetch = 50'000'000) {
  Config cfg = offload_config(3, nvme);
  if (!nvme.empty()) cfg.zero_optimization.offload_optimizer.buffer_count = 4;
  cfg.zero_optimization.stage3_param_persistence_threshold = 0;
  cfg.zero_optimization.stage3_prefetch_bucket_size = prefetch;
  return cfg;
}

// Rank 0's parameters and master-slice reads after a run.
struct ReadAheadRun {
  std::vector<float> params;
  offload::TensorReadStats reads;
  int units = 0;
};
// tiny() with six blocks: enough units for a window of reads ahead.
nn::GPTConfig six_blocks() {
  nn::GPTConfig c = tiny();
  c.num_layers = 6;
  return c;
}
// `steps` steps of cfg under options at stage 3, with the offload policy given (none: the master
// beside the compute).
template <class... Offloads>
ReadAheadRun train_read_ahead(int world, const Config& cfg, const engine::EngineOptions& base,
                              int steps) {
  ReadAheadRun out;
  LocalComm::run(world, [&](LocalComm& comm) {
    nn::GPT<float> model(six_blocks());
    engine::EngineOptions options = base;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<3>, Offloads...> eng(model, comm, cfg, options);
    for (int step = 0; step < steps; ++step) {
      const GlobalBatch b(micro_rows * world, step, tiny().vocab_size);
      eng.forward(b.micro(0, comm.rank(), world));
      eng.backward();
      eng.step();
    }
    const auto reads = eng.nvme_read_stats();
    std::vector<float> mine;
    for (int u = 0; u < eng.num_units(); ++u) {
      const auto v = eng.gather_unit_values(u);
      mine.insert(mine.end(), v.begin(), v.end());
    }
    if (comm.rank() == 0) {
      out = {mine, reads, eng.num_units()};
    }
  });
  return out;
}

}  // namespace

TEST_CASE("Offload<NVMe> stage 3 reads master slices ahead of their gathers, same values",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-ahead", "/var/tmp");
  const int steps = 3;
  for (int world : {1, 2}) {
    INFO("world " << world);
    const auto plain = train_read_ahead(world, read_ahead_config({}), {}, steps).params;
    const Config cfg = read_ahead_config(nvme.path());
    const auto ahead =
        train_read_ahead<Offload<NVMe>>(world, cfg, {}, steps);  // the default: read ahead
    engine::EngineOptions off;
    off.nvme_read_ahead = false;
    const auto demand = train_read_ahead<Offload<NVMe>>(world, cfg, off, steps);
    // Nothing prefetched: nothing read ahead either.
    const auto unprefetched =
        train_read_ahead<Offload<NVMe>>(world, read_ahead_config(nvme.path(), 0), {}, steps);
    CHECK(same_bits(plain, ahead.params));
    CHECK(same_bits(plain, demand.params));
    CHECK(same_bits(plain, unprefetched.params));
    // Every gather from the files got its slice once, read ahead, handed over by the step's
    // pass, or read then: the same number in every run.
    const auto total = [](const offload::TensorReadStats& r) {
      return r.read_ahead + r.handed_over + r.on_demand;
    };
    const auto show = [](const char* run, const offload::TensorReadStats& r) {
      return zero::detail::concat(run, ": ", r.read_ahead, " ahead, ", r.handed_over,
                                  " handed over, ", r.on_demand, " on demand, ", r.dropped,
                                  " dropped");
    };
    INFO(show("ahead", ahead.reads) << "; " << show("unprefetched", unprefetched.reads));
    CHECK(total(ahead.reads) == total(demand.reads));
    CHECK(total(unprefetched.reads) == total(demand.reads));
    // Forward and backward; the embedding, which the head reads, stays gathered between them.
    CHECK(total(demand.reads) == steps * (2 * ahead.units - 1));
    CHECK(demand.reads.read_ahead + demand.reads.handed_over == 0);
    CHECK(unprefetched.reads.read_ahead == 0);
    // Each step's pass leaves the first buffer_count - 1 = 3 units' slices to the next forward.
    const std::int64_t handed = 3 * (steps - 1);
    CHECK(unprefetched.reads.handed_over == handed);
    CHECK(ahead.reads.handed_over == handed);
    // With a window, only the first forward's first two gathers read their slice when they start
    // (the first unit's, and the next one's, which its prefetch starts at once): the forward's
    // window reads ahead the backward's first slices, and the later forwards' first ones are
    // handed over. Every read ahead and every hand-over is used.
    CHECK(ahead.reads.on_demand == 2);
    CHECK(ahead.reads.dropped == 0);
    CHECK(unprefetched.reads.dropped == 0);
  }
}

TEST_CASE("a master slice's read failing on one rank raises on every rank, and training goes on",
          "[unit][engine][offload]") {
  const bool ahead = GENERATE(true, false);  // the failed read is a read ahead, or on demand
  INFO((ahead ? "read ahead" : "read on demand"));
  zero::testing::TempDir nvme("engine-nvme-read-fault", "/var/tmp");
  const int world = 2;
  Config cfg = read_ahead_config(nvme.path());
  cfg.comm_timeout_s = 30;  // a rank left waiting in a gather fails the test in seconds
  cfg.comm_timeout_given = true;
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  options.nvme_read_ahead = ahead;
  const auto run_batch = [&](auto& eng, LocalComm& comm, int step) {
    const GlobalBatch b(micro_rows * world, step, tiny().vocab_size);
    eng.forward(b.micro(0, comm.rank(), world));
    eng.backward();
    eng.step();
  };
  // The run below loses the window of batch 1: the same run without offload, without it.
  const auto reference = zero::testing::per_rank<std::vector<float>>(world, [&](LocalComm& comm) {
    nn::GPT<float> model(six_blocks());
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, comm, read_ahead_config({}), options);
    for (int step : {0, 2, 3}) run_batch(eng, comm, step);
    return all_unit_values(eng);
  });
  struct RankOutcome {
    std::string step_error, evaluate_error, gather_error;
    int step_code = 0, evaluate_code = 0, gather_code = 0;
    std::int64_t steps = 0, skipped = 0;
    std::vector<float> params;
  };
  std::vector<RankOutcome> outcome(static_cast<std::size_t>(world));
  LocalComm::run(world, [&](LocalComm& comm) {
    RankOutcome& mine = outcome[static_cast<std::size_t>(comm.rank())];
    nn::GPT<float> model(six_blocks());
    engine::EngineOptions with_faults = options;
    const auto faults = std::make_shared<offload::FaultInjector>(
        std::numeric_limits<std::uint64_t>::max(), EIO, offload::IoOp::read);
    with_faults.nvme_faults = faults;
    engine::Engine<nn::GPT<float>, ZeroStage<3>, Offload<NVMe>> eng(model, comm, cfg, with_faults);
    run_batch(eng, comm, 0);
    // The next read from rank 1's files fails: in the forward of batch 1.
    if (comm.rank() == 1) faults->arm(0);
    keep_raised([&] { run_batch(eng, comm, 1); }, mine.step_error, mine.step_code);
    run_batch(eng, comm, 2);
    // An evaluation and a gather of values, each with a read failing on rank 1.
    const GlobalBatch eval(micro_rows * world, 7, tiny().vocab_size);
    if (comm.rank() == 1) faults->arm(0);
    keep_raised([&] { (void)eng.evaluate(eval.micro(0, comm.rank(), world)); }, mine.evaluate_error,
                mine.evaluate_code);
    if (comm.rank() == 1) faults->arm(0);
    keep_raised([&] { (void)eng.gather_unit_values(eng.num_units() - 1); }, mine.gather_error,
                mine.gather_code);
    (void)eng.evaluate(eval.micro(0, comm.rank(), world));  // the same reads now succeed
    run_batch(eng, comm, 3);
    mine.steps = eng.steps();
    mine.skipped = eng.skipped_steps();
    mine.params = all_unit_values(eng);
  });
  for (int rank = 0; rank < world; ++rank) {
    const RankOutcome& r = outcome[static_cast<std::size_t>(rank)];
    INFO("rank " << rank << ": " << r.step_error << " | " << r.evaluate_error << " | "
                 << r.gather_error);
    if (rank == 1) {
      // The rank whose read failed raises the read's own error.
      CHECK(r.step_code == EIO);
      CHECK(r.evaluate_code == EIO);
      CHECK(r.gather_code == EIO);
      CHECK_THAT(r.step_error, Catch::Contains("zero_swap") && Catch::Contains("read"));
    } else {
      CHECK_THAT(r.step_error,
                 Catch::Contains("Engine::step") && Catch::Contains("could not be read") &&
                     Catch::Contains("rank 1") && Catch::Contains(std::strerror(EIO)) &&
                     Catch::Contains("no update made"));
      CHECK_THAT(r.evaluate_error, Catch::Contains("Engine::evaluate") &&
                                       Catch::Contains("rank 1") &&
                                       Catch::Contains(std::strerror(EIO)));
      CHECK_THAT(r.gather_error, Catch::Contains("gather_unit_values") &&
                                     Catch::Contains("rank 1") &&
                                     Catch::Contains(std::strerror(EIO)));
    }
    // The failed window made no update: three updates, its boundary skipped, and the values
    // those three updates give without offload.
    CHECK(r.steps == 3);
    CHECK(r.skipped == 1);
    CHECK(same_bits(r.params, reference[static_cast<std::size_t>(rank)]));
  }
}

TEST_CASE(
    "Offload<NVMe> under pipeline parallelism: a slice one stage could not read raises on every "
    "rank after the evaluation, and training goes on",
    "[unit][engine][offload][pipeline]") {
  // Stage 0's evaluation raised on its own ranks before handing its activations on, and stage 1
  // waited for them until the communicator's deadline (a CommError, the engine unusable).
  zero::testing::TempDir nvme("engine-nvme-pp-read-fault", "/var/tmp");
  zero::testing::TempDir ckpt("engine-nvme-pp-ckpt", "/var/tmp");
  const int world = 2;  // pp 2
  struct RankOutcome {
    std::string error;
    int code = 0;
    double fired = 0;
    double evaluated = 0;  // the evaluation's loss once the reads succeed
    std::vector<float> params;
  };
  // Trains a step, saves, loads (whose regather reads every master slice from the files: the
  // first read of stage 0's rank fails when `fail`), evaluates twice (the first raising when
  // `fail`) and trains another step.
  const auto run = [&]<class... Offloads>(const Config& cfg, bool fail) {
    return zero::testing::per_rank<RankOutcome>(world, [&](LocalComm& comm) {
      RankOutcome out;
      parallel::ProcessGroups<LocalComm> groups(comm, parallel::Grid({.pp = 2}));
      nn::GPT<float> model(six_blocks());
      engine::EngineOptions options;
      options.activation_bytes = 32 << 20;
      const auto faults = std::make_shared<offload::FaultInjector>(
          std::numeric_limits<std::uint64_t>::max(), EIO, offload::IoOp::read);
      options.nvme_faults = faults;
      parallel::pipeline::PipelineEngine<nn::GPT<float>, ZeroStage<1>, Offloads...> pipe(
          model, comm, groups, cfg, {}, options);
      const auto batch = [](int step) {
        auto b = std::make_shared<GlobalBatch>(micro_rows, step, tiny().vocab_size);
        return std::make_pair(b, b->micro(0, 0, 1));
      };
      {
        const auto [b, mb] = batch(0);
        pipe.train_batch(std::vector<engine::MicroBatch>{mb});
      }
      pipe.engine().save_checkpoint(ckpt.path(), "t");
      if (fail && pipe.stage() == 0) faults->arm(0);
      pipe.engine().load_checkpoint(ckpt.path());
      const auto [eval, eval_mb] = batch(7);
      if (fail) keep_raised([&] { (void)pipe.evaluate(eval_mb); }, out.error, out.code);
      out.fired = static_cast<double>(faults->fired());
      out.evaluated = pipe.evaluate(eval_mb);
      {
        const auto [b, mb] = batch(1);
        pipe.train_batch(std::vector<engine::MicroBatch>{mb});
      }
      out.params = all_unit_values(pipe.engine());
      return out;
    });
  };
  Config cfg = offload_config(1, nvme.path());
  cfg.comm_timeout_s = 30;  // a stage left waiting fails the test in seconds
  cfg.comm_timeout_given = true;
  Config plain_cfg = offload_config(1, {});
  const auto plain = run.template operator()<>(plain_cfg, false);
  const auto failed = run.template operator()<Offload<NVMe>>(cfg, true);
  for (int rank = 0; rank < world; ++rank) {
    const RankOutcome& r = failed[static_cast<std::size_t>(rank)];
    INFO("rank " << rank << ": " << r.error);
    if (rank == 0) {
      CHECK(r.fired == 1);  // the failure was the load's read on this stage
      CHECK(r.code == EIO);
      CHECK_THAT(r.error, Catch::Contains("zero_swap") && Catch::Contains("read"));
    } else {
      CHECK(r.fired == 0);
      CHECK_THAT(r.error, Catch::Contains("Engine::evaluate") && Catch::Contains("rank 0") &&
                              Catch::Contains(std::strerror(EIO)));
    }
    // Nothing was lost: the evaluation and the next step are those of the run without offload.
    const RankOutcome& p = plain[static_cast<std::size_t>(rank)];
    CHECK(r.evaluated == p.evaluated);
    CHECK(same_bits(r.params, p.params));
  }
}

TEST_CASE("Offload<NVMe>'s step keeps the slices the gathers after it read, same values",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-kept", "/var/tmp");
  const int steps = 3;
  // Stages 1-2 gather every unit again after the step, stage 3 the persistent ones: every unit
  // under a threshold above the largest, none under 0.
  const auto check = [&]<int S>(int world, std::int64_t threshold) {
    INFO("stage " << S << " world " << world << " persistence threshold " << threshold);
    Config plain_cfg = offload_config(S, {});
    Config cfg = offload_config(S, nvme.path());
    for (Config* c : {&plain_cfg, &cfg}) {
      c->zero_optimization.stage3_param_persistence_threshold = threshold;
    }
    const auto plain = train<S>(world, plain_cfg, steps);
    const auto offloaded = train<S, Offload<NVMe>>(world, cfg, steps);
    CHECK(same_bits(plain.params, offloaded.params));
    const offload::TensorReadStats& r = offloaded.reads;
    INFO(r.kept << " kept, " << r.on_demand << " on demand, " << r.read_ahead << " ahead, "
                << r.handed_over << " handed over");
    if (threshold > 0) {
      // Each step's gathers took the kept copies (at stage 3 the first units' slices handed
      // over by the pass, which goes last to first, instead); only the gathers after the states
      // first went to the files (the engine's construction) read theirs.
      CHECK(r.kept + r.handed_over == steps * offloaded.units);
      CHECK(r.kept >= steps * (offloaded.units - 1));
      if (S < 3) CHECK(r.handed_over == 0);
      CHECK(r.on_demand == offloaded.units);
      CHECK(r.read_ahead == 0);
    } else {
      CHECK(r.kept == 0);
    }
  };
  for (int world : {1, 2}) {
    check.operator()<1>(world, 1'000'000'000);
    check.operator()<2>(world, 1'000'000'000);
    check.operator()<3>(world, 1'000'000'000);
    check.operator()<3>(world, 0);
  }
}

TEST_CASE("Offload<NVMe> in bf16 trains exactly like bf16 without offload",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-bf16", "/var/tmp");
  auto bf16_config = [](int stage, const std::filesystem::path& path) {
    Config c = offload_config(stage, path);
    c.bf16_enabled = true;
    return c;
  };
  const auto plain2 = train_as<bf16, 2, Precision<bf16>>(2, bf16_config(2, {}), 3);
  const auto nvme2 =
      train_as<bf16, 2, Precision<bf16>, Offload<NVMe>>(2, bf16_config(2, nvme.path()), 3);
  CHECK(same_bits(plain2.params, nvme2.params));
  CHECK(nvme2.reads.kept == 3 * nvme2.units);  // rounded to bf16 by the step's pass
  const auto plain3 = train_as<bf16, 3, Precision<bf16>>(2, bf16_config(3, {}), 3);
  const auto nvme3 =
      train_as<bf16, 3, Precision<bf16>, Offload<NVMe>>(2, bf16_config(3, nvme.path()), 3);
  CHECK(same_bits(plain3.params, nvme3.params));
  CHECK(nvme3.report.master_bytes == 0);
  Config other_lr = bf16_config(3, nvme.path());
  other_lr.optimizer->params["lr"] = {0.002};
  const auto wrong = train_as<bf16, 3, Precision<bf16>, Offload<NVMe>>(2, other_lr, 3);
  CHECK_FALSE(same_bits(plain3.params, wrong.params));  // negative control
}

namespace {

// Each rank's gathered unit values after `steps` steps of a tp 2 GPT over 2 ranks (dp 1).
template <class... Extra>
std::vector<std::vector<float>> train_tp2(const Config& cfg, int steps) {
  return zero::testing::per_rank<std::vector<float>>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2}));
    nn::GPT<float> model(tp_tiny(), parallel::TensorParallel(groups.tp()));
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<1>, Extra...> eng(model, groups, cfg, options);
    for (int step = 0; step < steps; ++step) {
      const GlobalBatch b(micro_rows, step, tp_tiny().vocab_size);
      eng.forward(b.micro(0, 0, 1));  // both tp ranks take the dp rank's rows
      eng.backward();
      eng.step();
    }
    return all_unit_values(eng);
  });
}

}  // namespace

TEST_CASE("Offload<NVMe> with tensor parallelism: each tp rank swaps to its own files",
          "[unit][engine][offload]") {
  // The swap directory was named after the dp rank, which both tp ranks share: the second
  // engine found the first one's lock and refused to start.
  zero::testing::TempDir nvme("engine-nvme-tp", "/var/tmp");
  const auto offloaded = train_tp2<Offload<NVMe>>(offload_config(1, nvme.path()), 2);
  const auto plain = train_tp2<>(offload_config(1, {}), 2);
  CHECK(offloaded == plain);
  CHECK(offloaded[0] != offloaded[1]);  // the ranks hold different parts
}
