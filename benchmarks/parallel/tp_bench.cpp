// tp_bench: a GPT training step (forward, backward, AdamW at ZeRO stage 1) on 2 LocalComm ranks
// split as tensor parallel (tp 2, dp 1), tensor + sequence parallel, and data parallel
// (tp 1, dp 2), on the same global batch (in --accumulation micro-steps); then, for the tp
// layouts, the time the tensor-parallel collectives took in the step (CommLogger, tp group)
// beside raw LocalComm collectives of the same ops and bytes, timed in the same run (so the
// ratio is the layers' overhead on top of moving the bytes). One JSON line per result.
//
//   ./tp_bench [--layers 4] [--channels 256] [--heads 8] [--seq 64] [--batch 8]
//              [--accumulation 1] [--repeats 5]
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace {

using namespace zero;

struct Shape_ {
  std::int64_t layers = 4, channels = 256, heads = 8, seq = 64, batch = 8, accumulation = 1;
  int repeats = 5;
};

nn::GPTConfig model_config(const Shape_& s) {
  nn::GPTConfig c = nn::GPTConfig::preset("small-test");  // vocabulary 512
  c.num_layers = s.layers;
  c.channels = s.channels;
  c.num_heads = s.heads;
  c.max_seq_len = s.seq;
  return c;
}

struct StepResult {
  double ms = 0;
  std::map<parallel::CommOp, parallel::CommStats> tp_ops;  // per step, rank 0
};

// One layout on 2 ranks: rank 0's best step time and its tp-group collectives of one step.
StepResult step_ms(const Shape_& s, int tp, bool sp) {
  const nn::GPTConfig c = model_config(s);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.batch * s.seq));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 31 + 7) % c.vocab_size);
  }
  const Config cfg = Config::from_json_string(
      R"({"train_batch_size": )" + std::to_string(s.batch) +
      R"(, "gradient_accumulation_steps": )" + std::to_string(s.accumulation) +
      R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 1}})");
  StepResult result;
  parallel::LocalComm::run(2, [&](parallel::LocalComm& world) {
#if defined(_OPENMP)
    omp_set_num_threads(1);  // one core per rank
#endif
    auto logger = std::make_shared<parallel::CommLogger>(false);
    world.set_logger(logger);
    parallel::ProcessGroups<parallel::LocalComm> groups(world,
                                                        parallel::Grid({.tp = tp, .dp = 2 / tp}));
    nn::GPT<float> model(c, parallel::TensorParallel(groups.tp(), sp));
    engine::EngineOptions options;
    options.activation_bytes = std::size_t{512} << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, groups, cfg, options);
    const int dp = groups.dp().size(), dp_rank = groups.dp().rank();
    const std::int64_t rows = s.batch / (dp * s.accumulation);  // a micro-batch's
    auto step = [&] {
      for (std::int64_t m = 0; m < s.accumulation; ++m) {
        const std::int32_t* first = tokens.data() + (m * dp + dp_rank) * rows * s.seq;
        eng.forward(engine::MicroBatch{first, first, rows, s.seq});
        eng.backward();
      }
      eng.step();
      eng.synchronize();
    };
    step();
    logger->enable();
    step();
    logger->enable(false);
    const double t = 1e3 * bench::best_seconds(s.repeats, step);
    if (world.rank() == 0) {
      result.ms = t;
      for (const auto& r : logger->records()) {
        if (r.group == "tp") result.tp_ops[r.op] += r.stats;
      }
    }
    world.set_logger(nullptr);
  });
  return result;
}

// Raw LocalComm collectives of the same ops, counts and bytes as one step's tp traffic.
double raw_ms(const std::map<parallel::CommOp, parallel::CommStats>& ops, int repeats) {
  double ms = 0;
  parallel::LocalComm::run(2, [&](parallel::LocalComm& comm) {
    // Each op's buffers are allocated once, outside the timed runs: the baseline is the cost of
    // moving the bytes, not of allocating and zeroing them.
    std::map<parallel::CommOp, std::pair<std::vector<float>, std::vector<float>>> buffers;
    for (const auto& [op, st] : ops) {
      if (st.count == 0) continue;
      const std::size_t per_op = st.bytes / st.count / sizeof(float);
      buffers[op] = {std::vector<float>(per_op), std::vector<float>(per_op)};
    }
    auto run_all = [&] {
      for (const auto& [op, st] : ops) {
        if (st.count == 0) continue;
        auto& [a, b] = buffers.at(op);
        const std::size_t per_op = a.size();
        for (std::uint64_t k = 0; k < st.count; ++k) {
          switch (op) {
            case parallel::CommOp::all_reduce:
              comm.all_reduce(std::span<float>(a), parallel::ReduceOp::sum);
              break;
            case parallel::CommOp::all_gather:
              comm.all_gather(std::span<const float>(a.data(), per_op / 2), std::span<float>(b));
              break;
            case parallel::CommOp::reduce_scatter:
              comm.reduce_scatter(std::span<const float>(a), std::span<float>(b.data(), per_op / 2),
                                  parallel::ReduceOp::sum);
              break;
            default:
              break;
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

}  // namespace

int main(int argc, char** argv) {
  Shape_ s;
  if (!bench::parse_flags(argc, argv, "tp_bench",
                          {{"--layers", &s.layers},
                           {"--channels", &s.channels},
                           {"--heads", &s.heads},
                           {"--seq", &s.seq},
                           {"--batch", &s.batch},
                           {"--accumulation", &s.accumulation},
                           {"--repeats", &s.repeats}}))
    return 2;
  if (s.accumulation < 1 || s.batch % (2 * s.accumulation) != 0) {
    std::fprintf(stderr, "tp_bench: --batch %lld must split into 2 ranks x %lld micro-steps\n",
                 static_cast<long long>(s.batch), static_cast<long long>(s.accumulation));
    return 2;
  }
  const std::string shape =
      "\"layers\": " + std::to_string(s.layers) + ", \"channels\": " + std::to_string(s.channels) +
      ", \"heads\": " + std::to_string(s.heads) + ", \"seq\": " + std::to_string(s.seq) +
      ", \"batch\": " + std::to_string(s.batch) +
      ", \"accumulation\": " + std::to_string(s.accumulation) + ", \"ranks\": 2";
  const StepResult dp2 = step_ms(s, 1, false);
  bench::line("tp_step", shape + ", \"tp\": 1, \"dp\": 2, \"sp\": false", dp2.ms, "ms");
  for (bool sp : {false, true}) {
    const StepResult r = step_ms(s, 2, sp);
    const std::string config = shape + ", \"tp\": 2, \"dp\": 1, \"sp\": " + (sp ? "true" : "false");
    char extra[128];
    std::snprintf(extra, sizeof extra, ", \"dp2_ms\": %.3f, \"ratio_to_dp2\": %.3f", dp2.ms,
                  r.ms / dp2.ms);
    bench::line("tp_step", config, r.ms, "ms", extra);
    double comm_ms = 0, bytes = 0, count = 0;
    for (const auto& [op, st] : r.tp_ops) {
      comm_ms += 1e3 * st.time_s;
      bytes += static_cast<double>(st.bytes);
      count += static_cast<double>(st.count);
    }
    const double raw = raw_ms(r.tp_ops, s.repeats);
    std::snprintf(extra, sizeof extra,
                  ", \"ops\": %.0f, \"bytes\": %.0f, \"raw_ms\": %.3f, \"ratio_to_raw\": %.3f",
                  count, bytes, raw, comm_ms / raw);
    bench::line("tp_comm", config, comm_ms, "ms", extra);
  }
  return 0;
}
