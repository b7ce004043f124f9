// Pipeline parallelism end to end: every schedule (GPipe, 1F1B, interleaved, ZB-H1 with its
// backward split into input and weight halves) at pp 2 and 4 with
// 4 and 8 micro-batches equals one process on the global batch over several f64 AdamW steps
// with clipping (1e-10: a lost micro-batch, a missing tied-embedding reduction or a stage
// counted twice in the clipping norm is an O(1e-3) error), and the tied embedding's replica on
// the last stage stays equal to its owner; 3D (dp 2, tp 2, pp 2) with ZeRO-1 on 8 ranks; the
// negative controls (a reference without one micro-batch, the tied reduction left out) fail the
// comparison; the live activations are the schedule's; a checkpoint saved at (pp 2, dp 2)
// resumes at pp 4 and without a pipeline; bad layouts are refused naming the value.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <any>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/gpt.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::pipeline::PipelineEngine;
using parallel::pipeline::PipelineOptions;
using parallel::pipeline::ScheduleKind;

namespace {

// 6 blocks: 8 units, enough for pp 4 x 2 virtual stages.
nn::GPTConfig pp_model() {
  nn::GPTConfig c = test::tp_tiny();
  c.num_layers = 6;
  return c;
}

struct Layout {
  int tp = 1, dp = 1, pp = 2;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  int sp = 1;                // Ulysses: each rank is fed T/sp positions of its dp rank's rows
  bool megatron_sp = false;  // tensor parallelism with Megatron's sequence parallelism
  int shard_size = 0;        // hybrid sharding over dp (EngineOptions::shard_size); 0: none
};

struct RankResult {
  std::vector<test::HeldParam> params;
  int peak_live = 0;
  int recomputed = 0;
  double loss = 0;
};

template <int S>
RankResult pipeline_rank(LocalComm& world, const Layout& l, int micro_batches, int steps,
                         bool reduce_tied = true) {
  parallel::ProcessGroups<LocalComm> groups(
      world, parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp, .pp = l.pp}));
  const parallel::SequenceParallel sp =
      l.sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel();
  nn::GPT<double> model(pp_model(), parallel::TensorParallel(groups.tp(), l.megatron_sp), sp);
  PipelineOptions options;
  options.schedule = l.schedule;
  options.virtual_stages = l.virtual_stages;
  options.partition_method = "uniform";
  engine::EngineOptions engine_options = test::tp_options(micro_batches);
  engine_options.shard_size = l.shard_size;
  PipelineEngine<nn::GPT<double>, ZeroStage<S>> pipe(model, world, groups, test::AdamW64{}, options,
                                                     engine_options);
  RankResult out;
  const int dp_rank = groups.dp().rank();
  for (int step = 0; step < steps; ++step) {
    const test::GlobalBatch b(test::micro_rows * micro_batches * l.dp, step, pp_model().vocab_size);
    std::vector<parallel::SequenceSlice> slices;  // this rank's positions (Ulysses)
    const std::vector<engine::MicroBatch> batches =
        test::rank_batches(b, dp_rank, l.dp, micro_batches, sp, slices);
    if (reduce_tied) {
      const auto r = pipe.train_batch(batches);
      out.peak_live = r.peak_live_activations;
      out.recomputed = r.recomputed_forwards;
      out.loss = r.loss;
    } else {  // the negative control: the same step without the tied units' reduction
      (void)pipe.run_schedule(batches);
      pipe.engine().step();
    }
  }
  out.params = test::held_params(pipe.engine());
  return out;
}

struct Outcome {
  double error = 0;          // against the reference
  double copies_differ = 0;  // replicas against owners
  std::vector<RankResult> ranks;
};

Outcome run_layout(const Layout& l, int micro_batches, int steps, int stage = 1,
                   bool reduce_tied = true) {
  const auto ranks =
      testing::per_rank<RankResult>(l.tp * l.sp * l.dp * l.pp, [&](LocalComm& world) {
        return stage == 0 ? pipeline_rank<0>(world, l, micro_batches, steps, reduce_tied)
                          : pipeline_rank<1>(world, l, micro_batches, steps, reduce_tied);
      });
  std::vector<std::vector<test::HeldParam>> held;
  for (const auto& r : ranks) held.push_back(r.params);
  Outcome out;
  const auto got = test::assemble(held, &out.copies_differ);
  out.error = test::max_difference(
      got, test::reference<double>(pp_model(), test::micro_rows * micro_batches * l.dp, steps));
  out.ranks = ranks;
  return out;
}

}  // namespace

TEST_CASE(
    "Pipeline: GPipe, 1F1B, interleaved and ZB-H1 at pp 2 and 4 with 4 and 8 micro-batches "
    "equal the single-process reference (f64 AdamW, clipping)",
    "[unit][pipeline]") {
  const int steps = 3;
  for (ScheduleKind kind : parallel::pipeline::all_schedule_kinds) {
    for (int pp : {2, 4}) {
      for (int m : {4, 8}) {
        Layout l;
        l.pp = pp;
        l.schedule = kind;
        l.virtual_stages = kind == ScheduleKind::interleaved ? 2 : 1;
        const Outcome o = run_layout(l, m, steps);
        INFO(name_of(kind) << ", pp " << pp << ", m " << m);
        CHECK(o.error <= 1e-10);
        CHECK(o.copies_differ == 0.0);  // the last stage's token table equals the first's
        // Stage inputs held at once: all m for GPipe, at most pp for 1F1B (stage 0).
        if (kind == ScheduleKind::gpipe) CHECK(o.ranks[0].peak_live == m);
        // ZB-H1 as 1F1B: a micro-batch is live from its forward to its weight half.
        if (kind == ScheduleKind::one_f_one_b || kind == ScheduleKind::zero_bubble)
          CHECK(o.ranks[0].peak_live == std::min(pp, m));
        // GPT's layers park: every stage keeps its micro-batches in flight, none is recomputed.
        for (const RankResult& r : o.ranks) CHECK(r.recomputed == 0);
      }
    }
  }
}

