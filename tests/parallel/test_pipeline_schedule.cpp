// Pipeline schedules as data and their static checker: every schedule of a sweep passes, the
// bubble and memory figures of the literature come out exactly, and hand-made broken lists are
// refused with the stage, the instruction index and the peer named.

#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <parallel/pipeline/schedule.hpp>
#include <parallel/pipeline/schedule_check.hpp>

using namespace zero;
using namespace zero::parallel::pipeline;
using Catch::Contains;

namespace {

// The message check_schedule refuses s with, or "" when it accepts it.
std::string refusal(const Schedule& s) {
  try {
    (void)check_schedule(s);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return {};
}

// The figures each schedule must reach with the default costs (F = 1, B = 2, and for ZB-H1
// B_input = W = 1), in the units check_schedule counts: live (micro, chunk) pairs.
struct Expected {
  double bubble;
  std::vector<int> peak;  // per stage
};

Expected expected(ScheduleKind kind, ScheduleShape sh) {
  const int pp = sh.stages, m = sh.micro_batches, v = sh.virtual_stages;
  Expected e{0.0, std::vector<int>(static_cast<std::size_t>(pp))};
  for (int s = 0; s < pp; ++s) {
    int& peak = e.peak[static_cast<std::size_t>(s)];
    switch (kind) {
      case ScheduleKind::gpipe:
        peak = m;
        break;
      case ScheduleKind::one_f_one_b:
      case ScheduleKind::zero_bubble:
        peak = std::min(pp - s, m);
        break;
      case ScheduleKind::interleaved:
        // Warmup forwards plus the steady state's one (Megatron's num_warmup_microbatches + 1).
        peak = std::min(2 * (pp - s - 1) + (v - 1) * pp + 1, m * v);
        break;
    }
  }
  // GPipe and 1F1B: (pp-1)(F+B) of fill and drain against m(F+B) of work. Interleaved: the
  // same fill in chunk steps, against v times the steps. These hold exactly (not only for
  // m >= pp), because every cost here is a small integer.
  e.bubble = static_cast<double>(pp - 1) / (v * m);
  // ZB-H1 with at most pp-s activations live until W: the last stage runs F, B, W of one
  // micro-batch after the other, and a gradient needs pp-1 B's to reach stage 0, whose last W
  // follows: the makespan is 3m + 2(pp-1), two thirds of 1F1B's bubble of 3(pp-1).
  if (kind == ScheduleKind::zero_bubble) e.bubble = 2.0 * (pp - 1) / (3.0 * m);
  return e;
}

// Builds and checks every schedule whose shape is valid; returns how many it checked. The
// per-stage comparisons report only failures, so a sweep of thousands stays quick.
int sweep(const std::vector<int>& stage_counts, const std::vector<int>& micro_batch_counts,
          int max_virtual_stages) {
  int checked = 0;
  for (ScheduleKind kind : all_schedule_kinds) {
    for (int pp : stage_counts) {
      for (int m : micro_batch_counts) {
        for (int v = 1; v <= max_virtual_stages; ++v) {
          const ScheduleShape shape{pp, m, v};
          if (!shape_problem(kind, shape).empty()) continue;
          const Schedule s = make_schedule(kind, shape);
          ScheduleReport r;
          try {
            r = check_schedule(s);
          } catch (const ScheduleError& e) {
            FAIL_CHECK(e.what());
            continue;
          }
          const Expected want = expected(kind, shape);
          bool ok = r.bubble_fraction == want.bubble;
          for (int st = 0; st < pp; ++st) {
            ok = ok && r.stages[static_cast<std::size_t>(st)].peak_live_activations ==
                           want.peak[static_cast<std::size_t>(st)];
          }
          if (!ok) {
            FAIL_CHECK(name_of(kind)
                       << " pp " << pp << " m " << m << " v " << v << ": bubble "
                       << r.bubble_fraction << ", expected " << want.bubble << "; peak on stage 0 "
                       << r.stages[0].peak_live_activations << ", expected " << want.peak[0]);
          }
          ++checked;
        }
      }
    }
  }
  return checked;
}

// A hand-made GPipe with pp = 2, m = 2 that the checker accepts; the refusal tests break it.
//   stage 0: F0, send0, F1, send1, recv-grad0, B0, recv-grad1, B1
//   stage 1: recv0, F0, recv1, F1, B0, send-grad0, B1, send-grad1
Schedule two_stage_gpipe() {
  Schedule s{ScheduleKind::gpipe, {2, 2, 1}, {}};
  s.stages = {{{Op::forward, 0, 0, -1},
               {Op::send_activation, 0, 0, 1},
               {Op::forward, 1, 0, -1},
               {Op::send_activation, 1, 0, 1},
               {Op::recv_gradient, 0, 0, 1},
               {Op::backward, 0, 0, -1},
               {Op::recv_gradient, 1, 0, 1},
               {Op::backward, 1, 0, -1}},
              {{Op::recv_activation, 0, 0, 0},
               {Op::forward, 0, 0, -1},
               {Op::recv_activation, 1, 0, 0},
               {Op::forward, 1, 0, -1},
               {Op::backward, 0, 0, -1},
               {Op::send_gradient, 0, 0, 0},
               {Op::backward, 1, 0, -1},
               {Op::send_gradient, 1, 0, 0}}};
  return s;
}

}  // namespace

TEST_CASE("Schedule names, parsing and instruction text", "[unit][pipeline]") {
  for (ScheduleKind k : all_schedule_kinds) CHECK(parse_schedule_kind(name_of(k)) == k);
  CHECK(parse_schedule_kind("1f1b") == ScheduleKind::one_f_one_b);
  CHECK(parse_schedule_kind("zb-h1") == ScheduleKind::zero_bubble);
  CHECK_THROWS_AS(parse_schedule_kind("pipedream"), ConfigError);
  CHECK_THROWS_WITH(parse_schedule_kind("pipedream"),
                    Contains("'pipedream'") && Contains("gpipe, 1f1b, interleaved or zb"));
  CHECK(to_string({Op::recv_gradient, 3, 1, 2}) == "recv gradient (micro 3, chunk 1) from stage 2");
  CHECK(to_string({Op::send_activation, 0, 0, 1}) ==
        "send activation (micro 0, chunk 0) to stage 1");
  CHECK(to_string({Op::backward_weight, 5, 0}) == "backward weight (micro 5, chunk 0)");
  CHECK(is_compute(Op::backward_input));
  CHECK_FALSE(is_compute(Op::recv_activation));
  CHECK(is_send(Op::send_gradient));
  CHECK_FALSE(is_send(Op::recv_gradient));
  CHECK(is_recv(Op::recv_activation));
}

TEST_CASE("Neighbours of a chunk wrap from the last stage to the first", "[unit][pipeline]") {
  const ScheduleShape sh{4, 8, 2};  // virtual stages 0..7; chunk 1 of stage 0 is 4
  CHECK(virtual_stage(sh, {0, 1}) == 4);
  CHECK(activation_target(sh, {3, 0}) == StageChunk{0, 1});
  CHECK(activation_target(sh, {1, 1}) == StageChunk{2, 1});
  CHECK_FALSE(activation_target(sh, {3, 1}).has_value());
  CHECK(gradient_target(sh, {0, 1}) == StageChunk{3, 0});
  CHECK_FALSE(gradient_target(sh, {0, 0}).has_value());
}

TEST_CASE("Every schedule passes the checker over a strided sweep", "[unit][pipeline]") {
  const int checked =
      sweep({1, 2, 3, 4, 5, 8, 16, 64}, {1, 2, 3, 4, 7, 8, 16, 64, 256}, /*max_virtual_stages=*/4);
  CHECK(checked > 250);
}

TEST_CASE("Every schedule passes the checker for pp 2..64 x m 1..256 x v 1..4",
          "[slow][pipeline]") {
  std::vector<int> stage_counts, micro_batch_counts;
  for (int pp = 2; pp <= 64; ++pp) stage_counts.push_back(pp);
  for (int m = 1; m <= 256; ++m) micro_batch_counts.push_back(m);
  CHECK(sweep(stage_counts, micro_batch_counts, 4) == 51183);
}

TEST_CASE("Bubble fractions and peak activations are the literature's", "[unit][pipeline]") {
  // pp = 4, m = 8, as in Narayanan et al. 2021 and the table of docs/pipeline.md.
  const ScheduleReport gpipe = check_schedule(make_schedule(ScheduleKind::gpipe, {4, 8, 1}));
  const ScheduleReport one_f = check_schedule(make_schedule(ScheduleKind::one_f_one_b, {4, 8, 1}));
  const ScheduleReport inter2 = check_schedule(make_schedule(ScheduleKind::interleaved, {4, 8, 2}));
  const ScheduleReport inter4 = check_schedule(make_schedule(ScheduleKind::interleaved, {4, 8, 4}));
  const ScheduleReport zb = check_schedule(make_schedule(ScheduleKind::zero_bubble, {4, 8, 1}));

  CHECK(gpipe.bubble_fraction == 3.0 / 8);  // (pp-1)/m
  CHECK(one_f.bubble_fraction == 3.0 / 8);
  CHECK(gpipe.makespan == 33.0);  // (m + pp - 1)(F + B)
  CHECK(one_f.makespan == 33.0);
  for (const StageReport& s : gpipe.stages) CHECK(s.peak_live_activations == 8);
  for (int s = 0; s < 4; ++s) CHECK(one_f.stages[s].peak_live_activations == 4 - s);
  CHECK(one_f.stages[0].busy == 24.0);
  CHECK(one_f.stages[0].finish == 33.0);
  CHECK(one_f.stages[3].finish == 27.0);  // busy from 3 to 27; the last gradients go upstream

  // Interleaved: (pp-1)/(v m) exactly (the reference's simulation of Megatron's orders gives
  // it to 4 decimals; here the costs are integers, so it is exact). Peaks count chunks: stage 0
  // holds 2(pp-1) + (v-1)pp + 1 of them, 11 for v = 2 (5.5 stage-sized activations).
  CHECK(inter2.bubble_fraction == 3.0 / 16);
  CHECK(inter4.bubble_fraction == 3.0 / 32);
  CHECK(inter2.stages[0].peak_live_activations == 11);
  CHECK(inter2.stages[3].peak_live_activations == 5);
  CHECK(inter4.stages[0].peak_live_activations == 19);

  // ZB-H1 with F = B_input = W = 1 against 1F1B with F = 1, B = B_input + W = 2: the same
  // work, a lower bubble (2/3 of it, see expected()), no stage holding more activations.
  CHECK(zb.stages[0].busy == one_f.stages[0].busy);
  CHECK(zb.bubble_fraction == 2.0 * 3 / (3.0 * 8));
  CHECK(zb.bubble_fraction < one_f.bubble_fraction);
  for (int s = 0; s < 4; ++s)
    CHECK(zb.stages[s].peak_live_activations <= one_f.stages[s].peak_live_activations);

  // 1F1B keeps its bubble for other costs, and with m < pp stage s holds min(pp - s, m).
  const ScheduleReport slow_backward =
      check_schedule(make_schedule(ScheduleKind::one_f_one_b, {8, 32, 1}), {1.0, 3.0, 1.0, 2.0});
  CHECK(slow_backward.bubble_fraction == 7.0 / 32);
  const ScheduleReport few = check_schedule(make_schedule(ScheduleKind::one_f_one_b, {8, 3, 1}));
  CHECK(few.stages[0].peak_live_activations == 3);
  CHECK(few.stages[7].peak_live_activations == 1);
  // Recomputation (OpCosts::recompute_forward, as StageExecutor): a backward pays one forward
  // more unless its own forward ran just before. 1F1B's stage s < pp-1 recomputes all m (its
  // forwards are followed by the next forward or a backward of an older micro-batch), the last
  // stage none; GPipe all m on every stage (its backwards run micro-batches 0..m-1, so none follows
  // its own forward).
  OpCosts recompute;
  recompute.recompute_forward = 1.0;
  const ScheduleReport one_f_re =
      check_schedule(make_schedule(ScheduleKind::one_f_one_b, {4, 8, 1}), recompute);
  const ScheduleReport gpipe_re =
      check_schedule(make_schedule(ScheduleKind::gpipe, {4, 8, 1}), recompute);
  for (int s = 0; s < 3; ++s) CHECK(one_f_re.stages[s].recomputed_forwards == 8);
  CHECK(one_f_re.stages[3].recomputed_forwards == 0);
  CHECK(one_f_re.stages[0].busy == 32.0);
  CHECK(one_f_re.stages[3].busy == 24.0);
  for (const StageReport& s : gpipe_re.stages) CHECK(s.recomputed_forwards == 8);
  CHECK(one_f.stages[0].recomputed_forwards == 8);  // counted whatever it costs
}

TEST_CASE("ZB-H1 splits every backward and is a function of the shape", "[unit][pipeline]") {
  const Schedule s = make_schedule(ScheduleKind::zero_bubble, {4, 8, 1});
  for (const auto& list : s.stages) {
    const auto count = [&](Op op) {
      return std::count_if(list.begin(), list.end(),
                           [op](const Instruction& i) { return i.op == op; });
    };
    CHECK(count(Op::forward) == 8);
    CHECK(count(Op::backward_input) == 8);
    CHECK(count(Op::backward_weight) == 8);
    CHECK(count(Op::backward) == 0);
  }
  // The last stage may hold one activation: F, B, W of one micro-batch, then the next.
  const auto& last = s.stages[3];
  std::vector<Op> computes;
  for (const Instruction& i : last)
    if (is_compute(i.op)) computes.push_back(i.op);
  for (std::size_t k = 0; k < computes.size(); ++k)
    CHECK(computes[k] == (k % 3 == 0   ? Op::forward
                          : k % 3 == 1 ? Op::backward_input
                                       : Op::backward_weight));
  CHECK(make_schedule(ScheduleKind::zero_bubble, {4, 8, 1}).stages == s.stages);
}

TEST_CASE("One stage needs no messages", "[unit][pipeline]") {
  for (ScheduleKind kind : all_schedule_kinds) {
    const ScheduleShape shape{1, 4, kind == ScheduleKind::interleaved ? 3 : 1};
    const Schedule s = make_schedule(kind, shape);
    REQUIRE(s.stages.size() == 1);
    CHECK(std::none_of(s.stages[0].begin(), s.stages[0].end(),
                       [](const Instruction& i) { return !is_compute(i.op); }));
    const ScheduleReport r = check_schedule(s);
    CHECK(r.bubble_fraction == 0.0);
  }
}

TEST_CASE("The checker accepts the hand-made two-stage list", "[unit][pipeline]") {
  const ScheduleReport r = check_schedule(two_stage_gpipe());  // the refusals' positive control
  // Stage 1 runs F0 at 1, F1 at 2, B0 and B1 from 3 to 7; stage 0's two backwards end at 9.
  CHECK(r.makespan == 9.0);
  CHECK(r.stages[1].peak_live_activations == 2);
}

TEST_CASE("The checker refuses a missing recv", "[unit][pipeline]") {
  Schedule s = two_stage_gpipe();
  s.stages[1].erase(s.stages[1].begin() + 2);  // recv activation (micro 1) from stage 0
  CHECK_THROWS_AS(check_schedule(s), ScheduleError);
  CHECK_THAT(refusal(s), Contains("stage 1 instruction 2 (forward (micro 1, chunk 0))") &&
                             Contains("expected recv activation (micro 1, chunk 0) from stage 0"));
}

TEST_CASE("The checker refuses a mismatched micro-batch", "[unit][pipeline]") {
  Schedule s = two_stage_gpipe();
  // Stage 0 sends micro 1 first; stage 1 still receives micro 0 first.
  std::swap(s.stages[0][1], s.stages[0][2]);  // F0, F1, send0, send1
  std::swap(s.stages[0][2], s.stages[0][3]);  // F0, F1, send1, send0
  CHECK_THAT(refusal(s),
             Contains("stage 0 instruction 2 (send activation (micro 1, chunk 0) to stage 1) "
                      "meets stage 1 instruction 0 (recv activation (micro 0, chunk 0) from "
                      "stage 0)"));
}

TEST_CASE("The checker refuses a backward before its forward", "[unit][pipeline]") {
  Schedule s = two_stage_gpipe();
  // stage 1: recv0, recv1, F1, B0, F0, ...: B0 runs on a forward that has not happened.
  s.stages[1] = {{Op::recv_activation, 0, 0, 0}, {Op::recv_activation, 1, 0, 0},
                 {Op::forward, 1, 0, -1},        {Op::backward, 0, 0, -1},
                 {Op::forward, 0, 0, -1},        {Op::send_gradient, 0, 0, 0},
                 {Op::backward, 1, 0, -1},       {Op::send_gradient, 1, 0, 0}};
  CHECK_THAT(refusal(s), Contains("stage 1 instruction 3 (backward (micro 0, chunk 0))") &&
                             Contains("before the forward of (micro 0, chunk 0)"));
}

TEST_CASE("The checker refuses a peer that is not the neighbour", "[unit][pipeline]") {
  Schedule s = make_schedule(ScheduleKind::gpipe, {3, 2, 1});
  REQUIRE(s.stages[0][1].op == Op::send_activation);
  s.stages[0][1].peer = 2;
  CHECK_THAT(refusal(s), Contains("stage 0 instruction 1 (send activation (micro 0, chunk 0) to "
                                  "stage 2)") &&
                             Contains("expected stage 1"));
  s.stages[0][1].peer = 7;
  CHECK_THAT(refusal(s), Contains("stage 0 instruction 1") && Contains("peer 7 is out of range"));
}

TEST_CASE("The checker refuses a send posted before the recv it waits on", "[unit][pipeline]") {
  // m = 1: stage 0 waits for a gradient before it sends the activation that produces it.
  Schedule s{ScheduleKind::gpipe, {2, 1, 1}, {}};
  s.stages = {{{Op::forward, 0, 0, -1},
               {Op::recv_gradient, 0, 0, 1},
               {Op::send_activation, 0, 0, 1},
               {Op::backward, 0, 0, -1}},
              {{Op::recv_activation, 0, 0, 0},
               {Op::forward, 0, 0, -1},
               {Op::backward, 0, 0, -1},
               {Op::send_gradient, 0, 0, 0}}};
  CHECK_THAT(refusal(s),
             Contains("deadlock") &&
                 Contains("stage 0 instruction 1 (recv gradient (micro 0, chunk 0) from stage 1) "
                          "waits for stage 1") &&
                 Contains("stage 1 instruction 0 (recv activation (micro 0, chunk 0) from stage "
                          "0) waits for stage 0"));
  // In one group the two are posted together and the list runs.
  s.stages[0][1].grouped_with_next = true;
  CHECK(refusal(s).empty());
}

TEST_CASE("1F1B without its groups deadlocks in the steady state", "[unit][pipeline]") {
  Schedule s = make_schedule(ScheduleKind::one_f_one_b, {4, 8, 1});
  REQUIRE(refusal(s).empty());
  for (auto& list : s.stages)
    for (Instruction& in : list) in.grouped_with_next = false;
  // Stage 2 sends micro 1's activation to stage 3, which first sends micro 0's gradient back.
  CHECK_THAT(refusal(s),
             Contains("deadlock") &&
                 Contains("stage 2 instruction 5 (send activation (micro 1, chunk 0) to stage 3) "
                          "waits for stage 3") &&
                 Contains("stage 3 instruction 3 (send gradient (micro 0, chunk 0) to stage 2) "
                          "waits for stage 2"));
}

TEST_CASE("Interleaved needs groups per batch: per-op groups deadlock once m > pp",
          "[unit][pipeline]") {
  // The same computes with 1F1B's grouping: after each compute, its send and the next
  // compute's recv. The reference's simulation of Megatron's orders found the same.
  auto per_op = [](const Schedule& ref) {
    Schedule s = ref;
    const ScheduleShape& sh = ref.shape;
    for (int st = 0; st < sh.stages; ++st) {
      std::vector<Instruction> computes;
      for (const Instruction& in : ref.stages[st])
        if (is_compute(in.op)) computes.push_back(in);
      auto message = [&](const Instruction& c, bool send) -> std::optional<Instruction> {
        const bool fwd = c.op == Op::forward;
        const auto other =
            fwd == send ? activation_target(sh, {st, c.chunk}) : gradient_target(sh, {st, c.chunk});
        if (!other) return std::nullopt;
        const Op op = send ? (fwd ? Op::send_activation : Op::send_gradient)
                           : (fwd ? Op::recv_activation : Op::recv_gradient);
        return Instruction{op, c.micro, c.chunk, other->stage};
      };
      auto& out = s.stages[st];
      out.clear();
      auto group = [&](std::optional<Instruction> a, std::optional<Instruction> b) {
        if (a) out.push_back(*a);
        if (a && b) out.back().grouped_with_next = true;
        if (b) out.push_back(*b);
      };
      group(message(computes[0], false), std::nullopt);
      for (std::size_t i = 0; i < computes.size(); ++i) {
        out.push_back(computes[i]);
        group(message(computes[i], true),
              i + 1 < computes.size() ? message(computes[i + 1], false) : std::nullopt);
      }
    }
    return s;
  };
  for (int v : {2, 4}) {
    const Schedule four = make_schedule(ScheduleKind::interleaved, {4, 4, v});
    const Schedule eight = make_schedule(ScheduleKind::interleaved, {4, 8, v});
    CHECK(refusal(four).empty());
    CHECK(refusal(eight).empty());
    CHECK(refusal(per_op(four)).empty());
    CHECK_THAT(refusal(per_op(eight)), Contains("deadlock") && Contains("stage 0 instruction"));
  }
}

TEST_CASE("Bad shapes are refused with the value and the rule", "[unit][pipeline]") {
  CHECK_THROWS_AS(make_schedule(ScheduleKind::interleaved, {4, 6, 2}), ConfigError);
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::interleaved, {4, 6, 2}),
                    Contains("micro_batches is 6") && Contains("multiple of 4"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::interleaved, {4, 2, 2}),
                    Contains("micro_batches is 2") && Contains(">= 4"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::interleaved, {4, 8, 1}),
                    Contains("virtual_stages is 1") && Contains(">= 2"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::one_f_one_b, {4, 0, 1}),
                    Contains("micro_batches is 0"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::gpipe, {4, 8, 2}),
                    Contains("virtual_stages is 2") && Contains("interleaved"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::zero_bubble, {0, 8, 1}), Contains("stages is 0"));
  CHECK_THROWS_AS(make_schedule(ScheduleKind::zero_bubble, {4, 8, 0}), ConfigError);
  CHECK_NOTHROW(make_schedule(ScheduleKind::interleaved, {1, 3, 2}));  // pp = 1: any m
}
