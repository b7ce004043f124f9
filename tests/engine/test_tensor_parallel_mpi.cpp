// The tensor-parallel GPT over MpiComm (mpiexec at 2 and 4 ranks): every tp that divides the
// world, with and without sequence parallelism, at stages 0-3, equals the single-process
// reference (f64 AdamW with clipping); each rank checks its own parts of the whole tensors.
#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine.hpp>

#include "engine_mpi_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

template <int S>
double tp_error(int tp, bool sp, const LogicalValues& want, int accumulation, int steps) {
  parallel::ProcessGroups<parallel::MpiComm> groups(
      world(), parallel::Grid({.tp = tp, .dp = world().size() / tp}));
  nn::GPT<double> model(tp_tiny(), parallel::TensorParallel(groups.tp(), sp));
  const engine::EngineOptions options = tp_options(accumulation);
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, AdamW64{}, options);
  train(eng, groups.dp().rank(), groups.dp().size(), accumulation, steps, tp_tiny().vocab_size);
  return max_part_difference(held_params(eng), want);
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("MpiComm: the tensor-parallel GPT equals the single-process reference",
                       "[mpi][engine][tp]", ((int S), S), 0, 1, 2, 3) {
  const int accumulation = 2, steps = 2;
  for (int tp : {2, 4}) {
    if (world().size() % tp != 0) continue;
    const int dp = world().size() / tp;
    const auto want = reference<double>(tp_tiny(), micro_rows * accumulation * dp, steps);
    for (bool sp : {false, true}) {
      INFO("stage " << S << " tp " << tp << " dp " << dp << (sp ? " SP" : ""));
      CHECK(worst(tp_error<S>(tp, sp, want, accumulation, steps)) <= 1e-10);
    }
  }
}