namespace {

// Two steps of 2 micro-batches through one engine's passes. Split: each backward as its input
// half, and the weight halves only after both input halves (ZB-H1's order when a stage has two
// micro-batches in flight), so the second input half accumulates into gradient buffers that
// the first's products still aim at (bf16 folds those buffers into f32 only after the last).
// `products` gets how many products the first input half left. tp > 1: the model split over
// tp ranks with Megatron's sequence parallelism.
template <class T>
std::vector<std::vector<test::HeldParam>> passes_run(bool split, std::size_t* products = nullptr,
                                                     int tp = 1) {
  return testing::per_rank<std::vector<test::HeldParam>>(tp, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = tp}));
    nn::GPT<T> model(pp_model(), parallel::TensorParallel(groups.tp(), tp > 1));
    using Eng = std::conditional_t<std::is_same_v<T, bf16>,
                                   engine::Engine<nn::GPT<T>, ZeroStage<1>, Precision<bf16>>,
                                   engine::Engine<nn::GPT<T>, ZeroStage<1>>>;
    Eng eng(
        model, groups,
        [](int, auto p, auto g) {
          for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.05 * g[i];
        },
        test::tp_options(2));
    const engine::UnitRange all{0, eng.num_units()};
    nn::DeferredWeightGrads<T> deferred[2];
    for (int step = 0; step < 2; ++step) {
      const test::GlobalBatch b(2 * test::micro_rows, step, pp_model().vocab_size);
      for (int m = 0; m < 2; ++m) {
        (void)eng.forward_pass(all, m, b.micro(m, 0, 1));
        if (!split) {
          (void)eng.backward_pass();
          continue;
        }
        (void)eng.backward_input_pass({}, deferred[m]);
        if (products != nullptr && step == 0 && m == 0) *products = deferred[0].size();
      }
      if (split) {
        CHECK_FALSE(eng.step());  // the gradients are not complete before the weight halves
        for (auto& d : deferred) eng.weight_pass(all, d);
      }
      CHECK(eng.step());
    }
    return test::held_params(eng);
  });
}

}  // namespace

TEST_CASE(
    "Pipeline with Ulysses sequence parallelism: every schedule at sp 2 x pp 2, and tp 2 x sp 2 x "
    "pp 2, equal the single-process reference (f64 AdamW, clipping)",
    "[unit][pipeline][ulysses]") {
  // Each stage's ranks hold T/sp positions: the stage activations sent between them are their
  // positions' rows, the attention of each block gathers whole sequences over its sp group,
  // the last stage's loss takes its positions' share, and the state group is tp x dp x cp x pp.
  const int steps = 3, m = 4;
  for (ScheduleKind kind : parallel::pipeline::all_schedule_kinds) {
    Layout l;
    l.sp = 2;
    l.schedule = kind;
    l.virtual_stages = kind == ScheduleKind::interleaved ? 2 : 1;
    const Outcome o = run_layout(l, m, steps);
    INFO(name_of(kind) << ", sp 2, pp 2: worst difference " << o.error);
    CHECK(o.error <= 1e-10);
    CHECK(o.copies_differ == 0.0);
  }
  Layout three_d;
  three_d.tp = 2;
  three_d.sp = 2;
  const Outcome o = run_layout(three_d, m, steps, 0);
  INFO("tp 2, sp 2, pp 2, stage 0: worst difference " << o.error);
  CHECK(o.error <= 1e-10);
  CHECK(o.copies_differ == 0.0);
}

TEST_CASE(
    "Pipeline under hybrid sharding: ZeRO-1 over dp 4 in shard groups of 2 at pp 2 "
    "equals the reference",
    "[unit][pipeline]") {
  // Each stage's engine splits its dp group; the tied embedding's gradient is summed over the
  // stages before the engine reduces it in its shard group and averages it over the replicas.
  for (int shard : {1, 2}) {
    Layout l;
    l.dp = 4;
    l.shard_size = shard;
    const Outcome o = run_layout(l, 4, 3);
    INFO("dp 4 in shard groups of " << shard << ", pp 2: worst difference " << o.error);
    CHECK(o.error <= 1e-10);
    CHECK(o.copies_differ == 0.0);
  }
}

TEST_CASE("Engine passes: a backward split into input and weight halves equals the whole one",
          "[unit][pipeline]") {
  // Only the token table's sum changes order: the embedding's scatter is in the input half and
  // the tied head's product in the weight half, so they add up the other way round.
  SECTION("f64 and f32: to rounding (only the tied table sums in another order)") {
    std::size_t products = 0;
    const auto whole = passes_run<double>(false);
    const auto split = passes_run<double>(true, &products);
    const double f64 = test::max_difference(test::assemble(whole), test::assemble(split));
    const double f32 = test::max_difference(test::assemble(passes_run<float>(false)),
                                            test::assemble(passes_run<float>(true)));
    INFO("f64 " << f64 << ", f32 " << f32);
    CHECK(f64 <= 1e-13);
    CHECK(f32 <= 1e-6);
    // Every block's 4 linear layers and the tied LM head left their products (6 blocks).
    CHECK(products == 6 * 4 + 1);
  }
  // Under Megatron SP the LayerNorms' gradients are summed over tp in the unit's last backward
  // of the window: with the split, the second pass's input half, which runs before the first
  // pass's weight half (a sum keyed to the weight halves would never be taken).
  SECTION("f64 at tp 2 with SP: to rounding") {
    const double d = test::max_difference(test::assemble(passes_run<double>(false, nullptr, 2)),
                                          test::assemble(passes_run<double>(true, nullptr, 2)));
    INFO("f64 at tp 2 " << d);
    CHECK(d <= 1e-13);
  }
  // The bf16 gradient buffers fold into f32 after both micro-batches instead of after each: one
  // bf16 rounding of a sum instead of two of its parts (measured 1.7e-6 after 2 steps).
  SECTION("bf16: within the rounding of its gradient buffers") {
    const double d = test::max_difference(test::assemble(passes_run<bf16>(false)),
                                          test::assemble(passes_run<bf16>(true)));
    INFO("bf16 " << d);
    CHECK(d <= 1e-4);
  }
  SECTION("a weight half with no input half before it is refused") {
    const auto message = testing::per_rank<std::string>(1, [&](LocalComm& world) {
      nn::GPT<double> model(pp_model());
      engine::Engine<nn::GPT<double>, ZeroStage<0>> eng(model, world, test::AdamW64{},
                                                        test::tp_options(1));
      nn::DeferredWeightGrads<double> deferred;
      return testing::thrown_message([&] { eng.weight_pass({0, eng.num_units()}, deferred); });
    });
    CHECK_THAT(message[0], Catch::Matchers::Contains("has no backward_input_pass waiting"));
  }
}

