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
// --model names a GPT-2 size (gpt2, gpt2-medium, ...) or a Llama preset (llama2-7b, llama2-13b,
// llama3-8b, llama3.1-8b, llama3.2-1b: nn::LayerLlama, grouped-query attention, no MoE blocks).
// With --model, each GPU's units are the model's own (nn::GPT built over shape-only groups,
// engine/model_memory_estimate.hpp), so the layouts of train_gpt apply: --tp T (Megatron's tensor
// parallelism, the vocabulary split too), --pp P (pipeline stages, --virtual-stages V chunks a
// rank, cut by --partition-method as PipelineEngine cuts them; the last stage holds a replica of
// the token table its LM head reads), --sp S (Ulysses: the states sharded over dp x sp), and MoE
// blocks (--experts E every --moe-every-th block, over --ep ranks, each expert over tp or, with
// --etp 1, whole experts over tp). The data-parallel size is what the GPUs leave: GPUs / (tp x pp x
// ep x sp). A pipeline prints each stage's parameters and, per row, its most loaded stage.
// --config FILE reads a DeepSpeed JSON config instead: its layout (tensor_parallel, pipeline, moe,
// sequence_parallel_size), ZeRO stage, offload, groups (mics_shard_size, zero_hpz_partition_size),
// stage 3's options, precision and optimizer, with "auto" filled as train_gpt fills it, and
// prints that one row.
//
//   ./estimate_memory --model gpt2-xl [--gpus-per-node 8] [--nodes 1] [--precision bf16]
//                     [--shard-size S | --hpz-size H] [--tp T] [--pp P [--virtual-stages V]
//                     [--partition-method M]] [--sp S] [--experts E [--moe-every K] [--ep N]
//                     [--etp 1|T]]
//   ./estimate_memory --model gpt2-large --gpus-per-node 8 --config ds_config.json
//   ./estimate_memory --model llama3-8b --gpus-per-node 8 --tp 2 [--pp P] [--sp S]
//   ./estimate_memory --params 7.5e9 --largest-layer 2e8 [...]
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/pipeline/stage_model.hpp>
#include <zero/config/auto_values.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/memory_estimator.hpp>
#include <zero/engine/model_memory_estimate.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/layer_llama.hpp>

#include "../cli_number.hpp"

namespace {

using namespace zero;
using zero::OffloadDevice;

constexpr const char* usage_line =
    "usage: estimate_memory (--model NAME | --params N --largest-layer L) [--gpus-per-node G] "
    "[--nodes M] [--precision f32|bf16|f16] [--shard-size S | --hpz-size H]\n"
    "       with --model: [--tp T] [--pp P [--virtual-stages V] [--partition-method M]] [--sp S] "
    "[--experts E [--moe-every K] [--ep N] [--etp 1|T]]\n"
    "       or --config ds_config.json: the config's layout, ZeRO stage, offload, precision and "
    "optimizer\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "estimate_memory: %s\n%s", why.c_str(), usage_line);
  std::exit(2);
}

bool known_flag(const std::string& flag) {
  for (const char* f :
       {"--model", "--params", "--largest-layer", "--gpus-per-node", "--nodes", "--precision",
        "--shard-size", "--hpz-size", "--tp", "--pp", "--virtual-stages", "--partition-method",
        "--sp", "--experts", "--moe-every", "--ep", "--etp", "--config"}) {
    if (flag == f) return true;
  }
  return false;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%9.2f GiB", bytes / (1024.0 * 1024 * 1024));
  return buf;
}

// How --model's GPUs split the model (train_gpt's layouts).
struct Layout {
  int tp = 1, pp = 1, ep = 1, sp = 1, dp = 1;
  int virtual_stages = 1;
  std::string partition_method = "parameters";  // PipelineEngine's default
  int experts = 0;                              // 0: a dense GPT
  int every = 2;                                // Megatron-DeepSpeed's expert interval
  int etp = 0;                                  // moe.expert_tensor_parallel_size (0: tp)
  bool pipelined() const { return pp * virtual_stages > 1; }
  bool plain() const { return tp * pp * ep * sp == 1 && experts == 0; }
};

