// Hybrid sharding (EngineOptions::shard_size; DeepSpeed's MiCS, FSDP's HYBRID_SHARD): ZeRO
// shards each unit over groups of shard_size data-parallel ranks and replicates it across them.
// At every stage it trains as one process; the gathers stay inside a shard group and each
// reduced shard is averaged once more over its replicas; a rank holds what plain ZeRO at
// shard_size ranks holds; checkpoints saved hybrid load at any layout and back; bad sizes are
// refused by name.
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
#include "../support/temp_dir.hpp"
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

// The worst difference over ranks between stage S at world ranks in shard groups of shard_size
// and want.
template <int S>
double hybrid_worst(int world, int shard_size, int accumulation, double clip,
                    const std::vector<std::vector<double>>& want) {
  const auto worst = per_rank<double>(world, [&](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, comm, sgd_options(accumulation, clip, shard_size));
    return max_error(eng, comm, accumulation, steps, want);
  });
  return *std::max_element(worst.begin(), worst.end());
}

template <int S>
void check_hybrid_stage() {
  for (const auto& [world, shard] : {std::pair{4, 2}, std::pair{4, 1}, std::pair{6, 3}}) {
    for (int accumulation : {1, 3}) {
      for (double clip : {0.0, 0.05}) {  // 0.05 is below the norm: every step clips
        INFO("stage " << S << ", " << world << " ranks in shard groups of " << shard
                      << ", accumulation " << accumulation << ", clip " << clip);
        const auto want = reference_sgd(micro_rows * accumulation * world, steps, 1.0, clip);
        CHECK(hybrid_worst<S>(world, shard, accumulation, clip, want) < 1e-10);
      }
    }
  }
}

// One step's collectives of stage S at 4 ranks in shard groups of 2, by op and group.
struct Traffic {
  parallel::CommStats reduce_scatter_shard, all_reduce_replicas, all_gather_shard;
  parallel::CommStats reduce_scatter_world, all_gather_world;
  std::int64_t shard_bytes = 0;  // the units' shards, in bytes of double
  int units = 0;
};

template <int S>
Traffic hybrid_traffic(int accumulation) {
  return per_rank<Traffic>(4, [&](LocalComm& comm) {
    auto logger = std::make_shared<parallel::CommLogger>();
    comm.set_logger(logger);  // the engine's splits log into it too
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, comm, sgd_options(accumulation, 0.0, 2));
    logger->reset();
    const GlobalBatch b(micro_rows * accumulation * 4, 0, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, comm.rank(), 4));
      eng.backward();
    }
    eng.step();
    eng.synchronize();
    Traffic t;
    t.reduce_scatter_shard = logger->total(CommOp::reduce_scatter, "dp-shard");
    t.all_reduce_replicas = logger->total(CommOp::all_reduce, "dp-replicas");
    t.all_gather_shard = logger->total(CommOp::all_gather, "dp-shard");
    t.reduce_scatter_world = logger->total(CommOp::reduce_scatter, "world");
    t.all_gather_world = logger->total(CommOp::all_gather, "world");
    t.units = eng.num_units();
    for (int u = 0; u < eng.num_units(); ++u) {
      t.shard_bytes += eng.partition(u).shard_numel() * static_cast<std::int64_t>(sizeof(double));
    }
    comm.set_logger(nullptr);
    return t;
  })[0];
}

}  // namespace

TEST_CASE("Hybrid sharding: stage 1 in shard groups equals one process", "[unit][engine]") {
  check_hybrid_stage<1>();
}
TEST_CASE("Hybrid sharding: stage 2 in shard groups equals one process", "[unit][engine]") {
  check_hybrid_stage<2>();
}
TEST_CASE("Hybrid sharding: stage 3 in shard groups equals one process", "[unit][engine]") {
  check_hybrid_stage<3>();
}

TEST_CASE("Hybrid sharding: a wrong average over the replicas is caught", "[unit][engine]") {
  // Negative control: the same runs against a reference of another learning rate.
  const auto wrong = reference_sgd(micro_rows * 4, steps, 0.9, 0.0);
  CHECK(hybrid_worst<2>(4, 2, 1, 0.0, wrong) > 1e-3);
}