namespace {

// Two steps of 3 micro-batches through one engine's passes, with dropout: either each pass's
// backward right after its forward, or the three forwards first (each pass parked) and then
// the backwards in order (each resumed). `peak` gets the activation high-water mark, `pass`
// the bytes a parked pass holds.
std::vector<std::vector<test::HeldParam>> parked_run(bool park, std::size_t* peak = nullptr,
                                                     std::size_t* pass = nullptr) {
  return testing::per_rank<std::vector<test::HeldParam>>(1, [&](LocalComm& world) {
    nn::GPTConfig cfg = pp_model();
    cfg.dropout = 0.1;
    cfg.attn_dropout = 0.1;
    nn::GPT<double> model(cfg);
    engine::Engine<nn::GPT<double>, ZeroStage<1>> eng(model, world, test::AdamW64{},
                                                      test::tp_options(3));
    const engine::UnitRange all{0, eng.num_units()};
    CHECK(eng.parks(all));
    for (int step = 0; step < 2; ++step) {
      const test::GlobalBatch b(3 * test::micro_rows, step, cfg.vocab_size);
      std::vector<engine::ParkedPass<double>> parked;
      for (int m = 0; m < 3; ++m) {
        (void)eng.forward_pass(all, m, b.micro(m, 0, 1));
        if (park) {
          parked.push_back(eng.park_pass());
          if (pass != nullptr) *pass = parked.back().bytes();
        } else {
          (void)eng.backward_pass();
        }
      }
      for (auto& p : parked) {
        eng.resume_pass(std::move(p));
        (void)eng.backward_pass();
      }
      CHECK(eng.step());
    }
    if (peak != nullptr) *peak = eng.activation_peak_bytes();
    return test::held_params(eng);
  });
}

// A GPT whose units cannot park (a Model without the nn::ParksPasses methods).
struct UnparkedGPT : nn::GPT<double> {
  using nn::GPT<double>::GPT;
  bool parks_unit(int) const = delete;
};

}  // namespace

