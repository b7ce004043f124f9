// moe_bench: the all-to-all parallelisms on 4 LocalComm ranks, f32 AdamW at ZeRO stage 1, one
// global batch for every layout.
//   moe_step      a GPT whose every second block is a mixture of E experts (top-2), at ep 1, 2
//                 and 4 (dp = 4 / ep): tokens/s of a training step, the dropped share of routed
//                 choices, and the time of the step's token all-to-alls (all_to_all_v of the rows
//                 and all_to_all of the counts over the ep group, from the CommLogger) beside a
//                 raw all_to_all_v of the same bytes and op count timed in the same run;
//   ulysses_step  the dense GPT with Ulysses sequence parallelism at sp 2 and 4 (dp = 4 / sp)
//                 beside sp 1 (dp 4) at the same global batch: tokens/s, ratio to sp 1, and the
//                 Ulysses all-to-alls' time (group cp) beside a raw all_to_all of the same bytes;
//   moe_ulysses_step  the MoE GPT at ep 2 x sp 2 (dp 1: each Ulysses rank routes its own
//                 positions) beside moe_step at ep 2 x dp 2 from the same run: tokens/s, the
//                 ratio, the dropped share and both groups' all-to-all times;
//   moe_draws_step  the MoE GPT at ep 2 x dp 2 with DeepSpeed's gate draws (top-1 with random
//                 token selection, top-2 with jitter, top-2 with a sampled second choice) beside
//                 the same routing without them, timed in the same run: tokens/s, the ratio and
//                 the dropped share;
//   moe_tp_step   the MoE GPT at tp 2 x ep 2 (dp 1: every block split over tp) with each expert
//                 split over tp (Megatron's expert tensor parallelism, "expert_split": "hidden")
//                 and with whole experts over tp ("experts": expert_tensor_parallel_size 1)
//                 beside moe_step at ep 2 x dp 2 from the same run: tokens/s, the ratios (whole
//                 experts also to the hidden split), and the tp group's all-reduces and
//                 reduce-scatters (time, count, bytes) beside the ep all-to-alls.
// One JSON line per result. The ranks are threads: with fewer cores than ranks they take turns,
// so the figures compare layouts on this machine rather than predict a cluster.
//
//   ./moe_bench [--layers 4] [--channels 128] [--heads 4] [--seq 64] [--batch 16]
//               [--experts 8] [--repeats 3]
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace {

using namespace zero;

constexpr int ranks = 4;

struct Settings {
  std::int64_t layers = 4, channels = 128, heads = 4, seq = 64, batch = 16, experts = 8;
  int repeats = 3;
};

struct StepResult {
  double ms = 0;
  double dropped = 0;                                      // share of routed choices dropped
  std::map<parallel::CommOp, parallel::CommStats> ops;     // one step's ops on the ep group
  std::map<parallel::CommOp, parallel::CommStats> cp_ops;  // and on the cp group (Ulysses)
  std::map<parallel::CommOp, parallel::CommStats> tp_ops;  // and on the tp group
};

// One training step on rank 0 of 4 at (ep, sp, tp): best time over the repeats, and the step's
// collectives on the ep, cp and tp groups.
// adjust, when given, changes the MoE blocks' router (top-2 by default).
StepResult step_ms(const Settings& s, int ep, int sp,
                   const std::function<void(nn::RouterConfig&)>& adjust = {}, int tp = 1,
                   nn::ExpertTensorParallel expert_tp = nn::ExpertTensorParallel::hidden) {
  nn::GPTConfig c = nn::GPTConfig::preset("small-test");
  c.num_layers = s.layers;
  c.channels = s.channels;
  c.num_heads = s.heads;
  c.max_seq_len = s.seq;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.batch * s.seq));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 7919) % static_cast<std::size_t>(c.vocab_size));
  }
  const Config cfg = Config::from_json_string(
      R"({"train_batch_size": )" + std::to_string(s.batch) +
      R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 1}})");
  StepResult result;
  parallel::LocalComm::run(ranks, [&](parallel::LocalComm& world) {
#if defined(_OPENMP)
    omp_set_num_threads(1);  // one core per rank
#endif
    auto logger = std::make_shared<parallel::CommLogger>(false);
    world.set_logger(logger);
    parallel::ProcessGroups<parallel::LocalComm> groups(
        world, parallel::Grid({.tp = tp, .cp = sp, .ep = ep, .dp = ranks / (tp * ep * sp)}));
    nn::MoEBlocks moe;
    if (s.experts > 1) {
      moe.router.num_experts = static_cast<int>(s.experts);
      moe.router.k = 2;
      if (adjust) adjust(moe.router);
      moe.ep = parallel::ExpertParallel(groups.ep());
      moe.expert_tp = expert_tp;
    }
    nn::GPT<float> model(c, parallel::TensorParallel(groups.tp()),
                         parallel::SequenceParallel(groups.cp()), moe);
    engine::EngineOptions options;
    options.activation_bytes = std::size_t{512} << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, groups, cfg, options);
    const auto& data = groups.get({parallel::Axis::ep, parallel::Axis::dp});
    const std::int64_t rows = s.batch / data.size();
    const std::int32_t* mine = tokens.data() + data.rank() * rows * s.seq;
    const parallel::SequenceSlice slice(mine, mine, rows, s.seq, model.sequence_parallel());
    const engine::MicroBatch mb{slice.tokens.data(), slice.targets.data(), rows, slice.seq_len};
    double dropped = 0, choices = 0;
    auto step = [&] {
      eng.forward(mb);
      eng.backward();
      eng.step();
      eng.synchronize();
      dropped += static_cast<double>(model.moe_stats().dropped);
      choices += static_cast<double>(model.moe_stats().choices);
    };
    step();
    logger->enable();
    step();
    logger->enable(false);
    const double t = 1e3 * bench::best_seconds(s.repeats, step);
    if (world.rank() == 0) {
      result.ms = t;
      result.dropped = choices > 0 ? dropped / choices : 0;
      for (const auto& r : logger->records()) {
        if (r.group == "ep") result.ops[r.op] += r.stats;
        if (r.group == "cp") result.cp_ops[r.op] += r.stats;
        if (r.group == "tp") result.tp_ops[r.op] += r.stats;
      }
    }
    world.set_logger(nullptr);
  });
  return result;
}

