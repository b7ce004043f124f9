// The engine at ZeRO stages 0-3, world sizes 1, 2, 4 and gradient accumulation 1 and 3 on
// LocalComm: after several steps the parameters equal one process training on the global batch
// (f64, SGD with lr 1 so a missing or doubled reduction shows as an O(1) error), with a negative
// control; model-state memory per rank follows the stage.
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch.hpp>

#include <memory>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

using namespace zero;
using zero::parallel::LocalComm;

namespace {

constexpr std::int64_t seq = 6;
constexpr int steps = 3;

nn::GPTConfig tiny() {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");
  c.num_layers = 2;
  return c;
}

// Rows of the global batch of a step: tokens and targets [rows, seq], every target valid.
struct GlobalBatch {
  std::vector<std::int32_t> tokens, targets;
  GlobalBatch(std::int64_t rows, int step, std::int64_t vocab) {
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      tokens.push_back(static_cast<std::int32_t>((i * 7 + step * 13 + 1) % vocab));
      targets.push_back(static_cast<std::int32_t>((i * 11 + step * 5 + 3) % vocab));
    }
  }
};

void sgd(double lr, std::span<double> p, std::span<const double> g) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
}

// Single process on the whole global batch: the reference.
std::vector<std::vector<double>> reference(std::int64_t global_rows, double lr) {
  nn::GPT<double> model(tiny());
  nn::LocalParameters<nn::GPT<double>> params(model, 1234);
  Arena<> arena(64 << 20);
  for (int step = 0; step < steps; ++step) {
    params.zero_grads();
    const GlobalBatch b(global_rows, step, tiny().vocab_size);
    nn::StepContext<double> ctx;
    ctx.arena = &arena;
    ctx.tokens = b.tokens.data();
    ctx.targets = b.targets.data();
    ctx.batch = global_rows;
    ctx.seq_len = seq;
    model.forward(ctx);
    model.backward(ctx);
    arena.reset();
    for (int u = 0; u < model.num_units(); ++u) {
      sgd(lr, params.unit_values(u).span(), params.unit_grads(u).span());
    }
  }
  std::vector<std::vector<double>> out;
  for (int u = 0; u < model.num_units(); ++u) {
    const auto v = params.unit_values(u);
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

template <int S>
double max_error_vs_reference(int world, int accumulation,
                              const std::vector<std::vector<double>>& want) {
  const std::int64_t micro_rows = 2;
  const std::int64_t global_rows = micro_rows * accumulation * world;
  std::vector<double> worst(static_cast<std::size_t>(world), 0.0);
  LocalComm::run(world, [&](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    engine::EngineOptions options;
    options.gradient_accumulation_steps = accumulation;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<double>, LocalComm, ZeroStage<S>> eng(
        model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(1.0, p, g); },
        options);
    for (int step = 0; step < steps; ++step) {
      const GlobalBatch b(global_rows, step, tiny().vocab_size);
      for (int m = 0; m < accumulation; ++m) {
        // Any fixed split of the global rows works; this one interleaves micro-steps and ranks.
        const std::int64_t first = (m * world + comm.rank()) * micro_rows;
        engine::MicroBatch mb{b.tokens.data() + first * seq, b.targets.data() + first * seq,
                              micro_rows, seq};
        eng.forward(mb);
        eng.backward();
        REQUIRE(eng.step() == (m + 1 == accumulation));
      }
    }
    double w = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      const auto got = eng.gather_unit_values(u);
      const auto& ref = want[static_cast<std::size_t>(u)];
      REQUIRE(got.size() == ref.size());
      for (std::size_t i = 0; i < got.size(); ++i) w = std::max(w, std::fabs(got[i] - ref[i]));
    }
    worst[static_cast<std::size_t>(comm.rank())] = w;
  });
  return *std::max_element(worst.begin(), worst.end());
}

template <int S>
void check_stage() {
  for (int world : {1, 2, 4}) {
    for (int accumulation : {1, 3}) {
      INFO("stage " << S << " world " << world << " accumulation " << accumulation);
      const auto want = reference(2 * accumulation * world, 1.0);
      CHECK(max_error_vs_reference<S>(world, accumulation, want) < 1e-10);
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

TEST_CASE("a wrong reference is caught (negative control)", "[unit][engine]") {
  const auto wrong = reference(2 * 2, 0.5);  // half the learning rate
  CHECK(max_error_vs_reference<3>(2, 1, wrong) > 1e-3);
}

TEST_CASE("model-state memory per rank shrinks with the stage", "[unit][engine]") {
  std::vector<std::size_t> totals;
  auto measure = [&](auto stage_tag) {
    constexpr int S = decltype(stage_tag)::stage;
    std::size_t bytes = 0;
    LocalComm::run(4, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      engine::Engine<nn::GPT<double>, LocalComm, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double>, std::span<const double>) {});
      if (comm.rank() == 0) bytes = eng.memory_report().total();
    });
    totals.push_back(bytes);
  };
  measure(ZeroStage<0>{});
  measure(ZeroStage<1>{});
  measure(ZeroStage<3>{});
  const double psi = static_cast<double>(tiny().num_parameters()) * sizeof(double);
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
      engine::Engine<nn::GPT<double>, LocalComm, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(0.1, p, g); });
      const GlobalBatch b(2 * world, 0, tiny().vocab_size);
      const std::int64_t first = comm.rank() * 2;
      logger->enable();
      eng.forward({b.tokens.data() + first * seq, b.targets.data() + first * seq, 2, seq});
      eng.backward();
      eng.step();
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
  for (double bus : {bus_bytes_per_step(ZeroStage<0>{}, psi, unit0),
                     bus_bytes_per_step(ZeroStage<1>{}, psi, unit0),
                     bus_bytes_per_step(ZeroStage<2>{}, psi, unit0)}) {
    CHECK(bus == Approx(2 * ring * psi).epsilon(1e-12));
  }
  // Stage 3 gathers every unit before forward and backward and reduce-scatters its gradient;
  // the tied embedding stays gathered from its forward to its backward, so it is gathered once.
  const double bus3 = bus_bytes_per_step(ZeroStage<3>{}, psi, unit0);
  CHECK(bus3 == Approx(ring * (3 * psi - unit0)).epsilon(1e-12));
}