TEST_CASE(
    "Engine passes: parked passes resumed later equal passes run one after the other (bits, "
    "with dropout), each holding its own arena",
    "[unit][pipeline]") {
  std::size_t one = 0, three = 0, pass = 0;
  const auto in_turn = parked_run(false, &one);
  const auto parked = parked_run(true, &three, &pass);
  CHECK(test::max_difference(test::assemble(in_turn), test::assemble(parked)) == 0.0);
  // While the first backward runs, the other two passes' forward activations are held too.
  INFO("one pass at a time " << one << " bytes, three in flight " << three << ", a parked pass "
                             << pass);
  CHECK(pass > 0);
  CHECK(three == one + 2 * pass);
  SECTION("what is refused") {
    const auto messages = testing::per_rank<std::vector<std::string>>(1, [&](LocalComm& world) {
      std::vector<std::string> out;
      nn::GPT<double> model(pp_model());
      engine::Engine<nn::GPT<double>, ZeroStage<0>> eng(model, world, test::AdamW64{},
                                                        test::tp_options(2));
      const engine::UnitRange all{0, eng.num_units()};
      const test::GlobalBatch b(2 * test::micro_rows, 0, pp_model().vocab_size);
      out.push_back(testing::thrown_message([&] { (void)eng.park_pass(); }));
      (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
      engine::ParkedPass<double> p = eng.park_pass();
      (void)eng.forward_pass(all, 1, b.micro(1, 0, 1));
      out.push_back(testing::thrown_message([&] { eng.resume_pass(std::move(p)); }));
      (void)eng.backward_pass();
      eng.resume_pass(std::move(p));
      (void)eng.backward_pass();
      CHECK(eng.step());
      out.push_back(testing::thrown_message([&] { eng.resume_pass(std::move(p)); }));
      // A parked pass holds its place in the window: micro-batch 0 cannot start a third pass
      // of a window of 2 (its backward would land after the boundary's reductions), and the
      // window is open (no checkpoint load under it). Dropped, it gives the place back.
      (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
      p = eng.park_pass();
      CHECK_FALSE(eng.between_steps());
      out.push_back(testing::thrown_message([&] { (void)eng.load_checkpoint("no-such-dir"); }));
      (void)eng.forward_pass(all, 1, b.micro(1, 0, 1));
      (void)eng.backward_pass();
      out.push_back(
          testing::thrown_message([&] { (void)eng.forward_pass(all, 0, b.micro(0, 0, 1)); }));
      p = {};
      (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
      (void)eng.backward_pass();
      CHECK(eng.step());
      CHECK(eng.between_steps());
      UnparkedGPT unparked(pp_model());
      static_assert(nn::Model<UnparkedGPT> && !nn::ParksPasses<UnparkedGPT>);
      engine::Engine<UnparkedGPT, ZeroStage<0>> plain(unparked, world, test::AdamW64{},
                                                      test::tp_options(1));
      CHECK_FALSE(plain.parks({0, plain.num_units()}));
      (void)plain.forward_pass({0, plain.num_units()}, 0, b.micro(0, 0, 2));
      out.push_back(testing::thrown_message([&] { (void)plain.park_pass(); }));
      return out;
    });
    const auto& m = messages[0];
    REQUIRE(m.size() == 6);
    CHECK_THAT(m[0], Catch::Matchers::Contains("no pass is in flight"));
    CHECK_THAT(m[1], Catch::Matchers::Contains("of another pass are in flight"));
    CHECK_THAT(m[2], Catch::Matchers::Contains("resumed before"));
    CHECK_THAT(m[3], Catch::Matchers::Contains("middle of gradient accumulation"));
    CHECK_THAT(m[4], Catch::Matchers::Contains("already has the window's 2 passes (1 ran "
                                               "backward, 1 parked or in flight"));
    CHECK_THAT(m[5], Catch::Matchers::Contains("cannot park"));
  }
}

namespace {

// A GPT whose unit 1 throws in its forward or its backward when told to.
struct FailingGPT : nn::GPT<double> {
  using nn::GPT<double>::GPT;
  bool fail_forward = false, fail_backward = false;
  void forward_unit(int u, nn::StepContext<double>& ctx) {
    if (fail_forward && u == 1) throw nn::InputError("planted forward failure");
    nn::GPT<double>::forward_unit(u, ctx);
  }
  void backward_unit(int u, nn::StepContext<double>& ctx) {
    if (fail_backward && u == 1) throw nn::InputError("planted backward failure");
    nn::GPT<double>::backward_unit(u, ctx);
  }
};

}  // namespace

TEST_CASE(
    "Engine passes: a pass that throws ends as a micro-step does (a backward or either half of "
    "a split one ends the window until a load, a forward drops only its pass)",
    "[unit][pipeline]") {
  using Catch::Matchers::Contains;
  const auto after = testing::per_rank<std::vector<test::HeldParam>>(1, [&](LocalComm& world) {
    testing::TempDir dir("pass-failure");
    FailingGPT model(pp_model());
    engine::Engine<FailingGPT, ZeroStage<0>> eng(model, world, test::AdamW64{},
                                                 test::tp_options(2));
    const engine::UnitRange all{0, eng.num_units()};
    const test::GlobalBatch b(2 * test::micro_rows, 0, pp_model().vocab_size);
    eng.save_checkpoint(dir.path(), "start");
    auto recovered = [&] {
      CHECK(eng.between_steps());
      CHECK_THAT(testing::thrown_message([&] { (void)eng.forward_pass(all, 0, b.micro(0, 0, 1)); }),
                 Contains("load a checkpoint to continue"));
      (void)eng.load_checkpoint(dir.path(), "start");
      CHECK(eng.broken_reason().empty());
    };
    // A backward that stops part-way (the units above 1 done, the rest not) ends the window:
    // the engine is broken until a load, and a pass parked in that window cannot resume.
    (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
    engine::ParkedPass<double> parked = eng.park_pass();
    (void)eng.forward_pass(all, 1, b.micro(1, 0, 1));
    model.fail_backward = true;
    CHECK_THAT(testing::thrown_message([&] { (void)eng.backward_pass(); }),
               Contains("planted backward failure"));
    CHECK_THAT(eng.broken_reason(), Contains("a backward stopped part-way: planted backward"));
    CHECK_THAT(testing::thrown_message([&] { eng.resume_pass(std::move(parked)); }),
               Contains("a failure ended"));
    recovered();
    // The input half of a split backward: the products the units above 1 left are dropped
    // with the window they were aimed at.
    nn::DeferredWeightGrads<double> deferred;
    (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
    CHECK_THAT(testing::thrown_message([&] { (void)eng.backward_input_pass({}, deferred); }),
               Contains("planted backward failure"));
    model.fail_backward = false;
    CHECK(deferred.empty());
    CHECK_THAT(eng.broken_reason(), Contains("planted backward failure"));
    recovered();
    // The weight half.
    (void)eng.forward_pass(all, 0, b.micro(0, 0, 1));
    (void)eng.backward_input_pass({}, deferred);
    deferred.call([] { throw nn::InputError("planted weight failure"); });
    CHECK_THAT(testing::thrown_message([&] { eng.weight_pass(all, deferred); }),
               Contains("planted weight failure"));
    CHECK(deferred.empty());
    CHECK_THAT(eng.broken_reason(), Contains("a backward stopped part-way: planted weight"));
    recovered();
    // A forward that throws drops its pass alone: no backward runs over units whose forward
    // did not, its place in the window is given back and the window goes on.
    model.fail_forward = true;
    CHECK_THAT(testing::thrown_message([&] { (void)eng.forward_pass(all, 1, b.micro(1, 0, 1)); }),
               Contains("planted forward failure"));
    model.fail_forward = false;
    CHECK(eng.broken_reason().empty());
    CHECK(eng.between_steps());
    CHECK_THAT(testing::thrown_message([&] { (void)eng.backward_pass(); }),
               Contains("no pass is in flight"));
    for (int m = 0; m < 2; ++m) {
      (void)eng.forward_pass(all, m, b.micro(m, 0, 1));
      (void)eng.backward_pass();
    }
    CHECK(eng.step());
    return test::held_params(eng);
  });
  // After the loads, the step is the one a fresh engine takes: nothing of the failed passes
  // stayed in the gradients.
  const auto clean = testing::per_rank<std::vector<test::HeldParam>>(1, [&](LocalComm& world) {
    nn::GPT<double> model(pp_model());
    engine::Engine<nn::GPT<double>, ZeroStage<0>> eng(model, world, test::AdamW64{},
                                                      test::tp_options(2));
    const test::GlobalBatch b(2 * test::micro_rows, 0, pp_model().vocab_size);
    for (int m = 0; m < 2; ++m) {
      (void)eng.forward_pass({0, eng.num_units()}, m, b.micro(m, 0, 1));
      (void)eng.backward_pass();
    }
    CHECK(eng.step());
    return test::held_params(eng);
  });
  CHECK(test::max_difference(test::assemble(after), test::assemble(clean)) == 0.0);
}

TEST_CASE("Pipeline: the reported loss is the mean over the micro-batches on every rank",
          "[unit][pipeline]") {
  Layout l;
  l.pp = 2;
  const Outcome o = run_layout(l, 4, 1);
  REQUIRE(o.ranks.size() == 2);
  CHECK(o.ranks[0].loss == o.ranks[1].loss);
  CHECK(o.ranks[0].loss > 3.0);  // about log(64) for an untrained model
  CHECK(o.ranks[0].loss < 5.0);
}

TEST_CASE("Pipeline: 3D (dp 2, tp 2, pp 2) with ZeRO-1 and ZeRO-0 equals the reference",
          "[unit][pipeline]") {
  Layout l;
  l.tp = 2;
  l.dp = 2;
  l.pp = 2;
  for (int stage : {0, 1}) {
    const Outcome o = run_layout(l, 4, 2, stage);
    INFO("stage " << stage);
    CHECK(o.error <= 1e-10);
    CHECK(o.copies_differ == 0.0);
  }
}

TEST_CASE(
    "Pipeline with Megatron SP: every schedule at tp 2 x pp 2 equals the reference, the "
    "LayerNorms' gradients summed over tp in each unit's last backward of the window",
    "[unit][pipeline][tp]") {
  // A unit's last backward of the window is its last pass's: under ZB-H1 its input half, which
  // runs before the weight halves of earlier passes may have (the LayerNorms' products are not
  // deferred). A sum taken at any other pass would leave the later passes' shares out.
  for (ScheduleKind kind : parallel::pipeline::all_schedule_kinds) {
    Layout l;
    l.tp = 2;
    l.megatron_sp = true;
    l.schedule = kind;
    l.virtual_stages = kind == ScheduleKind::interleaved ? 2 : 1;
    const Outcome o = run_layout(l, 4, 2);
    INFO(name_of(kind) << ", tp 2 with SP, pp 2: worst difference " << o.error);
    CHECK(o.error <= 1e-10);
    CHECK(o.copies_differ == 0.0);
  }
}

TEST_CASE("Pipeline: the negative controls fail the comparison", "[unit][pipeline]") {
  Layout l;
  l.pp = 2;
  SECTION("the tied embedding's gradients not added over the first and last stages") {
    const Outcome o = run_layout(l, 4, 2, 1, /*reduce_tied=*/false);
    CHECK(o.error > 1e-4);
    CHECK(o.copies_differ > 1e-4);  // the two copies of the token table drift apart
  }
  SECTION("a reference that lost one micro-batch") {
    const auto ranks = testing::per_rank<RankResult>(
        2, [&](LocalComm& world) { return pipeline_rank<1>(world, l, 4, 2); });
    std::vector<std::vector<test::HeldParam>> held;
    for (const auto& r : ranks) held.push_back(r.params);
    // The first 3 of the 4 micro-batches' rows (GlobalBatch splits rows in micro-batch order).
    const auto wrong = test::reference<double>(pp_model(), test::micro_rows * 3, 2);
    CHECK(test::max_difference(test::assemble(held), wrong) > 1e-4);
  }
}

TEST_CASE("Pipeline: bad layouts are refused naming the value", "[unit][pipeline]") {
  auto refused = [](Layout l, int micro_batches, const std::string& words) {
    const auto messages = testing::per_rank<std::string>(l.pp, [&](LocalComm& world) {
      return testing::thrown_message([&] { (void)pipeline_rank<1>(world, l, micro_batches, 1); });
    });
    for (const auto& m : messages) CHECK_THAT(m, Catch::Matchers::Contains(words));
  };
  Layout l;
  l.pp = 2;
  l.schedule = ScheduleKind::interleaved;
  l.virtual_stages = 2;
  refused(l, 3, "3");  // interleaving needs micro-batches in multiples of pp
  l.schedule = ScheduleKind::one_f_one_b;
  refused(l, 4, "virtual_pipeline_model_parallel_size 2");
  l.schedule = ScheduleKind::interleaved;
  l.virtual_stages = 8;  // 16 virtual stages for 8 units
  refused(l, 4, "8 units, fewer than the 16");
  l.pp = 1;  // chunks need more than one stage (they would hand over to themselves)
  l.virtual_stages = 2;
  refused(l, 4, "needs more than one pipeline stage");
}

TEST_CASE("Pipeline: a schedule that cannot run the accumulation steps is refused when built",
          "[unit][pipeline]") {
  // Before, the engine was built and the first train_batch refused it.
  const auto messages = testing::per_rank<std::string>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.pp = 2}));
    nn::GPT<float> model(pp_model());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    PipelineOptions po;
    po.schedule = ScheduleKind::interleaved;
    po.virtual_stages = 2;
    return testing::thrown_message([&] {
      PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(model, world, groups,
                                                        test::adamw_config(1, 3, 1.0), po, options);
    });
  });
  for (const std::string& m : messages) {
    CHECK_THAT(m, Catch::Contains("micro_batches is 3") && Catch::Contains("multiple of 2"));
  }
}

