// Config keys the engine applies, each shown by its effect: comm_timeout_s becomes the deadline
// of the engine's communicator, stage3_max_live_parameters bounds the gathered elements without
// changing a number, offload_optimizer.device cpu is met on a host-only engine as it stands, and
// zero::dispatch picks the compute type from bf16.enabled / fp16.enabled.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <latch>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <zero/config/auto_values.hpp>
#include <zero/engine/dispatch.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::nothing_thrown;
using zero::testing::per_rank;
using zero::testing::thrown_message;

namespace {

Config with_keys(int stage, const std::string& extra_top, const std::string& extra_zero) {
  return Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},)" +
      extra_top + R"("zero_optimization": {"stage": )" + std::to_string(stage) + extra_zero + "}}");
}

}  // namespace

TEST_CASE("comm_timeout_s reaches every group of a process grid the engine works over",
          "[unit][engine]") {
  // The pipeline's groups (its sends, the norm's sum over stages, checkpoints over tp x dp x pp)
  // and the expert groups kept the world's deadline: only dp (and tp's) took the config's.
  const Config cfg = with_keys(1, R"("comm_timeout_s": 7,)", "");
  const auto seen = per_rank<std::vector<double>>(4, [&](LocalComm& world) {
    std::vector<double> out;
    {
      parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.dp = 2, .pp = 2}));
      engine::apply_comm_timeout(cfg, groups);
      out.push_back(groups.dp().options().timeout_s);
      out.push_back(groups.pp().options().timeout_s);
      out.push_back(groups.tp_dp_pp().options().timeout_s);
    }
    {
      parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
      engine::apply_comm_timeout(cfg, groups);
      out.push_back(groups.get({parallel::Axis::ep, parallel::Axis::dp}).options().timeout_s);
      out.push_back(groups.dp().options().timeout_s);
      out.push_back(groups.ep().options().timeout_s);
    }
    {
      parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.cp = 2, .dp = 2}));
      engine::apply_comm_timeout(cfg, groups);
      out.push_back(groups.cp().options().timeout_s);
    }
    {  // experts split over ep and tp: the tp group and the state group (every rank)
      parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .ep = 2}));
      engine::apply_comm_timeout(cfg, groups);
      using parallel::Axis;
      out.push_back(groups.tp().options().timeout_s);
      out.push_back(groups.ep().options().timeout_s);
      out.push_back(
          groups.get({Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp}).options().timeout_s);
    }
    return out;
  });
  for (const auto& v : seen) CHECK(v == std::vector<double>(10, 7.0));
}

TEST_CASE("comm_timeout_s from the config is the deadline of the engine's communicator",
          "[unit][engine]") {
  parallel::CommOptions long_wait;
  long_wait.timeout_s = 300;
  // Rank 1 builds its engine and then waits (without a collective) until rank 0's lone
  // all-reduce has given up on it.
  auto run = [&](const Config& cfg) {
    std::vector<std::string> errors(2);
    std::vector<double> deadlines(2);
    std::latch rank0_done(1);
    LocalComm::run(
        2,
        [&](LocalComm& comm) {
          nn::GPT<float> model(tiny());
          engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, cfg);
          const auto r = static_cast<std::size_t>(comm.rank());
          deadlines[r] = comm.options().timeout_s;
          if (comm.rank() == 1) {
            rank0_done.wait();
            return;
          }
          errors[r] = thrown_message([&] {
            double x = 1;
            eng.comm().all_reduce(std::span<double>(&x, 1), parallel::ReduceOp::sum);
          });
          rank0_done.count_down();
        },
        long_wait);
    return std::pair{errors[0], deadlines};
  };
  const auto [error, deadlines] = run(with_keys(1, R"("comm_timeout_s": 0.25,)", ""));
  CHECK(deadlines == std::vector<double>{0.25, 0.25});
  CHECK_THAT(error, Catch::Contains("timed out after 0.25"));
  // Negative control: without the key, the communicator keeps the program's own deadline.
  Config without = with_keys(1, "", "");
  CHECK_FALSE(without.comm_timeout_given);
  std::vector<double> kept(2);
  LocalComm::run(
      2,
      [&](LocalComm& comm) {
        nn::GPT<float> model(tiny());
        engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, without);
        kept[static_cast<std::size_t>(comm.rank())] = comm.options().timeout_s;
      },
      long_wait);
  CHECK(kept == std::vector<double>{300, 300});
}

