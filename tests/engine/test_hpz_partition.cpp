// ZeRO++ hierarchical partitioning (hpZ; EngineOptions::hpz_size, zero_optimization.
// zero_hpz_partition_size): at stage 3 each forward gathers a unit over the whole data-parallel
// group and keeps a secondary shard of it; the backward gathers the unit from those shards
// inside a group of hpz_size ranks. It trains as one process and bit for bit as plain stage 3;
// the backward's gathers move to the secondary group while the reductions stay over all ranks;
// the secondary shards are what memory_report() and the estimator say, and are gone after the
// step and after an evaluation; bad sizes and stages are refused by name.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/engine/dispatch.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"
#include "sgd_engine.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::CommOp;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::thrown_message;

namespace {

constexpr int steps = 3;

engine::EngineOptions hpz_options(int accumulation, double clip, int hpz_size) {
  return sgd_options(accumulation, clip, 0, hpz_size);
}

// The worst difference over ranks between stage 3 at world ranks with secondary groups of
// hpz_size and want.
double hpz_worst(int world, int hpz_size, int accumulation, double clip,
                 const std::vector<std::vector<double>>& want) {
  const auto worst = per_rank<double>(world, [&](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<3>(model, comm, hpz_options(accumulation, clip, hpz_size));
    return max_error(eng, comm, accumulation, steps, want);
  });
  return *std::max_element(worst.begin(), worst.end());
}

// One step's gathers and reduce-scatters at 4 ranks, by group, with secondary groups of hpz_size
// (0: plain stage 3).
struct Traffic {
  parallel::CommStats all_gather_world, all_gather_secondary, reduce_scatter_world;
  std::size_t secondary_before_step = 0, secondary_after_step = 0, secondary_after_evaluate = 0;
  std::size_t want_secondary = 0;  // every unit's padded size over 2, in bytes of double
};

Traffic hpz_traffic(int hpz_size, int accumulation) {
  return per_rank<Traffic>(4, [&](LocalComm& comm) {
    auto logger = std::make_shared<parallel::CommLogger>();
    comm.set_logger(logger);  // the engine's splits log into it too
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<3>(model, comm, hpz_options(accumulation, 0.0, hpz_size));
    logger->reset();
    const GlobalBatch b(micro_rows * accumulation * 4, 0, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, comm.rank(), 4));
      eng.backward();
    }
    Traffic t;
    t.secondary_before_step = eng.memory_report().secondary_param_bytes;
    eng.step();
    eng.synchronize();
    t.secondary_after_step = eng.memory_report().secondary_param_bytes;
    (void)eng.evaluate(b.micro(0, comm.rank(), 4));
    t.secondary_after_evaluate = eng.memory_report().secondary_param_bytes;
    t.all_gather_world = logger->total(CommOp::all_gather, "world");
    t.all_gather_secondary = logger->total(CommOp::all_gather, "dp-secondary");
    t.reduce_scatter_world = logger->total(CommOp::reduce_scatter, "world");
    for (int u = 0; u < eng.num_units(); ++u) {
      t.want_secondary +=
          static_cast<std::size_t>(eng.partition(u).padded_numel() / 2) * sizeof(double);
    }
    comm.set_logger(nullptr);
    return t;
  })[0];
}

}  // namespace

TEST_CASE("hpZ: stage 3 with secondary groups equals one process", "[unit][engine]") {
  // 4 ranks in secondary groups of 4 need none (a plain stage-3 run through the same path).
  for (const auto& [world, hpz] :
       {std::pair{4, 2}, std::pair{6, 3}, std::pair{6, 2}, std::pair{4, 4}}) {
    for (int accumulation : {1, 3}) {
      for (double clip : {0.0, 0.05}) {  // 0.05 is below the norm: every step clips
        INFO(world << " ranks in secondary groups of " << hpz << ", accumulation " << accumulation
                   << ", clip " << clip);
        const auto want = reference_sgd(micro_rows * accumulation * world, steps, 1.0, clip);
        CHECK(hpz_worst(world, hpz, accumulation, clip, want) < 1e-10);
      }
    }
  }
  // Negative control: the same run against a reference of another learning rate.
  CHECK(hpz_worst(4, 2, 1, 0.0, reference_sgd(micro_rows * 4, steps, 0.9, 0.0)) > 1e-3);
}

TEST_CASE("hpZ: bf16 AdamW at stage 3 trains bit for bit as without it", "[unit][engine]") {
  using E = engine::Engine<nn::GPT<bf16>, ZeroStage<3>, Precision<bf16>>;
  Config config = adamw_config(3, 2, 0.5);
  config.bf16_enabled = true;
  const auto run = [&](int hpz_size) {
    engine::EngineOptions options = tiny_options();
    options.hpz_size = hpz_size;
    return per_rank<std::vector<std::vector<float>>>(4, [&](LocalComm& comm) {
      return train_tiny_gpt<E>(
          comm, config, steps, 2, [](E&) {}, options);
    });
  };
  const auto plain = run(0), hpz = run(2);
  for (std::size_t r = 0; r < plain.size(); ++r) CHECK(hpz[r] == plain[r]);
}

