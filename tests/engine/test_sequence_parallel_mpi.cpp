// The Ulysses sequence-parallel GPT over MpiComm (mpiexec at 2 and 4 ranks): sp 2 with the rest
// of the world data parallel, at stages 0-3, equals the single-process reference on the global
// batch (f64 AdamW with clipping); each rank checks its own copy of the whole tensors.
#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/engine/engine.hpp>

#include "engine_mpi_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

template <int S>
double ulysses_error(int sp, const LogicalValues& want, int accumulation, int steps) {
  const int dp = world().size() / sp;
  parallel::ProcessGroups<parallel::MpiComm> groups(world(), parallel::Grid({.cp = sp, .dp = dp}));
  const parallel::SequenceParallel group(groups.cp());
  nn::GPT<double> model(tp_tiny(), {}, group);
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, groups, AdamW64{},
                                                    tp_options(accumulation));
  const std::int64_t global_rows = micro_rows * accumulation * dp;
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(global_rows, step, tp_tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      const engine::MicroBatch whole = b.micro(m, groups.dp().rank(), dp);
      const parallel::SequenceSlice mine(whole.tokens, whole.targets, whole.batch, whole.seq_len,
                                         group);
      eng.forward({mine.tokens.data(), mine.targets.data(), mine.batch, mine.seq_len});
      eng.backward();
      eng.step();
    }
  }
  return max_part_difference(held_params(eng), want);
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("MpiComm: the Ulysses sequence-parallel GPT equals the reference",
                       "[mpi][engine][ulysses]", ((int S), S), 0, 1, 2, 3) {
  const int accumulation = 2, steps = 2, sp = 2;  // GlobalBatch's seq 6 splits in 2
  const int dp = world().size() / sp;
  const auto want = reference<double>(tp_tiny(), micro_rows * accumulation * dp, steps);
  INFO("stage " << S << " sp " << sp << " dp " << dp);
  CHECK(worst(ulysses_error<S>(sp, want, accumulation, steps)) <= 1e-10);
}
