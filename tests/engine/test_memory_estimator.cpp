// The memory estimator against real engines: at every stage, in f32 and bf16, the estimate of
// model-state bytes at rest equals what memory_report() measures (given the padded parameter
// count), and the formulas have the shape of the ZeRO paper and of DeepSpeed's estimators.
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/engine/memory_estimator.hpp>

#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "toy_model.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;

namespace {

template <class Model, int S, class... Extra>
void check_against_engine(const Config& cfg, DType precision,
                          OffloadDevice offload = OffloadDevice::none) {
  const int world = 4;
  engine::MemoryReport measured;
  std::int64_t padded = 0, largest = 0;
  LocalComm::run(world, [&](LocalComm& comm) {
    Model model = [] {
      if constexpr (std::is_same_v<Model, nn::GPT<float>>) {
        return Model(tiny());
      } else {
        return Model();
      }
    }();
    engine::Engine<Model, ZeroStage<S>, Extra...> eng(model, comm, cfg);
    if (comm.rank() == 0) {
      measured = eng.memory_report();
      for (int u = 0; u < eng.num_units(); ++u) {
        padded += eng.partition(u).padded_numel();
        largest = std::max(largest, eng.partition(u).padded_numel());
      }
    }
  });
  engine::MemoryEstimateInput in;
  in.params = padded;
  in.largest_unit_params = largest;
  in.gpus_per_node = world;
  in.stage = S;
  in.precision = precision;
  in.offload_optimizer = offload;
  if (cfg.optimizer) in.optimizer_state_bytes = engine::optimizer_state_bytes(*cfg.optimizer);
  const auto e = engine::estimate_model_states(in);
  INFO("stage " << S << " precision " << name_of(precision));
  // Pooled gather/reduce scratch is working memory (unit-sized), not state at rest. With
  // Compute<Host> the estimate's device and host memory are the same memory (the fp32 gradient
  // shard, which NVMe offload keeps in host memory, is counted by the estimator as host).
  CHECK(static_cast<double>(measured.total() - measured.scratch_bytes) ==
        e.device_at_rest + e.host);
  if (offload == OffloadDevice::nvme) {
    // Swap buffers (one largest unit slice of master + 2 states each) are scratch too; the
    // files hold the estimate plus alignment padding (under one 4 KiB block per tensor).
    CHECK(static_cast<double>(measured.offloaded_bytes) >= e.nvme);
    CHECK(static_cast<double>(measured.offloaded_bytes) <= e.nvme + 3.0 * 4096 * 64);
  } else {
    CHECK(static_cast<double>(measured.scratch_bytes) <= 2 * static_cast<double>(largest) * 4);
  }
}

Config toy_config(int stage, bool bf16) {
  Config c = Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": )" +
      std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0}})");
  c.bf16_enabled = bf16;
  return c;
}

}  // namespace

TEST_CASE("the estimator equals memory_report() at rest (f32 GPT, bf16 toy)", "[unit][engine]") {
  check_against_engine<nn::GPT<float>, 0>(adamw_config(0, 1, 0), DType::f32);
  check_against_engine<nn::GPT<float>, 1>(adamw_config(1, 1, 0), DType::f32);
  check_against_engine<nn::GPT<float>, 2>(adamw_config(2, 1, 0), DType::f32);
  check_against_engine<nn::GPT<float>, 3>(adamw_config(3, 1, 0), DType::f32);
  // RMSprop, centered with momentum: three states (it was counted as one).
  Config rmsprop = adamw_config(1, 1, 0);
  rmsprop.optimizer->type = "RMSprop";
  rmsprop.optimizer->params = {{"lr", {0.01}}, {"centered", {1.0}}, {"momentum", {0.9}}};
  check_against_engine<nn::GPT<float>, 1>(rmsprop, DType::f32);
  check_against_engine<ToyModel<bf16>, 0, Precision<bf16>>(toy_config(0, true), DType::bf16);
  check_against_engine<ToyModel<bf16>, 1, Precision<bf16>>(toy_config(1, true), DType::bf16);
  check_against_engine<ToyModel<bf16>, 2, Precision<bf16>>(toy_config(2, true), DType::bf16);
  check_against_engine<ToyModel<bf16>, 3, Precision<bf16>>(toy_config(3, true), DType::bf16);
}

