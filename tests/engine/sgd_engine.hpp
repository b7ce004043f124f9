#pragma once
// sgd_engine<S>: ZeRO stage S over an f64 GPT with SGD at lr 1 (the optimizer of the f64
// reference runs, reference_sgd) on comm, under options (sgd_options, say). The hybrid-sharding
// and ZeRO++ tests build their engines with it.

#include <span>

#include <zero/engine/engine.hpp>

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

}  // namespace zero::test