// The MoE blocks of l, their experts over a shape-only ep group (none for a dense GPT).
nn::MoEBlocks moe_blocks(const Layout& l) {
  nn::MoEBlocks moe;
  if (l.experts > 0) {
    moe.router.num_experts = l.experts;
    moe.every = l.every;
    moe.ep = parallel::ExpertParallel::shape_only(l.ep, 0);
    moe.expert_tp = nn::expert_tensor_parallel_of(l.etp, l.tp);
  }
  return moe;
}

// What the estimate reads of a model's units: each pipeline stage's estimator input at a ZeRO
// stage, and which units a stage holds.
class ModelShape {
 public:
  virtual ~ModelShape() = default;
  // The estimator's input at ZeRO stage `stage` for the GPUs of each pipeline stage (one without
  // a pipeline): the whole model's units, or that stage's StageModel's.
  virtual std::vector<engine::MemoryEstimateInput> stage_inputs(
      int stage, const engine::ShardGroups& groups, const engine::EngineOptions& options) = 0;
  // The full model's units of pipeline stage s, as "a-b" per chunk, and its replicas.
  virtual std::string stage_units(int s) = 0;
};

// A model M (nn::GPT<float> or nn::LayerLlama<float>) as rank 0 of its tp and ep groups holds it
// (every rank of a group holds as many parameters), built over shape-only groups, and in a
// pipeline the partition PipelineEngine makes.
template <class M>
class ShapeModel final : public ModelShape {
 public:
  template <class... Args>
  ShapeModel(const Layout& l, Args&&... model_args)
      : layout_(l), model_(std::forward<Args>(model_args)...) {
    if (l.pipelined()) {
      part_ =
          parallel::pipeline::partition_model(model_, l.partition_method, l.pp, l.virtual_stages);
    }
  }

  std::vector<engine::MemoryEstimateInput> stage_inputs(
      int stage, const engine::ShardGroups& groups, const engine::EngineOptions& options) override {
    if (!part_) return {engine::model_estimate_input(model_, stage, groups, options)};
    std::vector<engine::MemoryEstimateInput> out;
    for (int s = 0; s < layout_.pp; ++s) {
      const parallel::pipeline::StageModel<M> m(model_, *part_, s, layout_.pp);
      out.push_back(engine::model_estimate_input(m, stage, groups, options));
    }
    return out;
  }

  std::string stage_units(int s) override {
    const parallel::pipeline::StageModel<M> m(model_, *part_, s, layout_.pp);
    std::string text;
    for (int c = 0; c < m.num_chunks(); ++c) {
      const engine::UnitRange r = part_->chunk(s, c, layout_.pp);
      text += (c > 0 ? ", " : "") + std::to_string(r.first) + "-" + std::to_string(r.last - 1);
    }
    for (int u = 0; u < m.num_units(); ++u) {
      if (m.unit_is_replica(u)) text += " + a replica of unit " + std::to_string(m.global_unit(u));
    }
    return text;
  }

 private:
  Layout layout_;
  M model_;
  std::optional<parallel::pipeline::Partition> part_;
};

// True for the names of nn::LlamaConfig's presets.
bool is_llama(const std::string& model) {
  return model.rfind("llama", 0) == 0;
}

}  // namespace