TEST_CASE("the engine's estimate of an f64 reference model counts its f64 master",
          "[unit][engine]") {
  // An f64 model's master is its compute type: 8-byte master slices and gradient shards, no
  // separate compute copy. The estimate assumed a 4-byte fp32 master beside an 8-byte compute
  // type, so it matched neither the layout nor the bytes. At stage 3 the units at most
  // persistence_threshold elements keep their whole parameters gathered (with the default
  // threshold every unit of this tiny GPT), which the estimate left out.
  const auto check = [&]<int S>(std::integral_constant<int, S>, std::int64_t threshold) {
    std::vector<std::pair<double, double>> ranks(4);  // measured, estimated
    std::vector<int> persistent(4, 0);
    LocalComm::run(4, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      engine::EngineOptions options;
      options.persistence_threshold = threshold;
      engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(0.5, p, g); },
          options);
      const engine::MemoryReport m = eng.memory_report();
      const engine::MemoryEstimate e = eng.memory_estimate();
      const auto r = static_cast<std::size_t>(comm.rank());
      ranks[r] = {static_cast<double>(m.total() - m.scratch_bytes), e.device_at_rest + e.host};
      for (int u = 0; u < eng.num_units(); ++u) {
        persistent[r] += eng.partition(u).numel() <= threshold ? 1 : 0;
      }
    });
    for (const auto& [measured, estimated] : ranks) {
      INFO("stage " << S << ", persistence threshold " << threshold << " (" << persistent[0]
                    << " units under it): measured " << measured << " bytes, estimated "
                    << estimated);
      CHECK(estimated == measured);
    }
    return persistent[0];
  };
  const std::int64_t default_threshold = engine::EngineOptions{}.persistence_threshold;
  check(std::integral_constant<int, 0>{}, default_threshold);
  check(std::integral_constant<int, 1>{}, default_threshold);
  check(std::integral_constant<int, 2>{}, default_threshold);
  CHECK(check(std::integral_constant<int, 3>{}, default_threshold) == 4);  // every unit
  CHECK(check(std::integral_constant<int, 3>{}, 0) == 0);
  // The last unit (the head's LayerNorm) alone: the others are sharded at rest.
  CHECK(check(std::integral_constant<int, 3>{}, 2 * tiny().channels) == 1);
  engine::MemoryEstimateInput bad;
  bad.params = bad.largest_unit_params = 8;
  bad.master = DType::bf16;
  CHECK_THROWS_WITH(engine::estimate_model_states(bad),
                    Catch::Contains("master type is bf16; it is f32 or f64"));
}

TEST_CASE("the estimator equals memory_report() with NVMe offload (master and states in files)",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("estimator-nvme", "/var/tmp");
  auto with_nvme = [&](Config c) {
    c.zero_optimization.offload_optimizer.device = OffloadDevice::nvme;
    c.zero_optimization.offload_optimizer.nvme_path = nvme.path().string();
    return c;
  };
  const auto nv = OffloadDevice::nvme;
  check_against_engine<nn::GPT<float>, 1, Offload<NVMe>>(with_nvme(adamw_config(1, 1, 0)),
                                                         DType::f32, nv);
  check_against_engine<nn::GPT<float>, 3, Offload<NVMe>>(with_nvme(adamw_config(3, 1, 0)),
                                                         DType::f32, nv);
  check_against_engine<ToyModel<bf16>, 2, Precision<bf16>, Offload<NVMe>>(
      with_nvme(toy_config(2, true)), DType::bf16, nv);
  check_against_engine<ToyModel<bf16>, 3, Precision<bf16>, Offload<NVMe>>(
      with_nvme(toy_config(3, true)), DType::bf16, nv);
}