TEST_CASE("stage3_max_live_parameters bounds the gathered elements, not the numbers",
          "[unit][engine]") {
  struct Result {
    std::vector<float> values;
    std::int64_t peak = 0, largest_need = 0;
  };
  // Prefetch everything (a window far beyond the model) and keep nothing persistent, so only
  // max_live stops the gathers running ahead.
  auto run = [](std::int64_t max_live) {
    Result out;
    const Config cfg = with_keys(3, "",
                                 R"(, "stage3_prefetch_bucket_size": 1e9,
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": )" +
                                     std::to_string(max_live));
    LocalComm::run(2, [&](LocalComm& comm) {
      nn::GPT<float> model(tiny());
      engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, comm, cfg);
      for (int step = 0; step < 2; ++step) {
        const GlobalBatch b(micro_rows * 2, step, tiny().vocab_size);
        eng.forward(b.micro(0, comm.rank(), 2));
        eng.backward();
        eng.step();
      }
      const std::vector<float> mine = all_unit_values(eng);
      if (comm.rank() == 0) {
        out.values = mine;
        out.peak = eng.peak_gathered_elems();
        // What one unit needs at once: itself and the units it uses (the tied head uses the
        // embedding), whatever the bound.
        for (int u = 0; u < eng.num_units(); ++u) {
          std::int64_t need = eng.partition(u).padded_numel();
          for (int used : model.unit_uses(u)) need += eng.partition(used).padded_numel();
          out.largest_need = std::max(out.largest_need, need);
        }
      }
    });
    return out;
  };
  const Result free = run(1'000'000'000);
  const std::int64_t bound = free.largest_need;
  const Result bounded = run(bound);
  INFO("peak unbounded " << free.peak << ", bounded " << bounded.peak << ", bound " << bound);
  CHECK(bounded.peak <= bound + free.largest_need);  // the bound, plus a unit about to run
  CHECK(bounded.peak < free.peak);                   // the bound took effect
  REQUIRE(bounded.values.size() == free.values.size());
  CHECK(std::memcmp(bounded.values.data(), free.values.data(),
                    free.values.size() * sizeof(float)) == 0);
}

TEST_CASE("stage3_prefetch_bucket_size bounds the units gathered ahead", "[unit][engine]") {
  // Each unit's prefetch skipped the units the previous one had gathered ahead and gathered a
  // bucket more beyond them: with a bucket of 1.5 blocks the window grew by a block at every
  // block (traced from the code, not measured), far past what the estimator and the device
  // check count.
  nn::GPTConfig cfg = tiny();
  cfg.num_layers = 8;
  struct Result {
    std::int64_t peak = 0, block = 0, embedding = 0, largest_need = 0;
  };
  const auto run = [&](double blocks_ahead) {
    Result out;
    LocalComm::run(2, [&](LocalComm& comm) {
      nn::GPT<float> model(cfg);
      // The block's padded size, from a first engine, sizes the bucket of the second.
      std::int64_t block = 0;
      {
        engine::Engine<nn::GPT<float>, ZeroStage<3>> probe(model, comm, with_keys(3, "", ""));
        block = probe.partition(1).padded_numel();
      }
      const auto bucket = static_cast<std::int64_t>(blocks_ahead * static_cast<double>(block));
      const Config c = with_keys(3, "",
                                 R"(, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": )" +
                                     std::to_string(bucket));
      engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, comm, c);
      const GlobalBatch b(micro_rows * 2, 0, cfg.vocab_size);
      eng.forward(b.micro(0, comm.rank(), 2));
      eng.backward();
      eng.step();
      if (comm.rank() == 0) {
        out.peak = eng.peak_gathered_elems();
        out.block = block;
        out.embedding = eng.partition(0).padded_numel();
        for (int u = 0; u < eng.num_units(); ++u) {
          std::int64_t need = eng.partition(u).padded_numel();
          for (int used : model.unit_uses(u)) need += eng.partition(used).padded_numel();
          out.largest_need = std::max(out.largest_need, need);
        }
      }
    });
    return out;
  };
  const Result r = run(1.5);
  REQUIRE(r.block > r.embedding);  // the blocks are the largest units
  // The unit running (with what it uses), the bucket and the unit that overshoots it, and the
  // embedding the tied head keeps gathered through the forward.
  const std::int64_t bound = r.largest_need + r.block * 3 / 2 + r.block + r.embedding;
  INFO("peak " << r.peak << ", bound " << bound << ", block " << r.block);
  CHECK(r.peak <= bound);
  CHECK(r.peak >= 2 * r.block);  // the bucket gathers ahead at all
  // A bucket of the whole model gathers (nearly) all of it ahead: the bound took effect above.
  CHECK(run(100.0).peak > bound);
}

