// engine_bench: optimizer-step time of the engine at ZeRO stages 0-3 on 1, 2 and 4 LocalComm
// ranks, beside the single-process step (LocalParameters + one AdamW per unit, no engine) on the
// same global batch in the same run; the ratio is the cost of sharding and communication on
// this machine. Then the step with Offload<NVMe> (AdamW states in files under --nvme-path,
// streamed through the swapper at every step) beside the same engine without offload, at stages
// 1-3 on 1 and 2 ranks ("engine_step_nvme" lines; --nvme-path "" skips them), with the time a
// step's gathers waited for their reads of master slices and where those came from (read ahead,
// handed over or kept by the step's pass, read on demand); at stage 3 also with the master
// slices read when their gathers start instead of ahead (nvme_read_ahead off). Then hybrid
// sharding (EngineOptions::shard_size) at stages 1-3 on 4 ranks in shard groups of 2 beside plain
// ZeRO on the 4 ("engine_step_hybrid" lines): the step time, and one step's bus bytes per rank
// inside the shard group and across the replicas, which is what would cross between nodes. Then
// ZeRO++ at stage 3 on 4 ranks beside plain stage 3 ("engine_step_zeropp" lines): hpZ
// (EngineOptions::hpz_size, secondary groups of 2), qwZ (quantized_weights), both, qgZ
// (quantized_gradients), qgZ with hpZ (its two hops) and all three, the qgZ lines again at 4
// bits (quantized_gradient_bits, DeepSpeed's width), and the 4-bit qgZ lines with LoCo's error
// feedback (loco); the step time, and one
// step's bus bytes per rank over all 4 ranks and across the secondary groups (what would cross
// between nodes; the gradient reductions' part apart) and inside the secondary group. One JSON line
// per configuration.
//
//   ./engine_bench [--layers 4] [--channels 128] [--seq 64] [--batch 8] [--repeats 5]
//                  [--nvme-path /var/tmp] [--only engine|nvme|hybrid|zeropp]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <optim/adam.hpp>
#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/offload/tensor_read_stats.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

namespace {

using namespace zero;

struct BenchShape {
  std::int64_t layers = 4, channels = 128, seq = 64, batch = 8;
  int repeats = 5;
};

nn::GPTConfig model_config(const BenchShape& s) {
  nn::GPTConfig c = nn::GPTConfig::preset("small-test");
  c.num_layers = s.layers;
  c.channels = s.channels;
  c.num_heads = 4;
  c.max_seq_len = s.seq;
  return c;
}

std::vector<std::int32_t> tokens_for(const BenchShape& s, std::int64_t vocab) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(s.batch * s.seq));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>((i * 31 + 7) % vocab);
  return t;
}

