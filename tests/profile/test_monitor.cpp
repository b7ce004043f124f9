// The wall-clock breakdown, memory breakdown and Monitor on an engine over 2 LocalComm ranks at
// stage 3 (gathers and reductions to wait for), and the timers' off switch.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <chrono>
#include <thread>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <parallel/comm/text_collectives.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/profile/monitor.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"

using namespace zero;

namespace {

nn::GPTConfig small_gpt() {
  nn::GPTConfig c;
  c.num_layers = 2;
  c.channels = 32;
  c.max_seq_len = 16;
  c.vocab_size = 64;
  c.num_heads = 2;
  return c;
}

struct Seen {
  std::vector<nlohmann::json> due;  // end_step's JSON per step
  double forward_s = 0, unit0_forward_s = 0;
  std::size_t states_total = 0;
  double estimate = 0;  // the engine's memory_estimate() at rest
  std::string summary;
};

// Trains 4 steps with config on 2 ranks (offloading to Where); returns rank 0's observations.
// comm_before_s logs an all-gather of that many seconds after the engine is built, before step 1
// (as an --init or a checkpoint's load would run); comm_between_s one between steps 1 and 2 (as
// a checkpoint's save would).
template <class Where = None>
Seen run(const Config& config, double comm_before_s = 0, double comm_between_s = 0) {
  const nn::GPTConfig gc = small_gpt();
  const std::int64_t rows = 2;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows * gc.max_seq_len));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i * 5 % 64);
  return testing::per_rank<Seen>(2, [&](parallel::LocalComm& comm) {
    profile::Monitor monitor(config, comm.rank(), rows);
    if (monitor.logger()) comm.set_logger(monitor.logger());
    nn::GPT<float> model(gc);
    engine::Engine<nn::GPT<float>, ZeroStage<3>, Offload<Where>> eng(model, comm, config);
    if (comm_before_s > 0) {
      monitor.logger()->record(parallel::CommOp::all_gather, "world", 2, 8, comm_before_s);
    }
    Seen seen;
    for (std::int64_t step = 1; step <= 4; ++step) {
      monitor.begin_step(eng, step);
      eng.forward({tokens.data(), tokens.data(), rows, gc.max_seq_len});
      eng.backward();
      eng.step();
      seen.due.push_back(monitor.end_step(eng, model, step));
      if (comm_between_s > 0 && step == 1) {
        monitor.logger()->record(parallel::CommOp::all_gather, "world", 2, 8, comm_between_s);
      }
    }
    seen.forward_s = eng.timers().seconds(profile::Phase::forward);
    seen.unit0_forward_s = eng.timers().unit_forward_s(0);
    seen.states_total = eng.memory_report().total();
    const auto estimate = eng.memory_estimate();
    seen.estimate = estimate.device_at_rest + estimate.host;
    if (monitor.logger()) seen.summary = monitor.logger()->log_summary();
    return seen;
  })[0];
}

Config base() {
  return Config::from_json(nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3}})"));
}

}  // namespace

TEST_CASE("Monitor: nothing is timed or due without the sections", "[unit][profile]") {
  const Seen s = run(base());
  for (const auto& d : s.due) CHECK(d.empty());
  CHECK(s.forward_s == 0);  // the timers stayed off
  CHECK(s.unit0_forward_s == 0);
}

