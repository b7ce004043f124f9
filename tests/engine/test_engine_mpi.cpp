// The engine over MpiComm (run by mpiexec at 2 and 4 ranks): stages 0-3 with gradient
// accumulation 1 and 3 equal the single-process reference (f64 SGD, lr 1), AdamW from a
// DeepSpeed config equals one process with the same optimizer, hybrid sharding (shard groups of
// half the ranks) equals it too, as does stage 3 under ZeRO++ hpZ; ZeRO++ qgZ's int8 (and int4)
// all-to-alls over MPI train near it, the same at stages 2 and 3; and a checkpoint saved by all
// ranks loads back at another stage. With Offload<NVMe> at stage 3 each process reads its master
// slices ahead of their gathers from its own files, and the ranks' gathers stay in step.
#include <algorithm>
#include <filesystem>
#include <string>
#include <type_traits>

#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>

#include "../support/temp_dir.hpp"
#include "engine_mpi_util.hpp"
#include "engine_test_util.hpp"
#include "sgd_engine.hpp"

using namespace zero;
using namespace zero::test;

namespace {

template <int S>
void check_stage() {
  for (int accumulation : {1, 3}) {
    INFO("stage " << S << " ranks " << world().size() << " accumulation " << accumulation);
    const auto want = reference_sgd(micro_rows * accumulation * world().size(), 3, 1.0);
    CHECK(worst(sgd_error<S>(world(), accumulation, 3, 0.0, want)) < 1e-10);
    const auto wrong = reference_sgd(micro_rows * accumulation * world().size(), 3, 0.5);
    CHECK(worst(sgd_error<S>(world(), accumulation, 3, 0.0, wrong)) > 1e-3);
  }
}

}  // namespace

TEST_CASE("MpiComm: stage 0 equals the single-process reference", "[mpi][engine]") {
  check_stage<0>();
}
TEST_CASE("MpiComm: stage 1 equals the single-process reference", "[mpi][engine]") {
  check_stage<1>();
}
TEST_CASE("MpiComm: stage 2 equals the single-process reference", "[mpi][engine]") {
  check_stage<2>();
}
TEST_CASE("MpiComm: stage 3 equals the single-process reference", "[mpi][engine]") {
  check_stage<3>();
}

TEST_CASE("MpiComm: hybrid sharding at stages 1-3 equals the single-process reference",
          "[mpi][engine]") {
  // Shard groups of half the ranks (2 ranks: groups of 1, all replicas; 4: 2 groups of 2), the
  // replica all-reduces on a second MPI communicator beside the shard group's reduce-scatters.
  const int shard = world().size() / 2;
  const auto check = [&]<int S>(std::integral_constant<int, S>) {
    for (double clip : {0.0, 0.05}) {
      INFO("stage " << S << " ranks " << world().size() << " shard " << shard << " clip " << clip);
      const auto want = reference_sgd(micro_rows * 3 * world().size(), 3, 1.0, clip);
      CHECK(worst(sgd_error<S>(world(), 3, 3, clip, want, tiny(), false, shard)) < 1e-10);
    }
  };
  check(std::integral_constant<int, 1>{});
  check(std::integral_constant<int, 2>{});
  check(std::integral_constant<int, 3>{});
}

TEST_CASE("MpiComm: hpZ at stage 3 equals the single-process reference", "[mpi][engine]") {
  // Secondary groups of 2 (at 2 ranks a group of 2 is the whole one: no secondary group, plain
  // stage 3 through the same path; at 4 the backward gathers over a second MPI communicator).
  for (double clip : {0.0, 0.05}) {
    INFO("ranks " << world().size() << " clip " << clip);
    const auto want = reference_sgd(micro_rows * 3 * world().size(), 3, 1.0, clip);
    CHECK(worst(sgd_error<3>(world(), 3, 3, clip, want, tiny(), false, 0, 2)) < 1e-10);
  }
}