void set_threads(int n) {
#if defined(_OPENMP)
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

// The single-process step: forward, backward, AdamW on every unit.
double single_process_ms(const BenchShape& s, int threads) {
  set_threads(threads);
  const nn::GPTConfig c = model_config(s);
  nn::GPT<float> model(c);
  nn::LocalParameters<nn::GPT<float>> params(model, 1234);
  std::vector<optim::AdamW> opts;
  for (int u = 0; u < model.num_units(); ++u) opts.emplace_back(params.unit_values(u).numel());
  Arena<> arena(std::size_t{512} << 20);
  const auto tokens = tokens_for(s, c.vocab_size);
  auto step = [&] {
    params.zero_grads();
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.tokens = tokens.data();
    ctx.targets = tokens.data();
    ctx.batch = s.batch;
    ctx.seq_len = s.seq;
    model.forward(ctx);
    model.backward(ctx);
    arena.reset();
    for (int u = 0; u < model.num_units(); ++u) {
      opts[static_cast<std::size_t>(u)].step(optim::FusedIo::over(
          params.unit_values(u).span(), std::span<const float>(params.unit_grads(u).span())));
    }
  };
  step();
  return 1e3 * bench::best_seconds(s.repeats, step);
}

// Rank 0's bus bytes of one step, by group name.
struct StepTraffic {
  double shard = 0, replicas = 0, world = 0, secondary = 0;
  double world_reductions = 0;  // the part of world that reduces gradients (not the gathers)
  double across = 0;            // across the secondary groups (qgZ's second hop under hpZ)
};

// The engine step at `stage` on `ranks` LocalComm ranks (rank 0's time; ranks move together);
// with a non-empty nvme_path the config offloads the optimizer states there, and zero::dispatch
// picks the Offload<NVMe> engine for it. The options' shard_size, hpz_size, quantized_weights
// and quantized_gradients pick hybrid sharding and ZeRO++'s parts; traffic, when given, receives
// one more step's bus bytes.
struct Variant {
  std::string nvme_path = {};
  engine::EngineOptions options = {};
  StepTraffic* traffic = nullptr;
  offload::TensorReadStats* reads = nullptr;  ///< rank 0's master-slice reads of the timed steps
};
double engine_ms(const BenchShape& s, int stage, int ranks, int threads_per_rank,
                 const Variant& variant = {}) {
  const std::string& nvme_path = variant.nvme_path;
  StepTraffic* traffic = variant.traffic;
  const nn::GPTConfig c = model_config(s);
  const auto tokens = tokens_for(s, c.vocab_size);
  const std::string offload =
      nvme_path.empty()
          ? ""
          : R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme_path + R"("})";
  const Config cfg =
      Config::from_json_string(R"({"train_batch_size": )" + std::to_string(s.batch) +
                               R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
          "zero_optimization": {"stage": )" +
                               std::to_string(stage) + offload + "}}");
  double ms = 0;
  parallel::LocalComm::run(ranks, [&](parallel::LocalComm& comm) {
    set_threads(threads_per_rank);
    nn::GPT<float> model(c);
    engine::EngineOptions options = variant.options;
    options.activation_bytes = std::size_t{512} << 20;
    auto logger = std::make_shared<parallel::CommLogger>(traffic != nullptr);
    comm.set_logger(logger);  // the engine's shard and replica groups log into it too
    zero::dispatch<nn::GPT<float>>(cfg, [&]<class E>(std::type_identity<E>) {
      E eng(model, comm, cfg, options);
      const std::int64_t rows = s.batch / comm.size();
      const engine::MicroBatch mb{tokens.data() + comm.rank() * rows * s.seq,
                                  tokens.data() + comm.rank() * rows * s.seq, rows, s.seq};
      auto step = [&] {
        eng.forward(mb);
        eng.backward();
        eng.step();
        eng.synchronize();
      };
      step();
      const offload::TensorReadStats before = eng.nvme_read_stats();
      const double t = 1e3 * bench::best_seconds(s.repeats, step);
      if (comm.rank() == 0) ms = t;
      if (variant.reads != nullptr && comm.rank() == 0) {
        *variant.reads = eng.nvme_read_stats().since(before);
      }
      if (traffic == nullptr) return;
      logger->reset();
      step();
      if (comm.rank() != 0) return;
      const auto bus = [&](std::string_view group, bool gathers = true) {
        double b = 0;
        for (const auto op : {parallel::CommOp::all_reduce, parallel::CommOp::reduce_scatter,
                              parallel::CommOp::all_to_all, parallel::CommOp::all_gather}) {
          if (gathers || op != parallel::CommOp::all_gather) {
            b += logger->total(op, group).bus_bytes;
          }
        }
        return b;
      };
      *traffic = {bus("dp-shard"),     bus("dp-replicas"),  bus("world"),
                  bus("dp-secondary"), bus("world", false), bus("dp-across")};
    });
    comm.set_logger(nullptr);
  });
  return ms;
}

// One "engine_step_hybrid" line: `stage` on `ranks` ranks in shard groups of `shard`, beside
// plain ZeRO on the same ranks, measured back to back.
void hybrid_line(const BenchShape& s, int stage, int ranks, int shard, int threads) {
  StepTraffic plain_bytes, hybrid_bytes;
  const double plain = engine_ms(s, stage, ranks, threads, {.traffic = &plain_bytes});
  Variant hybrid_variant{.traffic = &hybrid_bytes};
  hybrid_variant.options.shard_size = shard;
  const double hybrid = engine_ms(s, stage, ranks, threads, hybrid_variant);
  std::printf(
      "{\"bench\": \"engine_step_hybrid\", \"config\": {\"stage\": %d, \"ranks\": %d, "
      "\"shard_size\": %d, \"threads_per_rank\": %d, \"params\": %lld}, \"value\": %.3f, "
      "\"unit\": \"ms\", \"plain_ms\": %.3f, \"ratio\": %.3f, \"shard_bus_bytes\": %.0f, "
      "\"replica_bus_bytes\": %.0f, \"plain_bus_bytes\": %.0f}\n",
      stage, ranks, shard, threads, static_cast<long long>(model_config(s).num_parameters()),
      hybrid, plain, hybrid / plain, hybrid_bytes.shard, hybrid_bytes.replicas, plain_bytes.world);
  std::fflush(stdout);
}