namespace {

// f32 AdamW from a config on a (dp, pp) grid (pp 1: the plain engine): optionally loads `load`,
// trains `steps` steps from first_step on a global batch of 8 rows, optionally saves.
std::vector<test::HeldParam> f32_pipeline_rank(LocalComm& world, int dp, int pp, int first_step,
                                               int steps, const std::filesystem::path& load,
                                               const std::filesystem::path& save) {
  parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.dp = dp, .pp = pp}));
  nn::GPT<float> model(pp_model());
  const int micro_batches = 4 / dp;
  const Config config = test::adamw_config(1, micro_batches, 1.0);
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  auto batches_of = [&](int step) {
    auto b = std::make_shared<test::GlobalBatch>(8, step, pp_model().vocab_size);
    std::vector<engine::MicroBatch> out;
    for (int m = 0; m < micro_batches; ++m) out.push_back(b->micro(m, groups.dp().rank(), dp));
    return std::make_pair(b, out);
  };
  if (pp == 1) {
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, groups, config, options);
    if (!load.empty()) eng.load_checkpoint(load);
    for (int step = first_step; step < first_step + steps; ++step) {
      const auto [b, batches] = batches_of(step);
      for (const auto& mb : batches) {
        eng.forward(mb);
        eng.backward();
      }
      eng.step();
    }
    if (!save.empty()) eng.save_checkpoint(save, "step2");
    return test::held_params(eng);
  }
  PipelineOptions po;
  po.partition_method = "parameters";
  PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(model, world, groups, config, po, options);
  if (!load.empty()) pipe.engine().load_checkpoint(load);
  for (int step = first_step; step < first_step + steps; ++step) {
    const auto [b, batches] = batches_of(step);
    pipe.train_batch(batches);
  }
  if (!save.empty()) pipe.engine().save_checkpoint(save, "step2");
  return test::held_params(pipe.engine());
}

}  // namespace

TEST_CASE(
    "Pipeline checkpoints: (dp 2, pp 2) resumes at (dp 1, pp 4) and at (dp 4) without a "
    "pipeline, equal to the uninterrupted run",
    "[unit][pipeline]") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("zero-pp-ckpt-" + std::to_string(static_cast<long>(::getpid())));
  std::filesystem::remove_all(dir);
  auto run = [&](int dp, int pp, int first, int steps, const std::filesystem::path& load,
                 const std::filesystem::path& save) {
    return test::assemble(testing::per_rank<std::vector<test::HeldParam>>(
        dp * pp,
        [&](LocalComm& w) { return f32_pipeline_rank(w, dp, pp, first, steps, load, save); }));
  };
  const auto saved = run(2, 2, 0, 2, {}, dir);
  const auto straight = run(2, 2, 0, 4, {}, {});  // the same four steps, never interrupted
  const auto continued = run(2, 2, 2, 2, dir, {});
  const auto at_pp4 = run(1, 4, 2, 2, dir, {});  // stage boundaries moved
  const auto plain = run(4, 1, 2, 2, dir, {});   // no pipeline at all
  // The same layout resumes exactly: masters, Adam moments and step counts, the tied replica's.
  CHECK(test::max_difference(continued, straight) == 0.0);
  // Rounding only (f32, other reduction orders); a lost slice or optimizer state is far larger.
  CHECK(test::max_difference(at_pp4, continued) <= 2e-5);
  CHECK(test::max_difference(plain, continued) <= 2e-5);
  CHECK(test::max_difference(continued, saved) > 1e-4);  // the resumed steps did train
  std::filesystem::remove_all(dir);
}

TEST_CASE("Pipeline checkpoints: a larger model's checkpoint is refused, as without a pipeline",
          "[unit][pipeline]") {
  // 8 layers saved, 6 loaded at pp 2: each stage found all of its own tensors, so the two extra
  // blocks were dropped without a word (only the engine without a pipeline checked).
  testing::TempDir dir("pp-larger");
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  LocalComm::run(1, [&](LocalComm& world) {
    nn::GPTConfig larger = pp_model();
    larger.num_layers = 8;
    nn::GPT<float> model(larger);
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, world, test::adamw_config(1, 1, 1.0),
                                                     options);
    eng.save_checkpoint(dir.path(), "larger");
  });
  const auto messages = testing::per_rank<std::string>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.dp = 1, .pp = 2}));
    nn::GPT<float> model(pp_model());
    PipelineOptions po;
    po.partition_method = "parameters";
    PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(model, world, groups,
                                                      test::adamw_config(1, 4, 1.0), po, options);
    return testing::thrown_message(
        [&] { (void)pipe.engine().load_checkpoint(dir.path(), "larger"); });
  });
  for (const std::string& m : messages) {
    CHECK_THAT(m, Catch::Contains("tensor(s) this model does not have") &&
                      Catch::Contains("transformer.h.6.") && Catch::Contains("Nothing was loaded"));
  }
}