TEST_CASE(
    "Hybrid sharding: gathers and reduce-scatters stay in the shard group, each shard is "
    "averaged once over its replicas",
    "[unit][engine]") {
  // Stages 2-3 reduce every micro-step, stage 1 once a window: as many averages over the
  // replicas, each of one shard. Nothing is reduce-scattered or gathered over all 4 ranks.
  const auto check = [](auto stage_tag, int accumulation, int reductions_per_unit) {
    constexpr int S = decltype(stage_tag)::value;
    INFO("stage " << S << ", accumulation " << accumulation);
    const Traffic t = hybrid_traffic<S>(accumulation);
    CHECK(t.reduce_scatter_shard.count ==
          static_cast<std::uint64_t>(t.units * reductions_per_unit));
    CHECK(t.all_reduce_replicas.count == static_cast<std::uint64_t>(t.units * reductions_per_unit));
    CHECK(t.all_reduce_replicas.bytes ==
          static_cast<std::uint64_t>(t.shard_bytes * reductions_per_unit));
    CHECK(t.reduce_scatter_world.count == 0);
    CHECK(t.all_gather_world.count == 0);
    // Stages 1-2 gather every unit after the update, stage 3 every unit per forward and
    // backward as well (no unit persists): all in the shard group.
    CHECK(t.all_gather_shard.count >= static_cast<std::uint64_t>(t.units));
  };
  check(std::integral_constant<int, 1>{}, 3, 1);
  check(std::integral_constant<int, 2>{}, 3, 3);
  check(std::integral_constant<int, 3>{}, 2, 2);
}

TEST_CASE("Hybrid sharding: a rank holds the model states of plain ZeRO at shard_size ranks",
          "[unit][engine]") {
  const auto states = [](int world, int shard_size) {
    return per_rank<std::size_t>(world, [&](LocalComm& comm) {
      nn::GPT<float> model(tiny());
      engine::EngineOptions options = tiny_options();
      options.shard_size = shard_size;
      engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, comm, adamw_config(3, 1, 0.0),
                                                       options);
      return eng.memory_report().sharded_state_bytes();
    });
  };
  const auto hybrid = states(4, 2);
  const auto plain = states(2, 0);
  for (std::size_t r = 0; r < hybrid.size(); ++r) CHECK(hybrid[r] == plain[r % 2]);
  CHECK(states(4, 0)[0] < hybrid[0]);  // sharding over all 4 holds less
}

TEST_CASE("Hybrid sharding: a bad shard size is refused by name", "[unit][engine]") {
  const auto message = [](int world, int shard_size, auto stage_tag) {
    constexpr int S = decltype(stage_tag)::value;
    return per_rank<std::string>(world, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      return thrown_message(
          [&] { auto eng = sgd_engine<S>(model, comm, sgd_options(1, 0.0, shard_size)); });
    })[0];
  };
  CHECK_THAT(message(4, 3, std::integral_constant<int, 2>{}),
             Catch::Contains("shard_size (zero_optimization.mics_shard_size) 3 must divide the 4 "
                             "ranks of the dp group"));
  CHECK_THAT(message(2, 1, std::integral_constant<int, 0>{}),
             Catch::Contains("ZeRO stage 0 shards nothing"));
  // Ranks that disagree are refused before any group is split.
  const auto differing = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      auto eng = sgd_engine<2>(model, comm, sgd_options(1, 0.0, comm.rank() == 0 ? 1 : 2));
    });
  });
  CHECK_THAT(differing[0], Catch::Contains("shard_size"));
}

TEST_CASE("Hybrid sharding from a DeepSpeed config: mics_shard_size", "[unit][engine][config]") {
  const auto options = [](int stage, int size) {
    const Config c = Config::from_json_string(
        R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": )" +
        std::to_string(stage) + R"(, "mics_shard_size": )" + std::to_string(size) + "}}");
    return engine::EngineOptions{}.with_config(c, 4);
  };
  CHECK(options(3, 2).shard_size == 2);
  CHECK(options(1, 4).shard_size == 4);
  CHECK(options(3, -1).shard_size == 0);  // DeepSpeed's off
  CHECK(options(0, 2).shard_size == 0);   // stage 0 shards nothing: the key has no effect
  CHECK_THAT(thrown_message([&] { (void)options(3, -2); }),
             Catch::Contains("zero_optimization.mics_shard_size"));
}