TEST_CASE("Monitor: wall-clock and memory breakdowns every steps_per_print, flops profile once",
          "[unit][profile]") {
  Config c = base();
  c.wall_clock_breakdown = true;
  c.memory_breakdown = true;
  c.flops_profiler.enabled = true;
  c.flops_profiler.profile_step = 2;           // DeepSpeed's global_steps: the third step
  c.flops_profiler.output_file = "/dev/null";  // printed elsewhere; the JSON is checked here
  c.comms_logger.enabled = true;
  const Seen s = run(c);
  REQUIRE(s.due.size() == 4);
  CHECK(s.due[0].empty());
  CHECK(s.due[2].contains("flops_profile"));
  CHECK_FALSE(s.due[2].contains("wall_clock"));
  CHECK(s.due[2]["flops_profile"]["step"] == 3);
  CHECK(s.due[2]["flops_profile"]["micro_steps"] == 1);  // that step alone
  CHECK(s.due[2]["flops_profile"]["fwd"]["flops"].get<std::int64_t>() > 0);
  for (const int i : {1, 3}) {
    const auto& w = s.due[static_cast<std::size_t>(i)].at("wall_clock");
    CHECK(w["forward_ms"].get<double>() > 0);
    CHECK(w["backward_ms"].get<double>() > 0);
    CHECK(w["optimizer_step_ms"].get<double>() > 0);
    CHECK(w["comm_ms"].get<double>() > 0);  // stage 3 gathers and reduce-scatters
    const double overlap = w["overlap"].get<double>();
    CHECK(overlap >= 0);
    CHECK(overlap <= 1);
    // waits happen inside forward/backward/step
    CHECK(w["gather_wait_ms"].get<double>() + w["reduction_wait_ms"].get<double>() <=
          w["forward_ms"].get<double>() + w["backward_ms"].get<double>() +
              w["optimizer_step_ms"].get<double>());
    const auto& m = s.due[static_cast<std::size_t>(i)].at("memory");
    CHECK(m["model_states"].get<std::size_t>() == s.states_total);
    CHECK(m["activations_peak"].get<std::size_t>() > 0);
    CHECK(m["rss"].get<std::size_t>() > 0);
    CHECK(m["swap"] == 0);
    // The engine's own estimate (the Monitor priced the layout again, without the units
    // stage 3 keeps gathered): the 16 psi / N sharded states plus those whole units, which the
    // measured master + optimizer + gradient shards + whole parameters equal (padding aside).
    CHECK(m["estimate"].get<double>() == s.estimate);
    const double at_rest = m["master"].get<double>() + m["optimizer"].get<double>() +
                           m["grad_accumulators"].get<double>() + m["whole_params"].get<double>();
    CHECK(m["whole_params"].get<double>() > 0);
    CHECK(m["estimate"].get<double>() == Approx(at_rest).epsilon(0.02));
  }
  CHECK(s.summary.find("all_gather [world, 2 ranks]") != std::string::npos);
  CHECK(s.summary.find("reduce_scatter [world, 2 ranks]") != std::string::npos);
}

TEST_CASE("Monitor: the wall-clock comm time keeps the ops comms_logger.prof_ops leaves out",
          "[unit][profile]") {
  Config c = base();
  c.wall_clock_breakdown = true;
  c.comms_logger.enabled = true;
  c.comms_logger.prof_all = false;
  c.comms_logger.prof_ops = {"broadcast"};  // stage 3 gathers and reduce-scatters, never this
  const Seen s = run(c);
  REQUIRE(s.due.size() == 4);
  for (const int i : {1, 3}) {
    CHECK(s.due[static_cast<std::size_t>(i)].at("wall_clock")["comm_ms"].get<double>() > 0);
  }
  CHECK(s.summary.find("all_gather") == std::string::npos);  // the summary keeps the filter
}

TEST_CASE("Monitor: the first wall-clock window leaves out what ran before step 1",
          "[unit][profile]") {
  // The logger records from the start, so an --init's or a checkpoint load's collectives were
  // counted into the first window's comm time (and its overlap).
  Config c = base();
  c.wall_clock_breakdown = true;
  const Seen s = run(c, 10.0);
  REQUIRE(s.due.size() == 4);
  const double comm_ms = s.due[1].at("wall_clock")["comm_ms"].get<double>();
  CHECK(comm_ms > 0);
  CHECK(comm_ms < 1000);  // the 10 s logged before step 1 (5000 ms a step) are not in it
}

TEST_CASE("Monitor: a wall-clock window leaves out what ran between its steps", "[unit][profile]") {
  // The window's comm time was the logger's total at its end less that at its start, so a
  // checkpoint save's agreement between two steps of a window counted as the steps' comm.
  Config c = base();
  c.wall_clock_breakdown = true;
  const Seen s = run(c, 0.0, 10.0);
  REQUIRE(s.due.size() == 4);
  const double comm_ms = s.due[1].at("wall_clock")["comm_ms"].get<double>();
  CHECK(comm_ms > 0);
  CHECK(comm_ms < 1000);  // the 10 s logged after step 1 are not in steps 1-2's window
  CHECK(s.due[3].at("wall_clock")["comm_ms"].get<double>() < 1000);
}