// ZeRO++'s parts: hpZ's secondary groups (0: none), qwZ, qgZ (at qgz_bits a code, with LoCo's
// error feedback or not).
struct ZeroPP {
  int hpz = 0;
  bool qwz = false, qgz = false;
  int qgz_bits = 8;
  bool loco = false;
};

// One "engine_step_zeropp" line: stage 3 on `ranks` ranks with ZeRO++'s parts as given, beside
// plain stage 3 on the same ranks, measured back to back.
void zeropp_line(const BenchShape& s, int ranks, const ZeroPP& parts, int threads) {
  StepTraffic plain_bytes, bytes;
  const double plain = engine_ms(s, 3, ranks, threads, {.traffic = &plain_bytes});
  Variant variant{.traffic = &bytes};
  variant.options.hpz_size = parts.hpz;
  variant.options.quantized_weights = parts.qwz;
  variant.options.quantized_gradients = parts.qgz;
  variant.options.quantized_gradient_bits = parts.qgz_bits;
  variant.options.loco = parts.loco;
  const double ms = engine_ms(s, 3, ranks, threads, variant);
  std::printf(
      "{\"bench\": \"engine_step_zeropp\", \"config\": {\"stage\": 3, \"ranks\": %d, "
      "\"hpz_size\": %d, \"quantized_weights\": %s, \"quantized_gradients\": %s, "
      "\"quantized_gradient_bits\": %d, \"loco\": %s, \"threads_per_rank\": %d, "
      "\"params\": %lld}, \"value\": %.3f, \"unit\": \"ms\", "
      "\"plain_ms\": %.3f, \"ratio\": %.3f, \"world_bus_bytes\": %.0f, "
      "\"world_reduction_bus_bytes\": %.0f, \"secondary_bus_bytes\": %.0f, "
      "\"across_bus_bytes\": %.0f, \"plain_bus_bytes\": %.0f, "
      "\"plain_reduction_bus_bytes\": %.0f}\n",
      ranks, parts.hpz, parts.qwz ? "true" : "false", parts.qgz ? "true" : "false", parts.qgz_bits,
      parts.loco ? "true" : "false", threads,
      static_cast<long long>(model_config(s).num_parameters()), ms, plain, ms / plain, bytes.world,
      bytes.world_reductions, bytes.secondary, bytes.across, plain_bytes.world,
      plain_bytes.world_reductions);
  std::fflush(stdout);
}