TEST_CASE("the estimator has the ZeRO paper's shape, DeepSpeed's formulas are beside it",
          "[unit][engine]") {
  engine::MemoryEstimateInput in;
  in.params = 7'500'000'000;  // the paper's 7.5B example on 64 GPUs
  in.largest_unit_params = 200'000'000;
  in.gpus_per_node = 8;
  in.nodes = 8;
  in.precision = DType::bf16;
  const double psi = 7.5e9, n = 64;
  in.stage = 3;
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(16 * psi / n));  // the paper's
  CHECK(engine::deepspeed_estimate(in).device_at_rest == Approx(18 * psi / n));
  // DeepSpeed's host figure with zero.Init: one largest layer in fp32 per process of the node.
  CHECK(engine::deepspeed_estimate(in).host == Approx(4 * 2e8 * 8 * 1.5));
  in.stage = 2;
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(2 * psi + 16 * psi / n));
  in.offload_optimizer = OffloadDevice::cpu;
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(2 * psi));
  CHECK(engine::deepspeed_estimate(in).device_at_rest == Approx(2 * psi));
  CHECK(engine::estimate_model_states(in).host == Approx(18 * psi / n));
  // The delayed update (delayed_param_update) keeps a second fp32 gradient shard and a second
  // bf16 copy on the host.
  in.delayed_update = true;
  CHECK(engine::estimate_model_states(in).host == Approx(24 * psi / n));
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(2 * psi));
  in.delayed_update = false;
  // accumulate_grads_on_device sums the window's fp32 gradient shard in device memory.
  in.device_grad_accumulator = true;
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(2 * psi + 4 * psi / n));
  CHECK(engine::estimate_model_states(in).host == Approx(18 * psi / n));
  in.device_grad_accumulator = false;
  // offload_ratio 0.25 (Twin-Flow): the units kept on the device hold their three quarters of
  // the shard there as without offload (master, Adam's states, gradient shard: 16 bytes each,
  // no bf16 copy), the host the rest.
  in.shard_params = psi / n;
  in.kept_shard_params = 0.75 * psi / n;
  CHECK(engine::estimate_model_states(in).host == Approx(0.25 * 18 * psi / n));
  CHECK(engine::estimate_model_states(in).device_at_rest == Approx(2 * psi + 0.75 * 16 * psi / n));
  in.kept_shard_params = 2 * psi / n;  // more than the shard
  CHECK_THROWS_WITH(engine::estimate_model_states(in), Catch::Contains("kept shard"));
  in.kept_shard_params = 0;
  in.stage = 3;
  in.offload_param = OffloadDevice::cpu;
  CHECK(engine::estimate_model_states(in).device_at_rest == 0);  // unit buffers only
  CHECK(engine::estimate_model_states(in).device_working == Approx(2 * 2 * 2e8));
  // Pending reductions each hold a whole unit's bf16 gradient while the next backward runs
  // (stages 2 and 3, where the gradient is a working buffer); the parameters are not held.
  in.pending_reductions = 2;
  CHECK(engine::estimate_model_states(in).device_working == Approx(2 * 2 * 2e8 + 2 * 2 * 2e8));
  in.offload_param = OffloadDevice::none;
  in.stage = 2;
  CHECK(engine::estimate_model_states(in).device_working == Approx(2 * 2e8 + 2 * 2 * 2e8));
  in.stage = 1;  // the accumulator at rest is reduced: only the running unit's gradient
  CHECK(engine::estimate_model_states(in).device_working == Approx(2 * 2e8));
  in.stage = 3;
  in.offload_param = OffloadDevice::cpu;
  in.pending_reductions = 0;
  // The host holds the master, Adam's states, the fp32 gradient shard and the bf16 copy the host
  // optimizer writes for the gathers: 18 psi / N, DeepSpeed's offload_param figure.
  CHECK(engine::estimate_model_states(in).host == Approx(18 * psi / n));
  in.offload_optimizer = OffloadDevice::nvme;
  in.offload_param = OffloadDevice::none;
  const auto nv = engine::estimate_model_states(in);
  CHECK(nv.nvme == Approx(12 * psi / n));  // master + Adam states
  CHECK(nv.host == Approx(4 * psi / n));
  in.stage = 2;
  in.offload_param = OffloadDevice::cpu;
  CHECK_THROWS_WITH(engine::estimate_model_states(in), Catch::Contains("stage 3"));
}

TEST_CASE("offload_ratio keeps the last units on the device within 1 - ratio of the elements",
          "[unit][engine]") {
  using V = std::vector<bool>;
  const auto kept = [](std::vector<std::int64_t> shards, double ratio) {
    return engine::units_kept_on_device(shards, ratio);
  };
  CHECK(kept({10, 10, 10, 10}, 1.0) == V{false, false, false, false});
  CHECK(kept({10, 10, 10, 10}, 0.5) == V{false, false, true, true});
  CHECK(kept({10, 10, 10, 10}, 0.75) == V{false, false, false, true});
  CHECK(kept({10, 10, 10, 10}, 0.8) == V{false, false, false, false});  // 8 < the last unit
  CHECK(kept({30, 5, 5}, 0.5) == V{false, true, true});
  // From the last unit back only: a unit that does not fit ends the run.
  CHECK(kept({5, 30, 5}, 0.5) == V{false, false, true});
  // Any ratio above 0 offloads the first unit at least.
  CHECK(kept({10, 10}, 0.01) == V{false, true});
  CHECK(kept({}, 0.5).empty());
}

TEST_CASE("optimizer state bytes follow the states each optimizer keeps", "[unit][engine]") {
  const auto bytes = [](const char* type, std::map<std::string, std::vector<double>> params) {
    NamedParams o;
    o.type = type;
    o.params = std::move(params);
    return engine::optimizer_state_bytes(o);
  };
  CHECK(bytes("AdamW", {}) == 8);
  CHECK(bytes("SGD", {}) == 0);
  CHECK(bytes("SGD", {{"momentum", {0.9}}}) == 4);
  CHECK(bytes("RMSprop", {}) == 4);                                           // square_avg
  CHECK(bytes("RMSprop", {{"centered", {1.0}}}) == 8);                        // + grad_avg
  CHECK(bytes("RMSprop", {{"centered", {1.0}}, {"momentum", {0.9}}}) == 12);  // + momentum
  CHECK(bytes("Adagrad", {}) == 4);
}