TEST_CASE("Monitor: the memory estimate counts the states offloaded to host memory",
          "[unit][profile]") {
  // With the optimizer on NVMe the fp32 gradient shard stays in memory (the estimator's host
  // part): the breakdown's estimate left it out and looked 4 psi / N short of the measure.
  zero::testing::TempDir nvme("monitor-nvme", "/var/tmp");
  Config c = base();
  c.memory_breakdown = true;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::nvme;
  c.zero_optimization.offload_optimizer.nvme_path = nvme.path().string();
  const Seen s = run<NVMe>(c);
  const auto& m = s.due[1].at("memory");
  CHECK(m["estimate"].get<double>() == s.estimate);
  CHECK(m["master"] == 0);  // in files
  CHECK(m["grad_accumulators"].get<double>() > 0);
  const double at_rest = m["master"].get<double>() + m["optimizer"].get<double>() +
                         m["grad_accumulators"].get<double>() + m["whole_params"].get<double>();
  CHECK(m["estimate"].get<double>() == Approx(at_rest).epsilon(0.02));
}

TEST_CASE("Monitor: the flops profile counts the ranks that read their own samples",
          "[unit][profile]") {
  // Over cp 2 x dp 2 (Ulysses), the engine shards and averages over all 4 ranks, but each
  // dp rank's 2 sp ranks read one sample stream between them: samples/second counts 2 ranks'
  // rows. The Monitor passes the engine's sample_ranks on (collect_flops_profile's own test
  // gives it the figure by hand).
  Config c = base();
  c.flops_profiler.enabled = true;
  c.flops_profiler.profile_step = 0;  // the first step
  c.flops_profiler.output_file = "/dev/null";
  const nn::GPTConfig gc = small_gpt();
  const std::int64_t rows = 2, local = gc.max_seq_len / 2;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows * local), 3);
  const auto due = testing::per_rank<nlohmann::json>(4, [&](parallel::LocalComm& world) {
    parallel::ProcessGroups<parallel::LocalComm> groups(world, parallel::Grid({.cp = 2, .dp = 2}));
    profile::Monitor monitor(c, world.rank(), rows);
    nn::GPT<float> model(gc, {}, parallel::SequenceParallel(groups.cp()));
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, groups, c);
    monitor.begin_step(eng, 1);
    eng.forward({tokens.data(), tokens.data(), rows, local});
    eng.backward();
    eng.step();
    return monitor.end_step(eng, model, 1);
  });
  for (const nlohmann::json& d : due) {
    REQUIRE(d.contains("flops_profile"));
    CHECK(d["flops_profile"]["dp_size"] == 2);
    CHECK(d["flops_profile"]["world_size"] == 4);
  }
}