// One "engine_step_nvme" line: `stage` with and without Offload<NVMe>, measured back to back,
// with rank 0's wait for its gathers' reads of master slices per step and the gathers per step
// served ahead, handed over by the step's pass, from the copies the step's pass kept (the
// gathers right after it), and read on demand; at stage 3 also with the master slices read on
// demand (nvme_read_ahead off).
void nvme_line(const BenchShape& s, int stage, int ranks, int threads, const std::string& path) {
  const double plain = engine_ms(s, stage, ranks, threads);
  offload::TensorReadStats reads;
  const double nvme = engine_ms(s, stage, ranks, threads, {.nvme_path = path, .reads = &reads});
  const double per_step = 1.0 / s.repeats;
  std::string stage3;
  if (stage == 3) {
    offload::TensorReadStats demand_reads;
    Variant on_demand{.nvme_path = path, .reads = &demand_reads};
    on_demand.options.nvme_read_ahead = false;
    const double demand = engine_ms(s, stage, ranks, threads, on_demand);
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  ", \"no_read_ahead_ms\": %.3f, \"no_read_ahead_ratio\": %.3f, "
                  "\"no_read_ahead_read_wait_ms\": %.3f",
                  demand, demand / plain, 1e3 * demand_reads.wait_s * per_step);
    stage3 = buf;
  }
  std::printf(
      "{\"bench\": \"engine_step_nvme\", \"config\": {\"stage\": %d, \"ranks\": %d, "
      "\"threads_per_rank\": %d, \"params\": %lld, \"nvme_path\": \"%s\"}, "
      "\"value\": %.3f, \"unit\": \"ms\", \"no_offload_ms\": %.3f, \"ratio\": %.3f, "
      "\"read_wait_ms\": %.3f, \"reads_ahead\": %.1f, \"reads_handed_over\": %.1f, "
      "\"reads_kept\": %.1f, \"reads_on_demand\": %.1f%s}\n",
      stage, ranks, threads, static_cast<long long>(model_config(s).num_parameters()), path.c_str(),
      nvme, plain, nvme / plain, 1e3 * reads.wait_s * per_step,
      static_cast<double>(reads.read_ahead) * per_step,
      static_cast<double>(reads.handed_over) * per_step, static_cast<double>(reads.kept) * per_step,
      static_cast<double>(reads.on_demand) * per_step, stage3.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  BenchShape s;
  std::string nvme_path = "/var/tmp";
  std::string only;  // one section: engine, nvme, hybrid or zeropp
  if (!bench::parse_flags(argc, argv, "engine_bench",
                          {{"--nvme-path", &nvme_path},
                           {"--only", &only},
                           {"--layers", &s.layers},
                           {"--channels", &s.channels},
                           {"--seq", &s.seq},
                           {"--batch", &s.batch},
                           {"--repeats", &s.repeats}}))
    return 2;
  if (!only.empty() && only != "engine" && only != "nvme" && only != "hybrid" && only != "zeropp") {
    std::fprintf(stderr, "engine_bench: --only takes engine, nvme, hybrid or zeropp, not '%s'\n",
                 only.c_str());
    return 2;
  }
  const auto runs = [&](const char* section) { return only.empty() || only == section; };
  // Every configuration uses all cores: OpenMP threads in the single process, ranks x threads
  // per rank in the engine runs.
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  if (runs("engine")) {
    const double baseline = single_process_ms(s, cores);
    const auto params = model_config(s).num_parameters();
    std::printf(
        "{\"bench\": \"engine_step\", \"config\": {\"mode\": \"single_process\", "
        "\"params\": %lld, \"batch\": %lld, \"seq\": %lld, \"threads\": %d}, "
        "\"value\": %.3f, \"unit\": \"ms\"}\n",
        static_cast<long long>(params), static_cast<long long>(s.batch),
        static_cast<long long>(s.seq), cores, baseline);
    for (int ranks : {1, 2, 4}) {
      for (int stage = 0; stage <= 3; ++stage) {
        const int threads = ranks >= cores ? 1 : cores / ranks;
        const double ms = engine_ms(s, stage, ranks, threads);
        std::printf(
            "{\"bench\": \"engine_step\", \"config\": {\"mode\": \"engine\", \"stage\": %d, "
            "\"ranks\": %d, \"threads_per_rank\": %d, \"params\": %lld}, \"value\": %.3f, "
            "\"unit\": \"ms\", \"single_process_ms\": %.3f, \"ratio\": %.3f}\n",
            stage, ranks, threads, static_cast<long long>(params), ms, baseline, ms / baseline);
        std::fflush(stdout);
      }
    }
  }
  if (!nvme_path.empty() && runs("nvme")) {
    for (int ranks : {1, 2}) {
      const int threads = ranks >= cores ? 1 : cores / ranks;
      for (int stage = 1; stage <= 3; ++stage) nvme_line(s, stage, ranks, threads, nvme_path);
    }
  }
  for (int stage = 1; stage <= 3 && runs("hybrid"); ++stage) {
    hybrid_line(s, stage, 4, 2, std::max(1, cores / 4));
  }
  for (const ZeroPP& parts :
       {ZeroPP{.hpz = 2}, ZeroPP{.qwz = true}, ZeroPP{.hpz = 2, .qwz = true}, ZeroPP{.qgz = true},
        ZeroPP{.hpz = 2, .qgz = true}, ZeroPP{.hpz = 2, .qwz = true, .qgz = true},
        ZeroPP{.qgz = true, .qgz_bits = 4}, ZeroPP{.hpz = 2, .qgz = true, .qgz_bits = 4},
        ZeroPP{.hpz = 2, .qwz = true, .qgz = true, .qgz_bits = 4},
        ZeroPP{.qgz = true, .qgz_bits = 4, .loco = true},
        ZeroPP{.hpz = 2, .qgz = true, .qgz_bits = 4, .loco = true}}) {
    if (!runs("zeropp")) break;
    zeropp_line(s, 4, parts, std::max(1, cores / 4));
  }
  return 0;
}
