// The mixture-of-experts GPT over MpiComm (mpiexec at 2 and 4 ranks): every ep that divides the
// world, at stages 0-3, equals the single-process reference (f64 AdamW with clipping, tokens
// dropped); each rank checks its own parts of the whole tensors.
#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/process_groups.hpp>
#include <zero/engine/engine.hpp>

#include "engine_mpi_util.hpp"
#include "moe_test_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

template <int S>
double moe_error(int ep, const LogicalValues& want, int accumulation, int steps) {
  const int dp = world().size() / ep;
  parallel::ProcessGroups<parallel::MpiComm> groups(world(), parallel::Grid({.ep = ep, .dp = dp}));
  nn::GPT<double> model(moe_cfg(), {}, {}, moe_blocks(parallel::ExpertParallel(groups.ep())));
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, AdamW64{},
                                                    tp_options(accumulation));
  train(eng, groups.get({parallel::Axis::ep, parallel::Axis::dp}).rank(), world().size(),
        accumulation, steps, moe_cfg().vocab_size);
  return max_part_difference(held_params(eng), want);
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("MpiComm: the mixture-of-experts GPT equals the single-process reference",
                       "[mpi][engine][moe]", ((int S), S), 0, 1, 2, 3) {
  const int accumulation = 2, steps = 2;
  std::int64_t dropped = 0;
  const auto want = moe_reference(world().size(), accumulation, steps, &dropped);
  CHECK(dropped > 0);
  for (int ep : {1, 2, 4}) {
    if (world().size() % ep != 0) continue;
    INFO("stage " << S << " ep " << ep << " dp " << world().size() / ep);
    CHECK(worst(moe_error<S>(ep, want, accumulation, steps)) <= 1e-10);
  }
}