namespace {

// Two steps of 2 micro-batches at ZeRO stage S over 2 ranks, through forward()/backward() or
// through the passes over the whole model, optionally evaluating after each backward pass (which
// releases the units it gathered at stage 3).
template <int S>
test::LogicalValues staged_run(bool passes, bool evaluate) {
  return test::assemble(testing::per_rank<std::vector<test::HeldParam>>(2, [&](LocalComm& world) {
    nn::GPT<double> model(pp_model());
    engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, world, test::AdamW64{},
                                                      test::tp_options(2));
    const engine::UnitRange all{0, eng.num_units()};
    for (int step = 0; step < 2; ++step) {
      const test::GlobalBatch b(4 * test::micro_rows, step, pp_model().vocab_size);
      for (int m = 0; m < 2; ++m) {
        const engine::MicroBatch mb = b.micro(m, world.rank(), 2);
        if (passes) {
          (void)eng.forward_pass(all, m, mb);
          (void)eng.backward_pass();
          if (evaluate) (void)eng.evaluate_pass(all, mb);
        } else {
          eng.forward(mb);
          eng.backward();
        }
      }
      CHECK(eng.step());
    }
    return test::held_params(eng);
  }));
}

// Stage 3 over 2 ranks through two ranges, R0 = [0, 2) and R1 = [2, N) (the tied head in R1),
// per micro-batch: F(R0) parked, F(R1), B(R1), an evaluation, then R0 resumed and B(R0). R1's
// backward leaves the head's product in the embedding's gradient buffer, which R0's backward
// adds to and reduces; the evaluation (which releases the gathered units) must not drop it.
test::LogicalValues split_ranges_run() {
  return test::assemble(testing::per_rank<std::vector<test::HeldParam>>(2, [&](LocalComm& world) {
    nn::GPT<double> model(pp_model());
    engine::Engine<nn::GPT<double>, ZeroStage<3>> eng(model, world, test::AdamW64{},
                                                      test::tp_options(2));
    const int n = eng.num_units();
    const engine::UnitRange r0{0, 2}, r1{2, n}, all{0, n};
    for (int step = 0; step < 2; ++step) {
      const test::GlobalBatch b(4 * test::micro_rows, step, pp_model().vocab_size);
      for (int m = 0; m < 2; ++m) {
        const engine::MicroBatch mb = b.micro(m, world.rank(), 2);
        const Tensor<double> x = eng.forward_pass(r0, m, mb);
        std::vector<double> x_kept(x.data(), x.data() + x.numel());
        const Shape x_shape = x.shape();
        auto parked = eng.park_pass();
        (void)eng.forward_pass(r1, m, mb, Tensor<double>(x_kept.data(), x_shape));
        const Tensor<double> dx = eng.backward_pass();
        std::vector<double> dy(dx.data(), dx.data() + dx.numel());
        const Shape dy_shape = dx.shape();
        (void)eng.evaluate_pass(all, mb);
        eng.resume_pass(std::move(parked));
        (void)eng.backward_pass(Tensor<double>(dy.data(), dy_shape));
      }
      CHECK(eng.step());
    }
    return test::held_params(eng);
  }));
}

}  // namespace

TEST_CASE("Engine passes at ZeRO stages 2-3 equal forward and backward", "[unit][pipeline]") {
  // A backward pass leaves its last reductions in flight (up to max_pending_reductions), reading
  // the units' gradient buffers. The next pass's backward used to accumulate into those buffers
  // (the tied head into unit 0's, whose reduction then dropped the head's part), and at stage 3
  // a discarded pass (evaluate) released them while their reductions read them.
  const auto whole2 = staged_run<2>(false, false);
  const auto whole3 = staged_run<3>(false, false);
  CHECK(test::max_difference(staged_run<2>(true, false), whole2) <= 1e-15);
  CHECK(test::max_difference(staged_run<3>(true, false), whole3) <= 1e-15);
  CHECK(test::max_difference(staged_run<3>(true, true), whole3) <= 1e-15);
  // The tied head's part of the embedding's gradient survives an evaluation between the ranges'
  // backwards (it was dropped with the buffer the evaluation released).
  CHECK(test::max_difference(split_ranges_run(), whole3) <= 1e-15);
  CHECK(test::max_difference(whole2, whole3) <= 1e-12);
}

TEST_CASE("Pipeline: a GPT-2 weights export is refused (each stage holds its own units)",
          "[unit][pipeline]") {
  // Rank 0 of each stage wrote the same file with its own stage's tensors, and every rank
  // reported success; now every rank refuses, and no file appears.
  const auto file =
      std::filesystem::temp_directory_path() /
      ("zero-pp-export-" + std::to_string(static_cast<long>(::getpid())) + ".safetensors");
  const auto messages = testing::per_rank<std::string>(2, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.dp = 1, .pp = 2}));
    nn::GPT<float> model(pp_model());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    PipelineOptions po;
    po.partition_method = "parameters";
    PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(model, world, groups,
                                                      test::adamw_config(1, 1, 1.0), po, options);
    return testing::thrown_message([&] { engine::save_gpt2_weights(pipe.engine(), file); });
  });
  for (const std::string& m : messages) {
    CHECK_THAT(m, Catch::Contains("split over 2 pipeline stages") &&
                      Catch::Contains("zero_to_safetensors"));
  }
  CHECK_FALSE(std::filesystem::exists(file));
}

