// Pipeline parallelism over MpiComm (mpiexec at 2, 4 and 8 ranks): every (tp, dp, pp) layout the
// world allows, 1F1B and interleaved, with ZeRO-1, equals the single-process reference (f64
// AdamW with clipping); each rank checks its own parts (the last stage's replica of the token
// table against the whole table too).
#include <catch2/catch.hpp>

#include <vector>

#include <parallel/comm/mpi_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>

#include "engine_mpi_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using namespace zero::test;
using parallel::pipeline::ScheduleKind;

namespace {

nn::GPTConfig mpi_pp_model() {
  nn::GPTConfig c = tp_tiny();
  c.num_layers = 6;  // 8 units: pp 8, or pp 4 x 2 virtual stages
  return c;
}

double pipeline_error(int tp, int pp, ScheduleKind kind, int micro_batches, int steps) {
  const int dp = world().size() / (tp * pp);
  parallel::ProcessGroups<parallel::MpiComm> groups(world(),
                                                    parallel::Grid({.tp = tp, .dp = dp, .pp = pp}));
  nn::GPT<double> model(mpi_pp_model(), parallel::TensorParallel(groups.tp()));
  parallel::pipeline::PipelineOptions options;
  options.schedule = kind;
  options.virtual_stages = kind == ScheduleKind::interleaved ? 2 : 1;
  options.partition_method = "uniform";
  parallel::pipeline::PipelineEngine<nn::GPT<double>, ZeroStage<1>> pipe(
      model, world(), groups, AdamW64{}, options, tp_options(micro_batches));
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(micro_rows * micro_batches * dp, step, mpi_pp_model().vocab_size);
    std::vector<engine::MicroBatch> batches;
    for (int m = 0; m < micro_batches; ++m) {
      batches.push_back(b.micro(m, groups.dp().rank(), dp));
    }
    pipe.train_batch(batches);
  }
  return max_part_difference(
      held_params(pipe.engine()),
      reference<double>(mpi_pp_model(), micro_rows * micro_batches * dp, steps));
}

}  // namespace

TEST_CASE("MpiComm: pipeline layouts (tp x dp x pp) with ZeRO-1 equal the reference",
          "[mpi][engine][pipeline]") {
  const int micro_batches = 4, steps = 2;
  for (int pp : {2, 4, 8}) {
    for (int tp : {1, 2}) {
      if (world().size() % (pp * tp) != 0) continue;
      for (ScheduleKind kind :
           {ScheduleKind::one_f_one_b, ScheduleKind::interleaved, ScheduleKind::zero_bubble}) {
        if (kind == ScheduleKind::interleaved && pp * 2 > 8) continue;
        INFO("tp " << tp << " pp " << pp << " dp " << world().size() / (pp * tp) << " "
                   << name_of(kind));
        CHECK(worst(pipeline_error(tp, pp, kind, micro_batches, steps)) <= 1e-10);
      }
    }
  }
}