// Raw all-to-alls over `n` ranks with the ops, counts and bytes of ops (equal splits).
double raw_ms(const std::map<parallel::CommOp, parallel::CommStats>& ops, int n, int repeats) {
  double ms = 0;
  parallel::LocalComm::run(n, [&](parallel::LocalComm& comm) {
    // Each op's buffers are allocated once, outside the timed runs: the baseline is the cost of
    // moving the bytes, not of allocating and zeroing them.
    struct Buffers {
      std::vector<float> a, b;
      std::vector<std::size_t> counts;
    };
    std::map<parallel::CommOp, Buffers> buffers;
    for (const auto& [op, st] : ops) {
      if (st.count == 0) continue;
      const std::size_t per_op = st.bytes / st.count / sizeof(float) / n * n;
      buffers[op] = {std::vector<float>(per_op), std::vector<float>(per_op),
                     std::vector<std::size_t>(static_cast<std::size_t>(n), per_op / n)};
    }
    auto run_all = [&] {
      for (const auto& [op, st] : ops) {
        if (st.count == 0) continue;
        auto& [a, b, counts] = buffers.at(op);
        for (std::uint64_t k = 0; k < st.count; ++k) {
          if (op == parallel::CommOp::all_to_all_v) {
            comm.all_to_all_v(std::span<const float>(a), std::span<const std::size_t>(counts),
                              std::span<float>(b), std::span<const std::size_t>(counts));
          } else if (op == parallel::CommOp::all_to_all) {
            comm.all_to_all(std::span<const float>(a), std::span<float>(b));
          }
        }
      }
    };
    run_all();
    const double t = 1e3 * bench::best_seconds(repeats, run_all);
    if (comm.rank() == 0) ms = t;
  });
  return ms;
}