TEST_CASE(
    "hpZ: the backward gathers inside the secondary group from shards the forward kept, the "
    "reductions stay over all ranks, and the shards go at the step",
    "[unit][engine]") {
  for (int accumulation : {1, 2}) {
    INFO("accumulation " << accumulation);
    const Traffic plain = hpz_traffic(0, accumulation), hpz = hpz_traffic(2, accumulation);
    // The same gathers at the same places: those of the backwards moved to the secondary group,
    // each moving the same whole unit; the forwards' stay over all 4 ranks.
    CHECK(plain.all_gather_secondary.count == 0);
    CHECK(hpz.all_gather_secondary.count > 0);
    CHECK(hpz.all_gather_world.count > 0);
    CHECK(hpz.all_gather_world.count + hpz.all_gather_secondary.count ==
          plain.all_gather_world.count);
    CHECK(hpz.all_gather_world.bytes + hpz.all_gather_secondary.bytes ==
          plain.all_gather_world.bytes);
    // A rank sends and receives less over all ranks (a node's links carry the rest).
    CHECK(hpz.all_gather_world.bus_bytes < plain.all_gather_world.bus_bytes);
    CHECK(hpz.reduce_scatter_world.count == plain.reduce_scatter_world.count);
    CHECK(hpz.reduce_scatter_world.bytes == plain.reduce_scatter_world.bytes);
    // Every unit's secondary shard (half of it in groups of 2) until the step, none after.
    CHECK(hpz.secondary_before_step == hpz.want_secondary);
    CHECK(hpz.secondary_after_step == 0);
    CHECK(hpz.secondary_after_evaluate == 0);  // no backward follows an evaluation
    CHECK(plain.secondary_before_step == 0);
  }
}

TEST_CASE("hpZ: the estimator counts the secondary shards as working memory", "[unit][engine]") {
  const auto estimate = [](int hpz_size) {
    return per_rank<engine::MemoryEstimate>(4, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      auto eng = sgd_engine<3>(model, comm, hpz_options(1, 0.0, hpz_size));
      return eng.memory_estimate();
    })[0];
  };
  const auto secondary = per_rank<std::size_t>(4, [](LocalComm& comm) {
    std::size_t bytes = 0;
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<3>(model, comm, hpz_options(1, 0.0, 2));
    for (int u = 0; u < eng.num_units(); ++u) {
      bytes += static_cast<std::size_t>(eng.partition(u).padded_numel() / 2) * sizeof(double);
    }
    return bytes;
  })[0];
  const engine::MemoryEstimate plain = estimate(0), hpz = estimate(2);
  CHECK(hpz.device_at_rest == plain.device_at_rest);
  CHECK(hpz.device_working - plain.device_working == static_cast<double>(secondary));
}

TEST_CASE("hpZ: a bad secondary group size or stage is refused by name", "[unit][engine]") {
  const auto message = [](int world, auto stage_tag, const engine::EngineOptions& options) {
    constexpr int S = decltype(stage_tag)::value;
    return per_rank<std::string>(world, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      return thrown_message([&] { auto eng = sgd_engine<S>(model, comm, options); });
    })[0];
  };
  CHECK_THAT(message(4, std::integral_constant<int, 3>{}, hpz_options(1, 0.0, 3)),
             Catch::Contains("hpz_size (zero_optimization.zero_hpz_partition_size) 3 must divide "
                             "the 4 ranks of the dp group"));
  CHECK_THAT(message(2, std::integral_constant<int, 2>{}, hpz_options(1, 0.0, 2)),
             Catch::Contains("stage 2 gathers no parameters per pass: use stage 3"));
  engine::EngineOptions both = hpz_options(1, 0.0, 2);
  both.shard_size = 2;
  CHECK_THAT(message(4, std::integral_constant<int, 3>{}, both), Catch::Contains("set one"));
  // Ranks that disagree are refused before any group is split.
  const auto differing = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      auto eng = sgd_engine<3>(model, comm, hpz_options(1, 0.0, comm.rank() == 0 ? 0 : 2));
    });
  });
  CHECK_THAT(differing[0], Catch::Contains("hpz_size"));
}

TEST_CASE("hpZ from a DeepSpeed config: zero_hpz_partition_size", "[unit][engine][config]") {
  const auto options = [](int stage, int size) {
    const Config c = Config::from_json_string(
        R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": )" +
        std::to_string(stage) + R"(, "zero_hpz_partition_size": )" + std::to_string(size) + "}}");
    return engine::EngineOptions{}.with_config(c, 4);
  };
  CHECK(options(3, 8).hpz_size == 8);
  CHECK(options(3, 1).hpz_size == 0);  // DeepSpeed's default: off
  CHECK(options(2, 8).hpz_size == 0);  // only stage 3 gathers per pass: the key has no effect
  CHECK_THAT(thrown_message([&] { (void)options(3, 0); }),
             Catch::Contains("zero_optimization.zero_hpz_partition_size"));
}