TEST_CASE("offload_optimizer.device cpu on a host-only engine is met as it stands",
          "[unit][engine]") {
  const Config cpu =
      with_keys(2, "", R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})");
  CHECK(engine::offload_cpu_already_host<None, Host>(cpu));
  CHECK_NOTHROW(engine::check_config_against_policies<float, None, Host>(cpu, /*stage=*/2));
  const auto errors = per_rank<std::string>(2, [&](LocalComm& comm) {
    return thrown_message([&] {
      nn::GPT<float> model(tiny());
      engine::Engine<nn::GPT<float>, ZeroStage<2>> eng(model, comm, cpu);
    });
  });
  CHECK(errors[0] == nothing_thrown);
  // Negative controls: NVMe is not met by an engine without Offload<NVMe>, and a CPU-offload
  // request to an engine that computes elsewhere is not met in place.
  const Config nvme =
      with_keys(2, "", R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"})");
  CHECK_THROWS_WITH((engine::check_config_against_policies<float, None, Host>(nvme, 2)),
                    Catch::Contains("zero_optimization.offload_optimizer.device"));
  struct OtherDevice {};
  CHECK_FALSE(engine::offload_cpu_already_host<None, OtherDevice>(cpu));
  CHECK_THROWS_WITH((engine::check_config_against_policies<float, None, OtherDevice>(cpu, 2)),
                    Catch::Contains("zero_optimization.offload_optimizer.device: the config says "
                                    "'cpu'"));
}

TEST_CASE("zero::dispatch picks the compute type from bf16.enabled and fp16.enabled",
          "[unit][engine]") {
  auto picked = [](const std::string& top) {
    const Config cfg = with_keys(2, top, "");
    return zero::dispatch<nn::GPT, Precisions<float, bf16>, Offload<None>>(
        cfg, []<class E>(std::type_identity<E>) {
          static_assert(std::is_same_v<typename E::model_type, nn::GPT<typename E::T>>);
          return std::string(name_of(dtype_of<typename E::T>)) + " stage " +
                 std::to_string(E::stage);
        });
  };
  CHECK(picked("") == "f32 stage 2");
  CHECK(picked(R"("bf16": {"enabled": true},)") == "bf16 stage 2");
  CHECK(picked(R"("bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},)") == "f32 stage 2");
  CHECK_THROWS_WITH(picked(R"("fp16": {"enabled": true},)"),
                    Catch::Contains("fp16.enabled: the config asks for f16") &&
                        Catch::Contains("f32, bf16 only"));
}

TEST_CASE("a bf16 config trains the bf16 engine that dispatch picks", "[unit][engine]") {
  const Config cfg = with_keys(3, R"("bf16": {"enabled": true},)", "");
  using E = engine::Engine<nn::GPT<bf16>, ZeroStage<3>, Precision<bf16>>;
  // dispatch names this engine for the config (the engine itself is built once, below).
  const bool same = zero::dispatch<nn::GPT, Precisions<float, bf16>, Offload<None>>(
      cfg, []<class Picked>(std::type_identity<Picked>) {
        return std::is_same_v<
            Picked, engine::Engine<nn::GPT<bf16>, ZeroStage<3>, Precision<bf16>, Offload<None>>>;
      });
  CHECK(same);
  const auto losses = per_rank<std::vector<double>>(2, [&](LocalComm& comm) {
    typename E::model_type model(tiny());
    E eng(model, comm, cfg);
    std::vector<double> out;
    for (int step = 0; step < 4; ++step) {
      const GlobalBatch b(micro_rows * 2, 0, tiny().vocab_size);  // one batch, learnt
      out.push_back(static_cast<float>(eng.forward(b.micro(0, comm.rank(), 2))));
      eng.backward();
      eng.step();
    }
    return out;
  });
  INFO(losses[0][0] << " -> " << losses[0][3]);
  CHECK(losses[0][3] < losses[0][0]);
}