int main(int argc, char** argv) try {
  engine::MemoryEstimateInput in;
  std::string model;
  Layout layout;
  bool sized = false;           // --params or --largest-layer given
  bool split = false;           // a layout flag given (they need --model)
  std::int64_t shard_size = 0;  // hybrid sharding; 0: over every GPU
  std::int64_t hpz_size = 0;    // ZeRO++ hpZ's secondary groups; 0: none
  std::string config_path;      // --config: a DeepSpeed JSON config
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
    const auto size = [&] {
      split = true;
      return static_cast<int>(examples::parse_integer(flag, v, 1, 1 << 20));
    };
    if (flag == "--model")
      model = v;
    else if (flag == "--config")
      config_path = v;
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
    else if (flag == "--tp")
      layout.tp = size();
    else if (flag == "--pp")
      layout.pp = size();
    else if (flag == "--virtual-stages")
      layout.virtual_stages = size();
    else if (flag == "--sp")
      layout.sp = size();
    else if (flag == "--ep")
      layout.ep = size();
    else if (flag == "--experts") {
      split = true;
      layout.experts = static_cast<int>(examples::parse_integer(flag, v, 2, 1 << 20));
    } else if (flag == "--moe-every")
      layout.every = size();
    else if (flag == "--etp")
      layout.etp = size();
    else if (flag == "--partition-method") {
      split = true;
      layout.partition_method = v;
    } else if (flag == "--precision") {
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
  // A config gives the layout and ZeRO's groups: flags that repeat them could disagree with it.
  std::optional<Config> ds;
  if (!config_path.empty()) {
    if (split || shard_size > 0 || hpz_size > 0) {
      usage(
          "--config gives the layout and ZeRO's groups (tensor_parallel, pipeline, moe, "
          "sequence_parallel_size, mics_shard_size, zero_hpz_partition_size): drop the flags "
          "that repeat them");
    }
    ds = Config::from_json_file(config_path);
    layout.tp = static_cast<int>(std::max<std::int64_t>(1, ds->tensor_parallel.tp_size));
    layout.pp = static_cast<int>(std::max<std::int64_t>(1, ds->pipeline.stages));
    layout.virtual_stages =
        static_cast<int>(std::max<std::int64_t>(1, ds->pipeline.virtual_stages));
    layout.partition_method = ds->pipeline.partition_method;
    layout.sp = static_cast<int>(std::max<std::int64_t>(1, ds->sequence_parallel_size));
    if (ds->moe.active()) {
      layout.experts = static_cast<int>(ds->moe.num_experts);
      layout.ep = static_cast<int>(ds->moe.ep_size);
      layout.every = static_cast<int>(ds->moe.expert_interval);
      layout.etp = static_cast<int>(ds->moe.expert_tensor_parallel_size);
    }
    split = !layout.plain();
  }
  // Sizes alone have no layers to split.
  if (split && model.empty()) {
    usage("--tp, --pp, --sp, --ep and the MoE flags split a model's layers: give --model");
  }
  // The world is an int in the estimator.
  if (static_cast<std::int64_t>(in.gpus_per_node) * in.nodes > (std::int64_t{1} << 30)) {
    usage("--gpus-per-node times --nodes must be at most 2^30");
  }
  const std::int64_t model_split =
      static_cast<std::int64_t>(layout.tp) * layout.pp * layout.ep * layout.sp;
  if (in.world() % model_split != 0) {
    usage("tp x pp x ep x sp = " + std::to_string(model_split) + " must divide the " +
          std::to_string(in.world()) + " GPUs");
  }
  if (layout.ep > 1 && layout.experts == 0) usage("--ep needs --experts (an MoE model)");
  if (layout.virtual_stages > 1 && layout.pp == 1) usage("--virtual-stages needs --pp");
  layout.dp = static_cast<int>(in.world() / model_split);
  nn::GPTConfig cfg;
  nn::LlamaConfig llama;
  std::int64_t model_params = 0, hidden_size = 0;  // --model's
  if (is_llama(model)) {
    if (layout.experts > 0) usage("--experts adds GPT's MoE blocks: give a GPT-2 --model");
    llama = nn::LlamaConfig::preset(model);
    nn::check_llama_block(llama, layout.tp, layout.sp);
    model_params = llama.num_parameters();
    hidden_size = llama.channels;
  } else if (!model.empty()) {
    cfg = nn::GPTConfig::preset(model);
    // The vocabulary padded to a multiple of tp, as train_gpt pads it (and Megatron), so each
    // tensor-parallel rank holds an equal slice of the token table.
    const std::int64_t rows = (cfg.vocab_rows() + layout.tp - 1) / layout.tp * layout.tp;
    if (rows != cfg.vocab_rows()) cfg.padded_vocab_size = rows;
    model_params = cfg.num_parameters();
    hidden_size = cfg.channels;
  } else if (in.params <= 0 || in.largest_unit_params <= 0) {
    usage("give --model or --params and --largest-layer");
  }
  // The engine's options by default (stage 3's gathered units and persistence threshold, stages
  // 2-3's pending reductions: what its own check before the first allocation counts), or those
  // the config sets, with its "auto" filled as train_gpt fills it.
  engine::EngineOptions options;
  std::vector<std::string> chosen;
  if (ds) {
    config::AutoValues values;
    values.precision = in.precision == DType::f32    ? "fp32"
                       : in.precision == DType::bf16 ? "bf16"
                                                     : "fp16";
    values.hidden_size = hidden_size;
    chosen = config::fill_auto(*ds, values, static_cast<std::int64_t>(layout.dp) * layout.ep);
    options = options.with_config(*ds, layout.dp * layout.ep);
    shard_size = options.shard_size;
    hpz_size = options.hpz_size;
    in.precision = ds->bf16_enabled.value_or(false)   ? DType::bf16
                   : ds->fp16.enabled.value_or(false) ? DType::f16
                                                      : DType::f32;
    if (ds->optimizer) in.optimizer_state_bytes = engine::optimizer_state_bytes(*ds->optimizer);
  }
  const std::string shard_flag = ds ? "zero_optimization.mics_shard_size = " : "--shard-size ";
  const std::string hpz_flag = ds ? "zero_optimization.zero_hpz_partition_size = " : "--hpz-size ";
  // ZeRO's data-parallel group: ep x dp (x sp under Ulysses); experts over dp (x sp).
  const int dp_group = layout.dp * layout.sp * layout.ep;
  if (shard_size > 0 && dp_group % shard_size != 0) {
    usage(shard_flag + std::to_string(shard_size) + " must divide the " + std::to_string(dp_group) +
          " GPUs of the data-parallel group");
  }
  const bool hybrid = shard_size > 0 && shard_size < dp_group;
  if (hpz_size > 0 && dp_group % hpz_size != 0) {
    usage(hpz_flag + std::to_string(hpz_size) + " must divide the " + std::to_string(dp_group) +
          " GPUs of the data-parallel group");
  }
  if (hpz_size > 0 && shard_size > 0) usage("--hpz-size and --shard-size: give one");
  const bool hpz = hpz_size > 1 && hpz_size < dp_group;
  options.shard_size = hybrid ? static_cast<int>(shard_size) : 0;
  options.hpz_size = hpz ? static_cast<int>(hpz_size) : 0;
  // Without a model, as many units as the largest fills (none small enough to persist).
  const std::int64_t units =
      model.empty() ? (in.params + in.largest_unit_params - 1) / in.largest_unit_params : 0;
  // The model over shape-only groups and the groups ZeRO shards its units over, made once.
  std::unique_ptr<ModelShape> shape;
  engine::ShardGroups groups;
  if (is_llama(model)) {
    shape = std::make_unique<ShapeModel<nn::LayerLlama<float>>>(
        layout, llama, parallel::TensorParallel::shape_only(layout.tp, 0));
  } else if (!model.empty()) {
    shape = std::make_unique<ShapeModel<nn::GPT<float>>>(
        layout, (nn::check_sequence_parallel(cfg, layout.tp, layout.sp, false), cfg),  // Ulysses
        parallel::TensorParallel::shape_only(layout.tp, 0), parallel::SequenceParallel{},
        moe_blocks(layout));
  }
  if (!model.empty()) {
    groups = engine::shard_groups_of(
        {.tp = layout.tp, .cp = layout.sp, .ep = layout.ep, .dp = layout.dp, .pp = layout.pp},
        options);
  }
  // Each pipeline stage's input at ZeRO stage s (one without a pipeline).
  const auto inputs_at = [&](int s) {
    if (!model.empty()) {
      std::vector<engine::MemoryEstimateInput> staged = shape->stage_inputs(s, groups, options);
      for (engine::MemoryEstimateInput& x : staged) {
        x.gpus_per_node = in.gpus_per_node;  // DeepSpeed's formulas read the world
        x.nodes = in.nodes;
        x.precision = in.precision;
        x.optimizer_state_bytes = in.optimizer_state_bytes;
      }
      return staged;
    }
    engine::MemoryEstimateInput x = in;
    x.stage = s;
    if (hybrid) {
      x.shard_params = static_cast<double>(in.params) / static_cast<double>(shard_size);
    }
    x.secondary_params =
        s == 3 && hpz ? static_cast<double>(in.params) / static_cast<double>(hpz_size) : 0.0;
    engine::apply_options(x, options, static_cast<int>(units));
    return std::vector<engine::MemoryEstimateInput>{x};
  };
  if (hybrid) {
    std::printf(
        "hybrid sharding: states sharded over groups of %lld of the %d GPUs, %lld "
        "replicas\n",
        static_cast<long long>(shard_size), dp_group,
        static_cast<long long>(dp_group / shard_size));
  }
  const std::vector<engine::MemoryEstimateInput> at3 = inputs_at(3);
  const std::string optimizer = (ds && ds->optimizer ? ds->optimizer->type : std::string("Adam")) +
                                " (" + std::to_string(in.optimizer_state_bytes) +
                                " bytes of state per parameter)";
  if (hpz) {
    std::printf(
        "hpZ: stage 3's backward gathers inside groups of %lld of the %d GPUs, from secondary "
        "shards of %.0f parameters per GPU\n",
        static_cast<long long>(hpz_size), dp_group, at3.front().secondary_params);
  }
  if (model.empty()) {
    std::printf(
        "%lld parameters, largest unit %lld, %d GPU(s) per node x %d node(s), %s compute, %s\n",
        static_cast<long long>(in.params), static_cast<long long>(in.largest_unit_params),
        in.gpus_per_node, in.nodes, std::string(name_of(in.precision)).c_str(), optimizer.c_str());
  } else {
    std::printf(
        "%s: %lld parameters; tp %d x pp %d x ep %d x sp %d x dp %d = %d GPUs (%d per node x %d "
        "node(s)), %s compute, %s\n",
        model.c_str(), static_cast<long long>(model_params), layout.tp, layout.pp, layout.ep,
        layout.sp, layout.dp, in.world(), in.gpus_per_node, in.nodes,
        std::string(name_of(in.precision)).c_str(), optimizer.c_str());
    if (cfg.padded_vocab_size > 0) {
      std::printf("the vocabulary of %lld padded to %lld rows, a multiple of tp\n",
                  static_cast<long long>(cfg.vocab_size),
                  static_cast<long long>(cfg.padded_vocab_size));
    }
    if (layout.experts > 0) {
      std::printf("MoE: %d experts in one block of every %d, %d per ep rank%s\n", layout.experts,
                  layout.every, layout.experts / layout.ep,
                  layout.tp > 1 ? (nn::expert_tensor_parallel_of(layout.etp, layout.tp) ==
                                           nn::ExpertTensorParallel::experts
                                       ? ", whole experts over tp"
                                       : ", each split over tp")
                                : "");
    }
    for (std::size_t s = 0; s < at3.size(); ++s) {
      const std::string where = layout.pipelined()
                                    ? "pipeline stage " + std::to_string(s) + " (units " +
                                          shape->stage_units(static_cast<int>(s)) + ")"
                                    : std::string("each GPU");
      std::printf("%s: %lld parameters (padded), largest unit %lld", where.c_str(),
                  static_cast<long long>(at3[s].params),
                  static_cast<long long>(at3[s].largest_unit_params));
      if (!layout.pipelined()) {
        std::printf(", %lld kept gathered at ZeRO stage 3",
                    static_cast<long long>(at3[s].persistent_params));
      }
      std::printf("\n");
    }
  }
  struct Row {
    int stage;
    OffloadDevice opt, param;
    std::string label;
  };
  std::vector<Row> rows = {{1, OffloadDevice::none, OffloadDevice::none, "none"},
                           {1, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                           {2, OffloadDevice::none, OffloadDevice::none, "none"},
                           {2, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                           {2, OffloadDevice::nvme, OffloadDevice::none, "optimizer->nvme"},
                           {3, OffloadDevice::none, OffloadDevice::none, "none"},
                           {3, OffloadDevice::cpu, OffloadDevice::none, "optimizer->cpu"},
                           {3, OffloadDevice::cpu, OffloadDevice::cpu, "optimizer+params->cpu"},
                           {3, OffloadDevice::nvme, OffloadDevice::nvme, "optimizer+params->nvme"}};
  // PipelineEngine composes with ZeRO stages 0-1 only (DeepSpeed's pipeline engine too).
  if (ds) {
    const config::ZeroOptimizationConfig& z = ds->zero_optimization;
    expect<ConfigError>(!layout.pipelined() || z.stage <= 1, "pipeline.stages = ", layout.pp,
                        " trains at ZeRO stage 0 or 1; the config asks for stage ", z.stage);
    const OffloadDevice opt = z.offload_optimizer.device, param = z.offload_param.device;
    const auto where = [](OffloadDevice d) { return d == OffloadDevice::nvme ? "nvme" : "cpu"; };
    std::string label = opt == OffloadDevice::none && param == OffloadDevice::none ? "none" : "";
    if (opt != OffloadDevice::none) label += std::string("optimizer->") + where(opt);
    if (param != OffloadDevice::none) {
      label += (label.empty() ? "" : ", ") + std::string("params->") + where(param);
    }
    rows = {{z.stage, opt, param, label}};
    std::printf("config %s: ZeRO stage %d, offload %s\n", config_path.c_str(), z.stage,
                label.c_str());
    for (const std::string& c : chosen) std::printf("config: auto: %s\n", c.c_str());
  } else if (layout.pipelined()) {
    std::printf("a pipeline trains at ZeRO stage 0 or 1: stages 2-3 are left out\n");
  }
  std::printf("%-6s %-26s | %-12s %-12s %-12s %-12s | %-12s %-12s%s\n", "ZeRO", "offload",
              "GPU at rest", "GPU peak", "CPU/node", "NVMe/node", "DS GPU", "DS CPU/node",
              layout.pipelined() ? " | largest pp stage" : "");
  for (const Row& r : rows) {
    if (layout.pipelined() && r.stage >= 2) continue;
    // The pipeline stage whose GPUs need the most device memory at their peak.
    std::size_t largest = 0;
    engine::MemoryEstimate z;
    engine::MemoryEstimateInput x;
    std::vector<engine::MemoryEstimateInput> staged = inputs_at(r.stage);
    for (std::size_t s = 0; s < staged.size(); ++s) {
      staged[s].offload_optimizer = r.opt;
      staged[s].offload_param = r.param;
      const engine::MemoryEstimate e = engine::estimate_model_states(staged[s]);
      if (s == 0 || e.device_peak() > z.device_peak()) {
        largest = s;
        z = e;
        x = staged[s];
      }
    }
    const auto ds = engine::deepspeed_estimate(x);
    const double per_node = in.gpus_per_node;
    // DeepSpeed's formulas are for data parallelism over every GPU.
    const bool has_ds = r.stage >= 2 && r.opt != OffloadDevice::nvme && !hybrid &&
                        !(hpz && r.stage == 3) && layout.plain();
    std::printf("%-6d %-26s | %s %s %s %s | %s %s", r.stage, r.label.c_str(),
                gib(z.device_at_rest).c_str(), gib(z.device_peak()).c_str(),
                gib(z.host * per_node).c_str(), gib(z.nvme * per_node).c_str(),
                has_ds ? gib(ds.device_peak()).c_str() : "        -   ",
                has_ds ? gib(ds.host).c_str() : "        -   ");
    if (layout.pipelined()) std::printf(" | %zu", largest);
    std::printf("\n");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "estimate_memory: %s\n", e.what());
  return 1;
}