// The time, op count and bytes of the all-to-alls among ops.
struct A2A {
  double ms = 0, count = 0, bytes = 0;
};
A2A all_to_alls(const std::map<parallel::CommOp, parallel::CommStats>& ops) {
  A2A a;
  for (const auto& [op, st] : ops) {
    if (op != parallel::CommOp::all_to_all && op != parallel::CommOp::all_to_all_v) continue;
    a.ms += 1e3 * st.time_s;
    a.count += static_cast<double>(st.count);
    a.bytes += static_cast<double>(st.bytes);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  if (!bench::parse_flags(argc, argv, "moe_bench",
                          {{"--layers", &s.layers},
                           {"--channels", &s.channels},
                           {"--heads", &s.heads},
                           {"--seq", &s.seq},
                           {"--batch", &s.batch},
                           {"--experts", &s.experts},
                           {"--repeats", &s.repeats}}))
    return 2;
  const std::string shape =
      "\"layers\": " + std::to_string(s.layers) + ", \"channels\": " + std::to_string(s.channels) +
      ", \"heads\": " + std::to_string(s.heads) + ", \"seq\": " + std::to_string(s.seq) +
      ", \"batch\": " + std::to_string(s.batch) + ", \"ranks\": 4";
  const double tokens = static_cast<double>(s.batch * s.seq);
  char extra[512];
  double ep1_ms = 0, ep2_ms = 0;
  for (int ep : {1, 2, 4}) {
    const StepResult r = step_ms(s, ep, 1);
    if (ep == 1) ep1_ms = r.ms;
    if (ep == 2) ep2_ms = r.ms;
    const A2A a = all_to_alls(r.ops);
    const double raw = ep > 1 ? raw_ms(r.ops, ep, s.repeats) : 0;
    std::snprintf(extra, sizeof extra,
                  ", \"ms\": %.3f, \"ratio_to_ep1\": %.3f, \"dropped\": %.3f, \"a2a_ms\": %.3f, "
                  "\"a2a_ops\": %.0f, \"a2a_bytes\": %.0f, \"raw_a2a_ms\": %.3f",
                  r.ms, r.ms / ep1_ms, r.dropped, a.ms, a.count, a.bytes, raw);
    bench::line("moe_step",
                shape + ", \"experts\": " + std::to_string(s.experts) + ", \"k\": 2, \"ep\": " +
                    std::to_string(ep) + ", \"dp\": " + std::to_string(ranks / ep),
                tokens / (r.ms / 1e3), "tokens/s", extra);
  }
  Settings dense = s;
  dense.experts = 1;
  double sp1_ms = 0;
  for (int sp : {1, 2, 4}) {
    if (s.heads % sp != 0 || s.seq % sp != 0) continue;
    const StepResult r = step_ms(dense, 1, sp);
    if (sp == 1) sp1_ms = r.ms;
    const A2A a = all_to_alls(r.cp_ops);
    const double raw = sp > 1 ? raw_ms(r.cp_ops, sp, s.repeats) : 0;
    std::snprintf(extra, sizeof extra,
                  ", \"ms\": %.3f, \"ratio_to_sp1\": %.3f, \"a2a_ms\": %.3f, \"a2a_ops\": %.0f, "
                  "\"a2a_bytes\": %.0f, \"raw_a2a_ms\": %.3f",
                  r.ms, r.ms / sp1_ms, a.ms, a.count, a.bytes, raw);
    bench::line(
        "ulysses_step",
        shape + ", \"sp\": " + std::to_string(sp) + ", \"dp\": " + std::to_string(ranks / sp),
        tokens / (r.ms / 1e3), "tokens/s", extra);
  }
  if (s.experts > 1 && s.experts % 2 == 0 && s.heads % 2 == 0 && s.seq % 2 == 0) {
    const StepResult r = step_ms(s, 2, 2);
    const A2A ep_a2a = all_to_alls(r.ops), cp_a2a = all_to_alls(r.cp_ops);
    std::snprintf(extra, sizeof extra,
                  ", \"ms\": %.3f, \"ratio_to_ep2_dp2\": %.3f, \"dropped\": %.3f, "
                  "\"ep_a2a_ms\": %.3f, \"ep_a2a_bytes\": %.0f, \"cp_a2a_ms\": %.3f, "
                  "\"cp_a2a_bytes\": %.0f",
                  r.ms, r.ms / ep2_ms, r.dropped, ep_a2a.ms, ep_a2a.bytes, cp_a2a.ms, cp_a2a.bytes);
    bench::line("moe_ulysses_step",
                shape + ", \"experts\": " + std::to_string(s.experts) +
                    ", \"k\": 2, \"ep\": 2, \"sp\": 2, \"dp\": 1",
                tokens / (r.ms / 1e3), "tokens/s", extra);
  }
  if (s.experts > 1 && s.experts % 2 == 0) {
    // Each variant beside its routing without the draws, both timed here.
    struct Variant {
      const char* draws;
      int k;
      std::function<void(nn::RouterConfig&)> on;
    };
    const std::vector<Variant> variants{
        {"use_rts", 1, [](nn::RouterConfig& r) { r.random_token_selection = true; }},
        {"jitter", 2, [](nn::RouterConfig& r) { r.noise = nn::GateNoise::jitter; }},
        {"top2_2nd_expert_sampling", 2,
         [](nn::RouterConfig& r) { r.second_expert_sampling = true; }}};
    for (const Variant& v : variants) {
      const auto plain = [&](nn::RouterConfig& r) { r.k = v.k; };
      const StepResult base = step_ms(s, 2, 1, plain);
      const StepResult r = step_ms(s, 2, 1, [&](nn::RouterConfig& router) {
        plain(router);
        v.on(router);
      });
      std::snprintf(extra, sizeof extra,
                    ", \"ms\": %.3f, \"baseline_ms\": %.3f, \"ratio_to_baseline\": %.3f, "
                    "\"dropped\": %.3f, \"baseline_dropped\": %.3f",
                    r.ms, base.ms, r.ms / base.ms, r.dropped, base.dropped);
      bench::line("moe_draws_step",
                  shape + ", \"experts\": " + std::to_string(s.experts) +
                      ", \"k\": " + std::to_string(v.k) + ", \"draws\": \"" + v.draws +
                      "\", \"ep\": 2, \"dp\": 2",
                  tokens / (r.ms / 1e3), "tokens/s", extra);
    }
  }
  if (s.experts > 1 && s.experts % 2 == 0 && s.heads % 2 == 0 && s.channels % 2 == 0) {
    double hidden_ms = 0;
    for (const nn::ExpertTensorParallel split :
         {nn::ExpertTensorParallel::hidden, nn::ExpertTensorParallel::experts}) {
      const bool whole = split == nn::ExpertTensorParallel::experts;
      if (whole && s.experts % 4 != 0) continue;  // whole experts over ep 2 x tp 2
      const StepResult r = step_ms(s, 2, 1, {}, 2, split);
      if (!whole) hidden_ms = r.ms;
      const A2A ep_a2a = all_to_alls(r.ops);
      double ar_ms = 0, ar_count = 0, ar_bytes = 0;
      for (const auto& [op, st] : r.tp_ops) {
        if (op != parallel::CommOp::all_reduce && op != parallel::CommOp::reduce_scatter) continue;
        ar_ms += 1e3 * st.time_s;
        ar_count += static_cast<double>(st.count);
        ar_bytes += static_cast<double>(st.bytes);
      }
      std::snprintf(extra, sizeof extra,
                    ", \"ms\": %.3f, \"ratio_to_ep2_dp2\": %.3f, \"ratio_to_hidden_split\": %.3f, "
                    "\"dropped\": %.3f, \"ep_a2a_ms\": %.3f, \"ep_a2a_bytes\": %.0f, "
                    "\"tp_reduce_ms\": %.3f, \"tp_reduces\": %.0f, \"tp_reduce_bytes\": %.0f",
                    r.ms, r.ms / ep2_ms, r.ms / hidden_ms, r.dropped, ep_a2a.ms, ep_a2a.bytes,
                    ar_ms, ar_count, ar_bytes);
      bench::line("moe_tp_step",
                  shape + ", \"experts\": " + std::to_string(s.experts) +
                      ", \"k\": 2, \"tp\": 2, \"ep\": 2, \"dp\": 1, \"expert_split\": \"" +
                      std::string(name_of(split)) + "\"",
                  tokens / (r.ms / 1e3), "tokens/s", extra);
    }
  }
  return 0;
}