namespace {

// A model of `units` units that each sleep `forward` in their forward and twice that in their
// backward (a calibrated cost, not a wait for another rank), passing a [rows] activation
// through x -> w_u * x; the last unit's loss is the mean output. A split backward sleeps half
// in its input half and leaves the other half, with the weight product, to the weight half.
// With parks = false its units say they cannot park (a model with a layer that does not).
class DelayModel {
 public:
  using value_type = double;
  DelayModel(int units, std::chrono::microseconds forward, bool parks = true)
      : units_(units), forward_(forward), parks_(parks) {
    w_.resize(static_cast<std::size_t>(units));
  }
  bool parks_unit(int) const { return parks_; }
  std::any park_unit(int u) { return std::exchange(inputs_[static_cast<std::size_t>(u)], {}); }
  void resume_unit(int u, std::any saved) {
    inputs_[static_cast<std::size_t>(u)] = std::any_cast<Tensor<double>>(saved);
  }
  int num_units() const { return units_; }
  std::vector<nn::ParamSpec> unit_params(int u) const {
    return {{"w" + std::to_string(u), Shape{1}, nn::Init::normal, 0.5, false}};
  }
  std::vector<int> unit_uses(int) const { return {}; }
  void bind_unit(int u, std::span<const nn::ParamView<double>> views) {
    w_[static_cast<std::size_t>(u)] = views[0];
  }
  void forward_unit(int u, nn::StepContext<double>& ctx) {
    std::this_thread::sleep_for(forward_);
    Tensor<double> y = ctx.arena->allocate<double>(Shape{ctx.batch});
    for (std::int64_t b = 0; b < ctx.batch; ++b) {
      const double x =
          u == 0 ? static_cast<double>(ctx.tokens[b * ctx.seq_len] % 7) : ctx.x.data()[b];
      y.data()[b] = w(u) * x;
    }
    inputs_[static_cast<std::size_t>(u)] = ctx.x;
    ctx.x = y;
    if (u + 1 == units_) {
      double sum = 0;
      for (std::int64_t b = 0; b < ctx.batch; ++b) sum += y.data()[b];
      ctx.loss = sum / static_cast<double>(ctx.batch);
    }
  }
  void backward_unit(int u, nn::StepContext<double>& ctx) {
    std::this_thread::sleep_for(ctx.weight_grads != nullptr ? forward_ : 2 * forward_);
    Tensor<double> dx = ctx.arena->allocate<double>(Shape{ctx.batch});
    Tensor<double> dy = ctx.arena->allocate<double>(Shape{ctx.batch});
    Tensor<double> x = ctx.arena->allocate<double>(Shape{ctx.batch});
    for (std::int64_t b = 0; b < ctx.batch; ++b) {
      dy.data()[b] =
          u + 1 == units_ ? ctx.loss_scale / static_cast<double>(ctx.batch) : ctx.dy.data()[b];
      x.data()[b] = u == 0 ? static_cast<double>(ctx.tokens[b * ctx.seq_len] % 7)
                           : inputs_[static_cast<std::size_t>(u)].data()[b];
      dx.data()[b] = dy.data()[b] * w(u);
    }
    // The weight gradient: a [rows] x [rows] product into the 1 x 1 weight.
    nn::linear_backward<double>(ctx, nullptr, w_[static_cast<std::size_t>(u)].grad.data(), nullptr,
                                dy.data(), x.data(), nullptr, ctx.batch, 1, 1);
    if (ctx.weight_grads != nullptr) {
      ctx.weight_grads->call([d = forward_] { std::this_thread::sleep_for(d); });
    }
    ctx.dx = dx;
    ctx.dy = dx;
  }

 private:
  double w(int u) const { return w_[static_cast<std::size_t>(u)].value.data()[0]; }
  int units_;
  std::chrono::microseconds forward_;
  bool parks_;
  std::vector<nn::ParamView<double>> w_;
  std::array<Tensor<double>, 16> inputs_{};
};

// What one rank of a DelayModel pipeline (pp stages x v chunks, one unit each) measured in its
// second train_batch, and its weights after it.
struct DelayRun {
  parallel::pipeline::PipelineStep step;
  std::vector<test::HeldParam> params;
};
std::vector<DelayRun> delay_pipeline(ScheduleKind kind, int pp, int v, int micro_batches,
                                     std::chrono::microseconds forward, bool parks) {
  return testing::per_rank<DelayRun>(pp, [&](LocalComm& world) {
    parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.pp = pp}));
    DelayModel model(pp * v, forward, parks);
    PipelineOptions options;
    options.schedule = kind;
    options.virtual_stages = v;
    options.partition_method = "uniform";
    engine::EngineOptions eo;
    eo.gradient_accumulation_steps = micro_batches;
    PipelineEngine<DelayModel, ZeroStage<0>> pipe(
        model, world, groups,
        [](int, std::span<double> p, std::span<const double> g) { p[0] -= 0.01 * g[0]; }, options,
        eo);
    const test::GlobalBatch b(micro_batches * test::micro_rows, 0, 64);
    std::vector<engine::MicroBatch> batches;
    for (int m = 0; m < micro_batches; ++m) batches.push_back(b.micro(m, 0, 1));
    (void)pipe.train_batch(batches);  // the first step also touches every buffer once
    DelayRun out;
    out.step = pipe.train_batch(batches);
    out.params = test::held_params(pipe.engine());
    return out;
  });
}

// The bubble fraction train_batch measures at pp stages x v chunks (one unit each).
double measured_bubble(ScheduleKind kind, int pp, int v, int micro_batches, bool parks = true) {
  return delay_pipeline(kind, pp, v, micro_batches, std::chrono::milliseconds(10), parks)[0]
      .step.bubble_fraction;
}

}  // namespace

TEST_CASE(
    "Pipeline: a model that cannot park has its forwards recomputed where the checker charges "
    "them, to the same weights as parking",
    "[unit][pipeline]") {
  const int pp = 4, m = 8;
  for (auto [kind, v] :
       {std::pair{ScheduleKind::gpipe, 1}, std::pair{ScheduleKind::one_f_one_b, 1},
        std::pair{ScheduleKind::interleaved, 2}, std::pair{ScheduleKind::zero_bubble, 1}}) {
    INFO(name_of(kind));
    const auto parked = delay_pipeline(kind, pp, v, m, {}, true);
    const auto recomputed = delay_pipeline(kind, pp, v, m, {}, false);
    const auto report =
        parallel::pipeline::check_schedule(parallel::pipeline::make_schedule(kind, {pp, m, v}));
    for (int s = 0; s < pp; ++s) {
      const auto i = static_cast<std::size_t>(s);
      CHECK(parked[i].step.recomputed_forwards == 0);
      CHECK(recomputed[i].step.recomputed_forwards == report.stages[i].recomputed_forwards);
      CHECK(test::max_difference(test::assemble({parked[i].params}),
                                 test::assemble({recomputed[i].params})) == 0.0);
    }
    // The last stage of 1F1B runs each backward right after its forward.
    if (kind == ScheduleKind::one_f_one_b)
      CHECK(report.stages[static_cast<std::size_t>(pp - 1)].recomputed_forwards == 0);
  }
}

