#pragma once
// sgd_engine<S>: ZeRO stage S over an f64 GPT with SGD at lr 1 (the optimizer of the f64
// reference runs, reference_sgd) on comm, under options (sgd_options, say). The hybrid-sharding
// and ZeRO++ tests build their engines with it; sgd_trained and one_step_traffic run them over
// LocalComm, and random_values makes inputs for the int8 packing.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/core/rng.hpp>
#include <zero/engine/engine.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"

namespace zero::test {

template <int S>
using SgdEngine = engine::Engine<nn::GPT<double>, ZeroStage<S>>;

template <int S, class Comm>
SgdEngine<S> sgd_engine(nn::GPT<double>& model, Comm& comm, const engine::EngineOptions& options) {
  return SgdEngine<S>(
      model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(1.0, p, g); },
      options);
}

/// Every rank's units after `steps` steps of stage S at world LocalComm ranks under options
/// (options.gradient_accumulation_steps micro-batches a step).
template <int S>
std::vector<std::vector<double>> sgd_trained(int world, int steps,
                                             const engine::EngineOptions& options) {
  return testing::per_rank<std::vector<double>>(world, [&](parallel::LocalComm& comm) {
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, comm, options);
    const int accumulation = options.gradient_accumulation_steps, ranks = comm.size();
    for (int step = 0; step < steps; ++step) {
      const GlobalBatch b(micro_rows * accumulation * ranks, step, tiny().vocab_size);
      for (int m = 0; m < accumulation; ++m) {
        eng.forward(b.micro(m, comm.rank(), ranks));
        eng.backward();
      }
      eng.step();
    }
    eng.synchronize();
    return all_unit_values(eng);
  });
}

/// Rank 0's totals of each (op, group name) over one step of one micro-batch at stage S on world
/// LocalComm ranks under options (the engine's setup not counted).
template <int S>
std::vector<parallel::CommStats> one_step_traffic(
    int world, const engine::EngineOptions& options,
    const std::vector<std::pair<parallel::CommOp, std::string>>& totals) {
  return testing::per_rank<std::vector<parallel::CommStats>>(world, [&](parallel::LocalComm& comm) {
    auto logger = std::make_shared<parallel::CommLogger>();
    comm.set_logger(logger);
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, comm, options);
    logger->reset();
    const GlobalBatch b(micro_rows * world, 0, tiny().vocab_size);
    eng.forward(b.micro(0, comm.rank(), world));
    eng.backward();
    eng.step();
    eng.synchronize();
    std::vector<parallel::CommStats> out;
    for (const auto& [op, group] : totals) out.push_back(logger->total(op, group));
    comm.set_logger(nullptr);
    return out;
  })[0];
}

/// n values uniform in [-scale, scale), from seed.
inline std::vector<float> random_values(std::size_t n, float scale, std::uint64_t seed) {
  std::vector<float> v(n);
  const CounterRng rng(seed);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = scale * static_cast<float>(rng.uniform(i) * 2.0 - 1.0);
  }
  return v;
}

}  // namespace zero::test