TEST_CASE("boolean scheduler params of a config reach the schedule", "[unit][engine]") {
  // The config keeps a boolean param as 0/1; the schedule refused that as "expected a boolean".
  const Config one_cycle =
      with_keys(1,
                R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0001,
          "cycle_max_lr": 0.001, "cycle_first_step_size": 10, "cycle_momentum": false}},)",
                "");
  const auto s = engine::scheduler_from_config(one_cycle, 1e-3);
  REQUIRE(s.has_value());
  CHECK_FALSE(s->momentum().has_value());  // cycling on would give beta1 at every step
  const Config range =
      with_keys(1,
                R"("scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001,
          "lr_range_test_step_size": 10, "lr_range_test_step_rate": 1.0,
          "lr_range_test_staircase": true}},)",
                "");
  auto staircase = *engine::scheduler_from_config(range, 1e-3);
  for (int i = 0; i < 15; ++i) staircase.step();  // iteration 14: still the first stair
  CHECK(staircase.lr() == Approx(2e-3));
}

TEST_CASE("a list of one number is not a number in optimizer and scheduler params",
          "[unit][engine]") {
  // Both read a one-element list as its element: "lr": [0.001] trained at 0.001.
  const Config parsed = Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": [0.001], "betas": [0.8, 0.9]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": [10]}}})");
  CHECK_THROWS_WITH(optim::AnyOptimizer::from_config(*parsed.optimizer, 4, {}),
                    Catch::Contains("optimizer.params.lr: expected one number, got a list of 1"));
  CHECK_THROWS_WITH(engine::scheduler_from_config(parsed, 1e-3),
                    Catch::Contains("scheduler.params.warmup_num_steps: expected a number"));
  // The same values as numbers are taken, and betas stays a list.
  const Config numbers = Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.9]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})");
  CHECK(optim::AnyOptimizer::from_config(*numbers.optimizer, 4, {}).lr() == 0.001);
  CHECK(engine::scheduler_from_config(numbers, 1e-3).has_value());
}

TEST_CASE("an Engine refuses a config with \"auto\" left unfilled", "[unit][engine]") {
  // Unfilled, gradient_clipping "auto" read as 0 (clipping off) and the schedule's "auto"
  // params as its defaults.
  const Config cfg = with_keys(1, R"("gradient_clipping": "auto",
      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},)",
                               "");
  const auto errors = per_rank<std::string>(2, [&](LocalComm& comm) {
    return thrown_message([&] {
      nn::GPT<float> model(tiny());
      engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, cfg);
    });
  });
  for (const auto& e : errors) {
    CHECK_THAT(e, Catch::Contains("gradient_clipping") &&
                      Catch::Contains("scheduler.params.warmup_max_lr") &&
                      Catch::Contains("config::fill_auto"));
  }
  // Negative control: filled, the same config builds.
  Config filled = cfg;
  config::fill_auto(filled, config::AutoValues{}, 2);
  const auto built = per_rank<std::string>(2, [&](LocalComm& comm) {
    return thrown_message([&] {
      nn::GPT<float> model(tiny());
      engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, filled);
    });
  });
  CHECK(built[0] == nothing_thrown);
}

TEST_CASE("OneCycle cycles the optimizer's betas as DeepSpeed does", "[unit][engine]") {
  // DeepSpeed's OneCycle sets betas (cycle_min_mom, 0.99) when it is built and (momentum, 0.99)
  // at each of its steps; the engine kept the configured betas, so the runs parted at step 2.
  const auto config = [](bool cycle) {
    return with_keys(1,
                     R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0001,
                         "cycle_max_lr": 0.001, "cycle_first_step_size": 4,
                         "cycle_momentum": )" +
                         std::string(cycle ? "true" : "false") + "}},",
                     "");
  };
  struct Seen {
    std::vector<std::pair<double, double>> betas;  // after each step: the ones it used
    std::vector<float> values;
  };
  const auto run = [&](bool cycle) {
    return per_rank<Seen>(2, [&](LocalComm& comm) {
      nn::GPT<float> model(tiny());
      engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, config(cycle));
      Seen s;
      for (int step = 0; step < 3; ++step) {
        const GlobalBatch b(micro_rows * 2, step, tiny().vocab_size);
        eng.forward(b.micro(0, comm.rank(), 2));
        eng.backward();
        eng.step();
        s.betas.push_back(*eng.optimizer(0).betas());
      }
      s.values = all_unit_values(eng);
      return s;
    })[0];
  };
  const Seen cycled = run(true), fixed = run(false);
  const auto schedule = *engine::scheduler_from_config(config(true), 1e-3);
  const auto& one = std::get<optim::OneCycle>(schedule.schedule());
  REQUIRE(cycled.betas.size() == 3);
  CHECK(cycled.betas[0] == std::pair{0.8, 0.99});  // cycle_min_mom before the first step
  CHECK(cycled.betas[1] == std::pair{*one.momentum(0), 0.99});
  CHECK(cycled.betas[2] == std::pair{*one.momentum(1), 0.99});
  CHECK(cycled.betas[2].first != cycled.betas[1].first);
  CHECK(fixed.betas[2] == std::pair{0.9, 0.999});  // AdamW's own (with_keys: default betas)
  CHECK(cycled.values != fixed.values);
}

