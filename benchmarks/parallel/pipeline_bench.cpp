// pipeline_bench: a GPT training step (m micro-batches, AdamW at ZeRO stage 1) through pp
// LocalComm stages with each schedule (GPipe, 1F1B, interleaved with 2 chunks per stage, ZB-H1
// with its split backward), beside the same model and global batch on one rank without a
// pipeline (the baseline, timed in the same run). Per schedule: the best step time, its ratio to
// the baseline, the bubble fraction the executor measured ((wall - busiest stage) / busiest stage)
// and the one check_schedule predicts for equal stages, and the forwards recomputed on stage 0
// (none: GPT's layers park their passes), and stage 0's activation high-water mark. One JSON
// line per result. With one core per stage the ideal step time is baseline / pp x (1 + bubble);
// the machine's cores bound how many stages really run at once.
//
//   ./pipeline_bench [--layers 6] [--channels 128] [--heads 4] [--seq 64] [--micro 2]
//                    [--micro-batches 8] [--repeats 3]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace {

using namespace zero;
using parallel::pipeline::ScheduleKind;

struct Settings {
  std::int64_t layers = 6, channels = 128, heads = 4, seq = 64, micro = 2;
  int micro_batches = 8, repeats = 3;
};

nn::GPTConfig model_config(const Settings& s) {
  nn::GPTConfig c = nn::GPTConfig::preset("small-test");  // vocabulary 512
  c.num_layers = s.layers;
  c.channels = s.channels;
  c.num_heads = s.heads;
  c.max_seq_len = s.seq;
  return c;
}

Config config_of(const Settings& s) {
  return Config::from_json_string(
      R"({"train_micro_batch_size_per_gpu": )" + std::to_string(s.micro) +
      R"(, "gradient_accumulation_steps": )" + std::to_string(s.micro_batches) +
      R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 1}})");
}

struct Result {
  double ms = 0, bubble = 0;
  int recomputed = 0;
  double activation_mib = 0;  // rank 0's (stage 0's) activation high-water mark
};

// The micro-batches of one step (every stage reads the same).
std::vector<engine::MicroBatch> batches_of(const Settings& s, const std::vector<std::int32_t>& t) {
  std::vector<engine::MicroBatch> out;
  for (int m = 0; m < s.micro_batches; ++m) {
    const std::int32_t* p = t.data() + static_cast<std::ptrdiff_t>(m * s.micro * s.seq);
    out.push_back({p, p, s.micro, s.seq});
  }
  return out;
}

Result baseline(const Settings& s, const std::vector<std::int32_t>& tokens) {
  Result r;
  parallel::LocalComm::run(1, [&](parallel::LocalComm& world) {
    nn::GPT<float> model(model_config(s));
    engine::EngineOptions options;
    options.activation_bytes = std::size_t{512} << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(model, world, config_of(s), options);
    const auto batches = batches_of(s, tokens);
    auto step = [&] {
      for (const auto& b : batches) {
        eng.forward(b);
        eng.backward();
      }
      eng.step();
    };
    step();
    r.ms = 1e3 * bench::best_seconds(s.repeats, step);
    r.activation_mib = static_cast<double>(eng.activation_peak_bytes()) / (1 << 20);
  });
  return r;
}

Result pipelined(const Settings& s, const std::vector<std::int32_t>& tokens, int pp,
                 ScheduleKind kind) {
  Result r;
  parallel::LocalComm::run(pp, [&](parallel::LocalComm& world) {
#if defined(_OPENMP)
    omp_set_num_threads(1);  // one core per stage
#endif
    parallel::ProcessGroups<parallel::LocalComm> groups(world, parallel::Grid({.pp = pp}));
    nn::GPT<float> model(model_config(s));
    parallel::pipeline::PipelineOptions po;
    po.schedule = kind;
    po.virtual_stages = kind == ScheduleKind::interleaved ? 2 : 1;
    po.partition_method = "uniform";
    engine::EngineOptions options;
    options.activation_bytes = std::size_t{512} << 20;
    parallel::pipeline::PipelineEngine<nn::GPT<float>, ZeroStage<1>> pipe(
        model, world, groups, config_of(s), po, options);
    const auto batches = batches_of(s, tokens);
    parallel::pipeline::PipelineStep last;
    auto step = [&] { last = pipe.train_batch(batches); };
    step();
    double best_bubble = 1e30;
    const double t = bench::best_seconds(s.repeats, [&] {
      step();
      best_bubble = std::min(best_bubble, last.bubble_fraction);
    });
    if (world.rank() == 0) {
      r.ms = 1e3 * t;
      r.bubble = best_bubble;
      r.recomputed = last.recomputed_forwards;
      r.activation_mib = static_cast<double>(pipe.engine().activation_peak_bytes()) / (1 << 20);
    }
  });
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  if (!bench::parse_flags(argc, argv, "pipeline_bench",
                          {{"--layers", &s.layers},
                           {"--channels", &s.channels},
                           {"--heads", &s.heads},
                           {"--seq", &s.seq},
                           {"--micro", &s.micro},
                           {"--micro-batches", &s.micro_batches},
                           {"--repeats", &s.repeats}}))
    return 2;
  const nn::GPTConfig c = model_config(s);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.micro_batches * s.micro * s.seq));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 31 + 7) % c.vocab_size);
  }
  const std::string shape =
      "\"layers\": " + std::to_string(s.layers) + ", \"channels\": " + std::to_string(s.channels) +
      ", \"heads\": " + std::to_string(s.heads) + ", \"seq\": " + std::to_string(s.seq) +
      ", \"micro\": " + std::to_string(s.micro) +
      ", \"micro_batches\": " + std::to_string(s.micro_batches);
  const Result base = baseline(s, tokens);
  char base_extra[64];
  std::snprintf(base_extra, sizeof base_extra, ", \"activation_peak_mib\": %.2f",
                base.activation_mib);
  bench::line("pipeline_step", shape + ", \"pp\": 1, \"schedule\": \"none\"", base.ms, "ms",
              base_extra);
  for (int pp : {2, 4}) {
    for (ScheduleKind kind : parallel::pipeline::all_schedule_kinds) {
      const int v = kind == ScheduleKind::interleaved ? 2 : 1;
      if (pp * v > s.layers + 2) continue;
      if (kind == ScheduleKind::interleaved && s.micro_batches % pp != 0) continue;
      const Result r = pipelined(s, tokens, pp, kind);
      const auto predicted = parallel::pipeline::check_schedule(
                                 parallel::pipeline::make_schedule(kind, {pp, s.micro_batches, v}))
                                 .bubble_fraction;
      char extra[320];
      std::snprintf(extra, sizeof extra,
                    ", \"baseline_ms\": %.3f, \"ratio_to_baseline\": %.3f, \"bubble\": %.3f, "
                    "\"bubble_equal_stages\": %.3f, \"recomputed_forwards_stage0\": %d, "
                    "\"activation_peak_mib_stage0\": %.2f",
                    base.ms, r.ms / base.ms, r.bubble, predicted, r.recomputed, r.activation_mib);
      bench::line("pipeline_step",
                  shape + ", \"pp\": " + std::to_string(pp) + ", \"schedule\": \"" +
                      std::string(parallel::pipeline::name_of(kind)) +
                      "\", \"v\": " + std::to_string(v),
                  r.ms, "ms", extra);
    }
  }
  return 0;
}