TEST_CASE(
    "Pipeline: with a calibrated cost per forward and backward, the measured bubble is (pp-1)/m "
    "for 1F1B and (pp-1)/(v*m) interleaved (within 10%), and ZB-H1's is lower than 1F1B's",
    "[slow][pipeline]") {
  using parallel::pipeline::check_schedule;
  using parallel::pipeline::make_schedule;
  using parallel::pipeline::OpCosts;
  const int pp = 4, m = 8;
  // The DelayModel's costs in units of its 10 ms forward: B = 2, split into 1 + 1. Its units
  // park, so every stage runs the same work and the simulation is the textbook figure.
  const OpCosts equal_stages{1.0, 2.0, 1.0, 1.0, 0.0};
  auto simulated = [&](ScheduleKind kind, int v) {
    return check_schedule(make_schedule(kind, {pp, m, v}), equal_stages).bubble_fraction;
  };
  CHECK(simulated(ScheduleKind::one_f_one_b, 1) == Approx(3.0 / 8.0));
  CHECK(simulated(ScheduleKind::interleaved, 2) == Approx(3.0 / 16.0));
  const double one_f_one_b = measured_bubble(ScheduleKind::one_f_one_b, pp, 1, m);
  const double interleaved = measured_bubble(ScheduleKind::interleaved, pp, 2, m);
  const double zb = measured_bubble(ScheduleKind::zero_bubble, pp, 1, m);
  INFO("1F1B " << one_f_one_b << " (textbook " << 3.0 / 8.0 << "), interleaved " << interleaved
               << " (" << 3.0 / 16.0 << "), ZB-H1 " << zb << " (simulated "
               << simulated(ScheduleKind::zero_bubble, 1) << ")");
  CHECK(std::fabs(one_f_one_b - 3.0 / 8.0) <= 0.1 * 3.0 / 8.0);
  CHECK(std::fabs(interleaved - 3.0 / 16.0) <= 0.1 * 3.0 / 16.0);
  const double zb_simulated = simulated(ScheduleKind::zero_bubble, 1);
  CHECK(std::fabs(zb - zb_simulated) <= 0.1 * zb_simulated);
  // ZB-H1 fills 1F1B's cooldown with weight halves, measured and simulated.
  CHECK(zb < one_f_one_b);
  CHECK(zb_simulated < simulated(ScheduleKind::one_f_one_b, 1));
}

// A program that picks its Engine by policies names the pipeline engine of the same policies.
static_assert(
    std::is_same_v<
        parallel::pipeline::pipeline_engine_of_t<engine::Engine<nn::GPT<float>, ZeroStage<1>>>,
        PipelineEngine<nn::GPT<float>, ZeroStage<1>>>);

TEST_CASE("Pipeline partition: uniform, parameters and type:<regex>, and what they refuse",
          "[unit][pipeline]") {
  using parallel::pipeline::partition_balanced;
  using parallel::pipeline::partition_model;
  using parallel::pipeline::partition_units;
  nn::GPT<double> model(pp_model());  // Embedding, 6 TransformerBlocks, LMHead
  auto ranges = [](const parallel::pipeline::Partition& p) {
    std::vector<std::pair<int, int>> out;
    for (const auto& r : p.parts) out.emplace_back(r.first, r.last);
    return out;
  };
  SECTION("uniform: the first parts take one more, and an uneven split warns with the rule") {
    const auto p = partition_model(model, "uniform", 3, 1);
    CHECK(ranges(p) == std::vector<std::pair<int, int>>{{0, 3}, {3, 6}, {6, 8}});
    CHECK(p.describe() == "0-2 | 3-5 | 6-7");  // each part's first and last unit
    REQUIRE(p.warnings.size() == 1);
    CHECK_THAT(p.warnings[0], Catch::Matchers::Contains("k * 3 - 2"));
    CHECK(partition_model(model, "uniform", 4, 1).warnings.empty());  // 8 = 6 + 2 units
  }
  SECTION("parameters: the largest part is the smallest any cut achieves") {
    CHECK(partition_balanced({1, 1, 1, 1, 4}, 2) == std::vector<engine::UnitRange>{{0, 4}, {4, 5}});
    // Against every cut of 7 units into 3 parts.
    const std::vector<double> w = {5, 1, 3, 8, 2, 2, 7};
    double best = 1e30;
    for (int a = 1; a < 7; ++a) {
      for (int b = a + 1; b < 7; ++b) {
        auto sum = [&](int from, int to) {
          double s = 0;
          for (int i = from; i < to; ++i) s += w[static_cast<std::size_t>(i)];
          return s;
        };
        best = std::min(best, std::max({sum(0, a), sum(a, b), sum(b, 7)}));
      }
    }
    double largest = 0;
    for (const auto& r : partition_balanced(w, 3)) {
      double s = 0;
      for (int i = r.first; i < r.last; ++i) s += w[static_cast<std::size_t>(i)];
      largest = std::max(largest, s);
    }
    CHECK(largest == best);
    // The tiny GPT's embedding (V*C + T*C = 1280) and head (ln_f: 32; its matrix is the tied
    // table) weigh less than a block (3.3k): the embedding and 3 blocks, then 3 blocks and the
    // head (11.2k and 9.9k; cutting after 2 blocks would leave 13.2k on stage 1).
    const auto p = partition_model(model, "parameters", 2, 1);
    CHECK(ranges(p) == std::vector<std::pair<int, int>>{{0, 4}, {4, 8}});
  }
  SECTION("type:<regex> balances the matching units, the ends stay first and last") {
    const auto p = partition_model(model, "type:transformerblock", 3, 1);  // case-insensitive
    REQUIRE(p.parts.size() == 3);
    for (const auto& r : p.parts) {
      int blocks = 0;
      for (int u = r.first; u < r.last; ++u) blocks += model.unit_type(u) == "TransformerBlock";
      CHECK(blocks == 2);
    }
    CHECK(p.parts.front().first == 0);
    CHECK(p.parts.back().last == model.num_units());
  }
  SECTION("refused naming the value") {
    CHECK_THROWS_WITH(partition_model(model, "type:Mixer", 2, 1),
                      Catch::Matchers::Contains("'type:Mixer' matches no unit"));
    CHECK_THROWS_WITH(partition_model(model, "best", 2, 1),
                      Catch::Matchers::Contains("'best' is not a partition method"));
    CHECK_THROWS_WITH(partition_model(model, "type:[Block", 2, 1),
                      Catch::Matchers::Contains("the regex after type: is invalid"));
    CHECK_THROWS_WITH(partition_units("uniform", 4, 4, {1, 1, 1}, {"a", "b", "c"}),
                      Catch::Matchers::Contains("3 units, fewer than the 16"));
  }
}