TEST_CASE("OneCycle's momentum decay past 1 stops the step before any update, naming the key",
          "[unit][engine]") {
  // beta1 = cycle_max_mom * (1 + decay_mom_rate * interval) after the cycle: at 1.8 the
  // optimizer's own check threw inside the update, leaving the engine inconsistent.
  const Config cfg =
      with_keys(1,
                R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0001,
          "cycle_max_lr": 0.001, "cycle_first_step_size": 1, "decay_step_size": 1,
          "decay_lr_rate": 0.1, "decay_mom_rate": 1.0}},)",
                "");
  const auto seen = per_rank<std::string>(2, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, comm, cfg);
    std::string out;
    for (int step = 0; step < 4 && out.empty(); ++step) {
      const GlobalBatch b(micro_rows * 2, step, tiny().vocab_size);
      out = thrown_message([&] {
        eng.forward(b.micro(0, comm.rank(), 2));
        eng.backward();
        eng.step();
      });
      if (out == nothing_thrown) out.clear();
    }
    // Counted as a skipped step (the next window draws other dropout masks).
    return out + (eng.between_steps() ? " | between steps" : " | mid-step") + " | skipped " +
           std::to_string(eng.skipped_steps()) + (eng.last_step_skipped() ? " (last)" : "");
  });
  for (const auto& s : seen) {
    CHECK_THAT(s, Catch::Contains("scheduler.params.decay_mom_rate") &&
                      Catch::Contains("| between steps") && Catch::Contains("| skipped 1 (last)"));
  }
}

TEST_CASE("with both offload sections on NVMe their nvme_paths must agree", "[unit][engine]") {
  // One swapper holds the master, the optimizer states and the parameter shards. offload_param's
  // nvme_path (and its range-checked buffer_count) were never read when offload_optimizer was
  // on nvme too: a config putting them on two drives used the optimizer's without a word.
  const auto config = [](const char* param_path, int param_buffers) {
    return Config::from_json_string(std::string(R"({"zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme0", "buffer_count": 3},
        "offload_param": {"device": "nvme", "nvme_path": ")") +
                                    param_path + R"(", "buffer_count": )" +
                                    std::to_string(param_buffers) + "}}}");
  };
  CHECK_THROWS_WITH(engine::nvme_settings(config("/nvme1", 5)),
                    Catch::Contains("offload_param.nvme_path: '/nvme1' differs from "
                                    "offload_optimizer.nvme_path '/nvme0'"));
  CHECK_THROWS_WITH(engine::nvme_settings(config("/nvme0", 1000)),
                    Catch::Contains("offload_param.buffer_count: 1000 must be in [1, 64]"));
  // The same path (compared after lexical normalisation) is one swapper with the optimizer's
  // buffers.
  const auto same = engine::nvme_settings(config("/nvme0/../nvme0", 5));
  CHECK(same.nvme_path == "/nvme0");
  CHECK(same.buffer_count == 3);
  CHECK_NOTHROW(engine::nvme_settings(config("/nvme0/", 5)));  // a trailing slash: one folder
  // offload_param alone on nvme: its own section.
  const auto alone = engine::nvme_settings(Config::from_json_string(R"({"zero_optimization": {
      "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme1", "buffer_count": 6}}})"));
  CHECK(alone.nvme_path == "/nvme1");
  CHECK(alone.buffer_count == 6);
}
