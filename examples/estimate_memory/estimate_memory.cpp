// estimate_memory: model-state memory per GPU and per node for ZeRO stages 1-3, with and without
// offload, from zero's own formulas (zero/engine/memory_estimator.hpp), with DeepSpeed's
// estimate_zero2/zero3 numbers beside them where DeepSpeed has a formula. --shard-size S is
// hybrid sharding (EngineOptions::shard_size, zero_optimization.mics_shard_size): the states
// sharded over groups of S GPUs, so each holds what plain ZeRO on S GPUs holds (DeepSpeed's
// estimate has no such case: its columns are left empty). --hpz-size H is ZeRO++'s hierarchical
// partitioning (EngineOptions::hpz_size, zero_optimization.zero_hpz_partition_size): stage 3's
// peak adds the secondary shards each forward leaves for the backward's gathers inside groups of
// H GPUs (DeepSpeed's estimate has no such term: its stage-3 columns are left empty).
//
//   ./estimate_memory --model gpt2-xl [--gpus-per-node 8] [--nodes 1] [--precision bf16]
//                     [--shard-size S | --hpz-size H]
//   ./estimate_memory --params 7.5e9 --largest-layer 2e8 [...]
#include <cstdio>
#include <cstdlib>
#include <string>

#include <zero/engine/engine_options.hpp>
#include <zero/engine/memory_estimator.hpp>
#include <zero/nn/gpt_config.hpp>

#include "../cli_number.hpp"

namespace {

using namespace zero;
using zero::OffloadDevice;

constexpr const char* usage_line =
    "usage: estimate_memory (--model NAME | --params N --largest-layer L) [--gpus-per-node G] "
    "[--nodes M] [--precision f32|bf16|f16] [--shard-size S | --hpz-size H]\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "estimate_memory: %s\n%s", why.c_str(), usage_line);
  std::exit(2);
}

bool known_flag(const std::string& flag) {
  for (const char* f : {"--model", "--params", "--largest-layer", "--gpus-per-node", "--nodes",
                        "--precision", "--shard-size", "--hpz-size"}) {
    if (flag == f) return true;
  }
  return false;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%9.2f GiB", bytes / (1024.0 * 1024 * 1024));
  return buf;
}

}  // namespace

