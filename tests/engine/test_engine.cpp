// The engine at ZeRO stages 0-3, world sizes 1, 2, 4 and gradient accumulation 1 and 3 on
// LocalComm: after several steps the parameters equal one process training on the global batch
// (f64, SGD with lr 1 so a missing or doubled reduction shows as an O(1) error; then with
// global-norm clipping), with a negative control; model-state memory and communication volume
// per rank follow the stage.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::thrown_message;

namespace {

constexpr int steps = 3;

template <int S>
double worst_over_ranks(int world, int accumulation, double clip,
                        const std::vector<std::vector<double>>& want) {
  std::vector<double> worst(static_cast<std::size_t>(world), 0.0);
  LocalComm::run(world, [&](LocalComm& comm) {
    worst[static_cast<std::size_t>(comm.rank())] =
        sgd_error<S>(comm, accumulation, steps, clip, want);
  });
  return *std::max_element(worst.begin(), worst.end());
}

template <int S>
void check_stage(double clip = 0.0) {
  for (int world : {1, 2, 4}) {
    for (int accumulation : {1, 3}) {
      INFO("stage " << S << " world " << world << " accumulation " << accumulation << " clip "
                    << clip);
      const auto want = reference_sgd(micro_rows * accumulation * world, steps, 1.0, clip);
      CHECK(worst_over_ranks<S>(world, accumulation, clip, want) < 1e-10);
    }
  }
}

}  // namespace

TEST_CASE("stage 0 equals the single-process reference", "[unit][engine]") {
  check_stage<0>();
}
TEST_CASE("stage 1 equals the single-process reference", "[unit][engine]") {
  check_stage<1>();
}
TEST_CASE("stage 2 equals the single-process reference", "[unit][engine]") {
  check_stage<2>();
}
TEST_CASE("stage 3 equals the single-process reference", "[unit][engine]") {
  check_stage<3>();
}
TEST_CASE("global-norm clipping across ranks equals the single-process reference",
          "[unit][engine]") {
  // A max norm well below the gradient norm, so every step is clipped.
  check_stage<0>(0.05);
  check_stage<2>(0.05);
  check_stage<3>(0.05);
}

TEST_CASE(
    "with dropout, ranks and micro-batches that say where their rows sit equal one process on the "
    "whole batch",
    "[unit][engine]") {
  // Dropout masks follow the optimizer step and each row's place in the step's global batch
  // (MicroBatch::first_row), so world 2 or 4 and accumulation 2 draw the masks of one process on
  // the whole batch: residual, embedding and attention dropout at once.
  nn::GPTConfig cfg = tiny();
  cfg.dropout = 0.2f;
  cfg.attn_dropout = 0.2f;
  auto worst = [&](int stage, int world, int accumulation, bool placed,
                   const std::vector<std::vector<double>>& want) {
    std::vector<double> w(static_cast<std::size_t>(world), 0.0);
    LocalComm::run(world, [&](LocalComm& comm) {
      w[static_cast<std::size_t>(comm.rank())] = with_stage(stage, [&](auto s) {
        return sgd_error<decltype(s)::value>(comm, accumulation, steps, 0.0, want, cfg, placed);
      });
    });
    return *std::max_element(w.begin(), w.end());
  };
  for (const auto& [world, accumulation] :
       {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}, std::pair{2, 2}, std::pair{4, 1}}) {
    const auto want = reference_sgd(micro_rows * accumulation * world, steps, 1.0, 0.0, cfg);
    for (const int stage : {0, 3}) {
      INFO("stage " << stage << " world " << world << " accumulation " << accumulation);
      CHECK(worst(stage, world, accumulation, true, want) < 1e-10);
    }
  }
  // Negative controls: micro-batches that do not say where their rows sit draw each micro-step's
  // masks from its local rows, which one process on the whole batch does not; and the reference
  // without dropout differs from the runs with it.
  const auto want = reference_sgd(micro_rows * 2, steps, 1.0, 0.0, cfg);
  CHECK(worst(0, 2, 1, false, want) > 1e-6);
  CHECK(worst(0, 1, 2, false, want) > 1e-6);
  CHECK(worst(0, 2, 1, true, reference_sgd(micro_rows * 2, steps, 1.0)) > 1e-6);
}

TEST_CASE("a wrong reference is caught (negative control)", "[unit][engine]") {
  const auto wrong = reference_sgd(micro_rows * 2, steps, 0.5);  // half the learning rate
  CHECK(worst_over_ranks<3>(2, 1, 0.0, wrong) > 1e-3);
  const auto unclipped = reference_sgd(micro_rows * 2, steps, 1.0);  // clipping forgotten
  CHECK(worst_over_ranks<2>(2, 1, 0.05, unclipped) > 1e-3);
}