TEST_CASE(
    "Monitor in a pipeline: the breakdowns and the flops profile are gathered from every stage",
    "[unit][profile][pipeline]") {
  // Each stage runs its own units, so rank 0's reports were stage 0's alone.
  Config c = Config::from_json(nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
    "wall_clock_breakdown": true, "memory_breakdown": true,
    "flops_profiler": {"enabled": true, "profile_step": 2, "output_file": "/dev/null"},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 1}})"));
  const nn::GPTConfig gc = small_gpt();
  const std::int64_t rows = 2;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows * gc.max_seq_len));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i * 5 % 64);
  struct StageSeen {
    std::vector<nlohmann::json> due;
    std::size_t states = 0;
  };
  const auto seen = testing::per_rank<StageSeen>(2, [&](parallel::LocalComm& comm) {
    profile::Monitor monitor(c, comm.rank(), rows);
    parallel::ProcessGroups<parallel::LocalComm> groups(comm, parallel::Grid({.pp = 2}));
    nn::GPT<float> model(gc);
    parallel::pipeline::PipelineOptions po;
    po.partition_method = "uniform";
    parallel::pipeline::PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(model, comm, groups, c,
                                                                          po);
    monitor.collect_stages(
        [&groups](const std::string& s) { return parallel::all_gather_text(groups.pp(), s); });
    const std::vector<engine::MicroBatch> batches(
        2, engine::MicroBatch{tokens.data(), tokens.data(), rows, gc.max_seq_len});
    StageSeen out;
    for (std::int64_t step = 1; step <= 4; ++step) {
      monitor.begin_step(pipe.engine(), step);
      (void)pipe.train_batch(batches);
      out.due.push_back(monitor.end_step(pipe.engine(), pipe.stage_model(), step));
    }
    out.states = pipe.engine().memory_report().total();
    return out;
  });
  for (const int i : {1, 3}) {
    INFO("step " << i + 1);
    const auto at = static_cast<std::size_t>(i);
    for (int rank = 0; rank < 2; ++rank) {  // every rank gets the arrays
      const nlohmann::json& d = seen[static_cast<std::size_t>(rank)].due[at];
      REQUIRE(d.at("wall_clock_stages").size() == 2);
      REQUIRE(d.at("memory_stages").size() == 2);
      // Each stage's entry is that stage's own report.
      CHECK(d["wall_clock_stages"][rank] == d["wall_clock"]);
      CHECK(d["memory_stages"][rank] == d["memory"]);
    }
    const nlohmann::json& d = seen[0].due[at];
    for (int stage = 0; stage < 2; ++stage) {
      const auto k = static_cast<std::size_t>(stage);
      CHECK(d["wall_clock_stages"][k]["forward_ms"].get<double>() > 0);
      CHECK(d["wall_clock_stages"][k]["backward_ms"].get<double>() > 0);
      CHECK(d["memory_stages"][k]["model_states"].get<std::size_t>() == seen[k].states);
    }
  }
  // The flops profile of step 3: each stage's, whose forward counts are its units'.
  const nlohmann::json& p = seen[0].due[2];
  REQUIRE(p.at("flops_profile_stages").size() == 2);
  CHECK(p["flops_profile_stages"][0] == p["flops_profile"]);
  CHECK(p["flops_profile_stages"][1] == seen[1].due[2]["flops_profile"]);
  const auto fwd = [&](int k) {
    return p["flops_profile_stages"][static_cast<std::size_t>(k)]["fwd"]["flops"]
        .get<std::int64_t>();
  };
  CHECK(fwd(0) > 0);
  CHECK(fwd(1) > 0);
  CHECK(fwd(0) != fwd(1));  // the head's stage computes the logits
}

TEST_CASE("StepTimers: a phase inside another moves its time out, waits stay inside",
          "[unit][profile]") {
  using profile::Phase;
  using namespace std::chrono_literals;
  profile::StepTimers t;
  t.enable();
  const auto start = std::chrono::steady_clock::now();
  {
    const auto f = t.phase(Phase::forward);
    std::this_thread::sleep_for(20ms);
    {
      const auto s = t.phase(Phase::step);  // the deferred update of overlap_offload_update
      const auto w = t.phase(Phase::gather_wait);
      std::this_thread::sleep_for(40ms);
    }
    { const auto again = t.phase(Phase::forward); }  // nested forward: counted once
  }
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double forward = t.seconds(Phase::forward), step = t.seconds(Phase::step);
  CHECK(step >= 0.04);
  CHECK(forward >= 0.02);
  CHECK(forward < 0.055);  // without the step's 40 ms (with it: at least 60)
  CHECK(forward + step <= wall);
  CHECK(t.seconds(Phase::gather_wait) >= 0.04);  // a part of the step, counted in it too
  { const auto b = t.phase(Phase::backward); }   // the outer phase closed: nothing is open
  CHECK(t.seconds(Phase::forward) == forward);
}

TEST_CASE("WallClockBreakdown: per-step means and the overlap fraction", "[unit][profile]") {
  profile::StepTimers t;
  t.enable();
  { const auto s = t.phase(profile::Phase::forward); }
  CHECK(t.seconds(profile::Phase::forward) > 0);
  profile::WallClockBreakdown b;
  b.steps = 1;
  b.reduction_wait_s = 0.002;
  b.gather_wait_s = 0.001;
  CHECK_FALSE(b.overlap());  // no logger, no communication time
  b.comm_s = 0.012;
  CHECK(*b.overlap() == Approx(0.75));
  b.comm_s = 0.002;  // waited longer than the logged time (a rank waiting for a slower one)
  CHECK(*b.overlap() == 0);
  CHECK(b.text().find("overlap: 0.0%") != std::string::npos);
  const profile::StepTimers later = t;
  CHECK(later.since(t).seconds(profile::Phase::forward) == 0);
}