int main(int argc, char** argv) try {
  engine::MemoryEstimateInput in;
  std::string model;
  bool sized = false;           // --params or --largest-layer given
  std::int64_t shard_size = 0;  // hybrid sharding; 0: over every GPU
  std::int64_t hpz_size = 0;    // ZeRO++ hpZ's secondary groups; 0: none
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage_line, stdout);
      return 0;
    }
    // The name first: "--help" or a typo is not "a flag that needs a value".
    if (!known_flag(flag)) usage("unknown flag " + flag);
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[i + 1];
    if (flag == "--model")
      model = v;
    else if (flag == "--params") {
      in.params = examples::parse_count(flag, v);
      sized = true;
    } else if (flag == "--largest-layer") {
      in.largest_unit_params = examples::parse_count(flag, v);
      sized = true;
    } else if (flag == "--gpus-per-node")
      in.gpus_per_node = static_cast<int>(examples::parse_integer(flag, v, 1, 1 << 20));
    else if (flag == "--nodes")
      in.nodes = static_cast<int>(examples::parse_integer(flag, v, 1, 1 << 20));
    else if (flag == "--shard-size")
      shard_size = examples::parse_integer(flag, v, 1, 1 << 30);
    else if (flag == "--hpz-size")
      hpz_size = examples::parse_integer(flag, v, 1, 1 << 30);
    else if (flag == "--precision") {
      if (v == "f32")
        in.precision = DType::f32;
      else if (v == "bf16")
        in.precision = DType::bf16;
      else if (v == "f16")
        in.precision = DType::f16;
      else
        usage("--precision must be f32, bf16 or f16");
    }
  }
  // A preset's sizes would replace the given ones without a word.
  if (!model.empty() && sized) usage("--model excludes --params and --largest-layer");
  // The world is an int in the estimator.
  if (static_cast<std::int64_t>(in.gpus_per_node) * in.nodes > (std::int64_t{1} << 30)) {
    usage("--gpus-per-node times --nodes must be at most 2^30");
  }
  if (shard_size > 0 && in.world() % shard_size != 0) {
    usage("--shard-size " + std::to_string(shard_size) + " must divide the " +
          std::to_string(in.world()) + " GPUs");
  }
  const bool hybrid = shard_size > 0 && shard_size < in.world();
  if (hpz_size > 0 && in.world() % hpz_size != 0) {
    usage("--hpz-size " + std::to_string(hpz_size) + " must divide the " +
          std::to_string(in.world()) + " GPUs");
  }
  if (hpz_size > 0 && shard_size > 0) usage("--hpz-size and --shard-size: give one");
  const bool hpz = hpz_size > 1 && hpz_size < in.world();
  // The engine's options by default: stage 3's gathered units and persistence threshold, stages
  // 2-3's pending reductions (what its own check before the first allocation counts).
  const engine::EngineOptions defaults;
  std::int64_t units = 0, persistent = 0;
  if (!model.empty()) {
    const nn::GPTConfig c = nn::GPTConfig::preset(model);
    in.params = c.num_parameters();
    // nn::GPT's units: the embedding (token + position tables), one per block (12 C^2 + 13 C)
    // and the head (ln_f; the LM head is tied to the token table). At stage 3 the units of at
    // most persistence_threshold parameters stay gathered.
    const std::int64_t C = c.channels;
    const std::int64_t embedding = c.vocab_rows() * C + c.max_seq_len * C,
                       block = 12 * C * C + 13 * C, head = 2 * C;
    in.largest_unit_params = std::max(embedding, block);
    units = c.num_layers + 2;
    for (const std::int64_t n : {embedding, block, head}) {
      if (n <= defaults.persistence_threshold) {
        persistent += n == block ? n * c.num_layers : n;
      }
    }
  }
  if (in.params <= 0 || in.largest_unit_params <= 0)
    usage("give --model or --params and --largest-layer");
  // Without a model, as many units as the largest fills (none small enough to persist).
  if (units == 0) units = (in.params + in.largest_unit_params - 1) / in.largest_unit_params;
  if (hybrid) {
    in.shard_params = static_cast<double>(in.params) / static_cast<double>(shard_size);
    std::printf(
        "hybrid sharding: states sharded over groups of %lld of the %d GPUs, %lld "
        "replicas\n",
        static_cast<long long>(shard_size), in.world(),
        static_cast<long long>(in.world() / shard_size));
  }
  if (hpz) {
    std::printf(
        "hpZ: stage 3's backward gathers inside groups of %lld of the %d GPUs, from secondary "
        "shards of %lld parameters per GPU\n",
        static_cast<long long>(hpz_size), in.world(),
        static_cast<long long>((in.params - persistent) / hpz_size));
  }
  std::printf(
      "%lld parameters, largest unit %lld, %lld kept gathered at stage 3, %d GPU(s) per node x "
      "%d node(s), %s compute, Adam (8 bytes of state per parameter)\n",
      static_cast<long long>(in.params), static_cast<long long>(in.largest_unit_params),
      static_cast<long long>(persistent), in.gpus_per_node, in.nodes,
      std::string(name_of(in.precision)).c_str());
  std::printf("%-6s %-26s | %-12s %-12s %-12s %-12s | %-12s %-12s\n", "stage", "offload",
              "GPU at rest", "GPU peak", "CPU/node", "NVMe/node", "DS GPU", "DS CPU/node");
  struct Row {
    int stage;
    OffloadDevice opt, param;
    const char* label;
  };
  const Row rows[] = {{1, OffloadDevice::none, OffloadDevice::none, "none"},
                      {1, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                      {2, OffloadDevice::none, OffloadDevice::none, "none"},
                      {2, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                      {2, OffloadDevice::nvme, OffloadDevice::none, "optimizer->nvme"},
                      {3, OffloadDevice::none, OffloadDevice::none, "none"},
                      {3, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                      {3, OffloadDevice::cpu, OffloadDevice::cpu, "optimizer+params->cpu"},
                      {3, OffloadDevice::nvme, OffloadDevice::nvme, "optimizer+params->nvme"}};
  for (const Row& r : rows) {
    in.stage = r.stage;
    in.persistent_params = r.stage == 3 ? persistent : 0;
    in.secondary_params = r.stage == 3 && hpz ? static_cast<double>(in.params - persistent) /
                                                    static_cast<double>(hpz_size)
                                              : 0.0;
    in.live_units =
        r.stage == 3 ? engine::stage3_live_units(in.largest_unit_params, units,
                                                 defaults.prefetch_elems, defaults.max_live_elems)
                     : 1;
    in.pending_reductions = r.stage >= 2 ? defaults.max_pending_reductions : 0;
    in.offload_optimizer = r.opt;
    in.offload_param = r.param;
    const auto z = engine::estimate_model_states(in);
    const auto ds = engine::deepspeed_estimate(in);
    const double per_node = in.gpus_per_node;
    const bool has_ds =
        r.stage >= 2 && r.opt != OffloadDevice::nvme && !hybrid && !(hpz && r.stage == 3);
    std::printf("%-6d %-26s | %s %s %s %s | %s %s\n", r.stage, r.label,
                gib(z.device_at_rest).c_str(), gib(z.device_peak()).c_str(),
                gib(z.host * per_node).c_str(), gib(z.nvme * per_node).c_str(),
                has_ds ? gib(ds.device_peak()).c_str() : "        -   ",
                has_ds ? gib(ds.host).c_str() : "        -   ");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "estimate_memory: %s\n", e.what());
  return 1;
}