TEST_CASE("a run that cannot be compared says why instead of returning a large error",
          "[unit][engine]") {
  // max_error(accumulation) on an engine built with another accumulation, or against a
  // reference with a unit short or missing: each rank names what went wrong.
  const auto want = reference_sgd(micro_rows * 2, 1, 1.0);
  auto messages = [&](int engine_accumulation, int compared_accumulation,
                      const std::vector<std::vector<double>>& reference) {
    return per_rank<std::string>(2, [&](LocalComm& comm) {
      return thrown_message([&] {
        nn::GPT<double> model(tiny());
        engine::EngineOptions options;
        options.gradient_accumulation_steps = engine_accumulation;
        options.activation_bytes = 32 << 20;
        engine::Engine<nn::GPT<double>, ZeroStage<0>> eng(
            model, comm,
            [](int, std::span<double> p, std::span<const double> g) { sgd(1.0, p, g); }, options);
        (void)max_error(eng, comm, compared_accumulation, 1, reference);
      });
    });
  };
  const auto boundary = messages(2, 1, want);
  auto short_unit = want;
  short_unit[0].pop_back();
  const auto sizes = messages(1, 1, short_unit);
  auto missing_unit = want;
  missing_unit.pop_back();
  const auto units = messages(1, 1, missing_unit);
  const std::string n0 = std::to_string(want[0].size()), n1 = std::to_string(want[0].size() - 1);
  for (int r = 0; r < 2; ++r) {
    const auto rank = "rank " + std::to_string(r) + " of 2";
    CHECK_THAT(boundary[static_cast<std::size_t>(r)],
               Catch::Contains(rank) && Catch::Contains("step 0, micro-step 0 of 1") &&
                   Catch::Contains("step() returned false"));
    CHECK_THAT(sizes[static_cast<std::size_t>(r)],
               Catch::Contains(rank) && Catch::Contains("unit 0 has " + n0 + " elements") &&
                   Catch::Contains("the reference " + n1));
    CHECK_THAT(units[static_cast<std::size_t>(r)],
               Catch::Contains(rank) &&
                   Catch::Contains("units, the reference " + std::to_string(missing_unit.size())));
  }
  // Negative control: a comparable run throws nothing.
  CHECK(messages(1, 1, want) == std::vector<std::string>(2, std::string(testing::nothing_thrown)));
}

TEST_CASE("model-state memory per rank shrinks with the stage", "[unit][engine]") {
  std::vector<std::size_t> totals;
  auto measure = [&](auto stage_tag) {
    constexpr int S = decltype(stage_tag)::stage;
    std::size_t bytes = 0;
    LocalComm::run(4, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      engine::EngineOptions options;
      options.persistence_threshold = 0;  // tiny units would otherwise stay gathered
      engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double>, std::span<const double>) {}, options);
      if (comm.rank() == 0) bytes = eng.memory_report().total();
    });
    totals.push_back(bytes);
  };
  measure(ZeroStage<0>{});
  measure(ZeroStage<1>{});
  measure(ZeroStage<3>{});
  const double psi = static_cast<double>(test::tiny().num_parameters()) * sizeof(double);
  CHECK(totals[0] >= 2 * psi);          // whole params and grads
  CHECK(totals[1] > totals[0]);         // + master and grad shards (the optimizer side)
  CHECK(totals[2] < 0.35 * totals[1]);  // stage 3 outside a step: shards only (+ pinned wte)
}

TEST_CASE("communication per step: 2 psi at stages 0-2, 3 psi at stage 3 (bus bytes)",
          "[unit][engine]") {
  using parallel::CommLogger;
  using parallel::CommOp;
  const int world = 4;
  auto bus_bytes_per_step = [&](auto stage_tag, double& psi_bytes, double& unit0_bytes) {
    constexpr int S = decltype(stage_tag)::stage;
    double bus = 0;
    LocalComm::run(world, [&](LocalComm& comm) {
      auto logger = std::make_shared<CommLogger>(false);
      comm.set_logger(logger);
      nn::GPT<double> model(tiny());
      engine::EngineOptions options;
      options.persistence_threshold = 0;  // every stage-3 unit is gathered per use
      engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(0.1, p, g); },
          options);
      const GlobalBatch b(2 * world, 0, tiny().vocab_size);
      const std::int64_t first = comm.rank() * 2;
      logger->enable();
      eng.forward({b.tokens.data() + first * seq, b.targets.data() + first * seq, 2, seq});
      eng.backward();
      eng.step();
      eng.synchronize();  // the step's parameter gathers run on until the next forward
      logger->enable(false);
      if (comm.rank() == 0) {
        bus = logger->total().bus_bytes;
        psi_bytes = 0;
        for (int u = 0; u < model.num_units(); ++u) {
          psi_bytes += static_cast<double>(eng.partition(u).padded_numel()) * sizeof(double);
        }
        unit0_bytes = static_cast<double>(eng.partition(0).padded_numel()) * sizeof(double);
      }
    });
    return bus;
  };
  double psi = 0, unit0 = 0;
  const double ring = double(world - 1) / world;
  // Every boundary also all-reduces 2 doubles: the gradient sum of squares and the count of
  // non-finite losses.
  const double stats = 2 * ring * 2 * sizeof(double);
  for (double bus : {bus_bytes_per_step(ZeroStage<0>{}, psi, unit0),
                     bus_bytes_per_step(ZeroStage<1>{}, psi, unit0),
                     bus_bytes_per_step(ZeroStage<2>{}, psi, unit0)}) {
    CHECK(bus == Approx(2 * ring * psi + stats).epsilon(1e-12));
  }
  // Stage 3 gathers every unit before forward and backward and reduce-scatters its gradient;
  // the tied embedding stays gathered from its forward to its backward, so it is gathered once.
  const double bus3 = bus_bytes_per_step(ZeroStage<3>{}, psi, unit0);
  CHECK(bus3 == Approx(ring * (3 * psi - unit0) + stats).epsilon(1e-12));
}