TEST_CASE("MpiComm: qgZ at stages 2-3 trains near the single-process reference, at 8 and 4 bits",
          "[mpi][engine]") {
  // The packed runs cross processes by MPI_Alltoall of bytes; each rank averages what it got.
  const auto want = reference_sgd(micro_rows * 2 * world().size(), 3, 1.0, 0.05);
  engine::EngineOptions options = sgd_options(2, 0.05);
  options.quantized_gradients = true;
  const auto trained = [&]<int S>(std::integral_constant<int, S>) {
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, world(), options);
    const double error = max_error(eng, world(), 2, 3, want);
    return std::pair{error, all_unit_values(eng)};
  };
  const auto [two, two_values] = trained(std::integral_constant<int, 2>{});
  const auto [three, three_values] = trained(std::integral_constant<int, 3>{});
  INFO("ranks " << world().size() << ": stage 2 " << two << ", stage 3 " << three);
  CHECK(worst(two) > 1e-6);  // the gradients were rounded
  CHECK(worst(two) < 1e-2);
  CHECK(two_values == three_values);
  // Under hpZ's groups of 2 (at 4 ranks: two hops, the second over an MPI communicator across
  // the pairs; at 2, one group, one hop).
  options.hpz_size = 2;
  nn::GPT<double> model(tiny());
  auto eng = sgd_engine<3>(model, world(), options);
  const double hops = worst(max_error(eng, world(), 2, 3, want));
  INFO("under hpZ " << hops);
  CHECK(hops > 1e-6);
  CHECK(hops < 1e-2);
  // At 4 bits (DeepSpeed's width), under the same groups.
  options.quantized_gradient_bits = 4;
  nn::GPT<double> model4(tiny());
  auto eng4 = sgd_engine<3>(model4, world(), options);
  const double four = worst(max_error(eng4, world(), 2, 3, want));
  INFO("at 4 bits " << four);
  CHECK(four > hops);
  CHECK(four < 0.1);
}

TEST_CASE("MpiComm: AdamW from a config equals one process with the same optimizer",
          "[mpi][engine]") {
  const auto want = reference_adamw(micro_rows * 2 * world().size(), 3, adamw_hyper(), 1.0);
  CHECK(worst(adamw_error<3>(world(), 2, 3, 1.0, want)) < 2e-5);
  CHECK(worst(adamw_error<1>(world(), 2, 3, 1.0, want)) < 2e-5);
}

TEST_CASE("MpiComm: Offload<NVMe> at stage 3, its slices read ahead, equals one process",
          "[mpi][engine]") {
  const auto want = reference_adamw(micro_rows * 2 * world().size(), 3, adamw_hyper(), 1.0);
  const zero::testing::TempDir nvme("mpi-nvme", "/var/tmp");  // each process its own
  Config cfg = adamw_config(3, 2, 1.0);
  cfg.zero_optimization.offload_optimizer.device = OffloadDevice::nvme;
  cfg.zero_optimization.offload_optimizer.nvme_path = nvme.path().string();
  cfg.zero_optimization.offload_optimizer.buffer_count = 4;
  cfg.zero_optimization.stage3_param_persistence_threshold = 0;  // every unit read from files
  nn::GPT<float> model(tiny());
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  engine::Engine<nn::GPT<float>, ZeroStage<3>, Offload<NVMe>> eng(model, world(), cfg, options);
  CHECK(worst(max_error(eng, world(), 2, 3, want)) < 2e-5);
  // Every rank found slices read ahead and handed over by its step passes: a rank whose prefetch
  // had decided otherwise would have started its gathers in another order and timed out.
  const auto reads = eng.nvme_read_stats();
  std::vector<double> used{static_cast<double>(reads.read_ahead),
                           static_cast<double>(reads.handed_over)};
  world().all_reduce(std::span<double>(used), parallel::ReduceOp::min);
  CHECK(used[0] > 0);
  CHECK(used[1] > 0);
}
