// train_gpt: trains a byte-level GPT-2 on the bundled corpus (or GPT-2 token files: llm.c's, or
// raw uint16 / int32 streams such as nanoGPT's train.bin with --token-format) with the ZeRO
// engine, configured like a DeepSpeed run.
//
// By default 2 ranks in one process (LocalComm threads) at ZeRO stage 3: every rank holds only its
// shard of each unit and gathers a unit just before using it. Under mpiexec (built with MPI)
// every process is one rank over MpiComm. The DeepSpeed JSON (--config, or a built-in default:
// AdamW, WarmupCosineLR, clipping 1.0, ZeRO-3) picks the stage and the precision (zero::dispatch:
// f32, or bf16 with "bf16": {"enabled": true}), optimizer, schedule, batch sizes, clipping and
// comm_timeout_s; flags override the model shape and the run. A Hugging Face-style config's
// "auto" values are filled from the flags and defaults as the HF Trainer does (--batch is the
// global batch, --grad-accum the accumulation, --lr, --warmup, --precision, the bucket sizes from
// --channels), and the choices are printed, as are the keys that have no effect in zero.
//
//   ./train_gpt [--config ds.json] [--ranks 2] [--stage 3] [--shard-size N | --hpz-size N]
//               [--quantized-weights]
//               [--quantized-gradients [--quantized-gradient-bits 4] [--loco-err-beta 0.8]]
//               [--steps 100]
//               [--batch 8] [--seq 64]
//               [--grad-accum 1] [--warmup N] [--precision f32|bf16]
//               [--layers 4] [--heads 4] [--channels 128] [--lr 1e-3] [--seed 1234]
//               [--data corpus.txt |
//                --tokens train.bin [--val-tokens val.bin] [--token-format llmc|raw_u16|raw_i32]
//                [--vocab 50257]]
//               [--init gpt2.safetensors]
//               [--print-every 10] [--metrics metrics.jsonl]
//               [--temperature 0.8] [--top-k 40] [--sample-bytes 96] [--profile]
//               [--save-dir ckpt --save-every 50] [--resume latest|<tag>]
//               [--export model.safetensors [--export-dtype f32|bf16|f16]
//                [--export-shard-bytes N]] [--nvme-path DIR]
//               [--tp 2 [--sp]] [--pp 2 [--vpp 2] [--schedule gpipe|1f1b|interleaved|zb]]
//               [--experts 4 [--ep 2] [--k 2] [--etp 1]] [--sp N]
//               [--device host|cuda] [--offload-cpu [--delayed-update N] [--grads-on-device]
//               [--offload-ratio R]]
//               [--activation-mb M]
//
// --shard-size N is hybrid sharding (the config's zero_optimization.mics_shard_size; DeepSpeed's
// MiCS, FSDP's HYBRID_SHARD): ZeRO shards over groups of N data-parallel ranks and replicates
// across the groups, so the gathers stay inside a group (a node, say) and only the averages of
// the reduced shards cross between them.
// --hpz-size N is ZeRO++'s hierarchical partitioning (the config's
// zero_optimization.zero_hpz_partition_size; stage 3): each forward gathers a unit over every
// data-parallel rank and keeps a secondary shard of it, and the backward gathers it inside groups
// of N ranks from those shards, so only the forward's gathers cross between the groups.
// --quantized-weights is ZeRO++'s quantized weights (zero_optimization.zero_quantized_weights;
// stage 3): the parameter gathers move block-wise int8, the units compute on what it stands for.
// --quantized-gradients is ZeRO++'s quantized gradients (zero_optimization.
// zero_quantized_gradients; stage 3): each gradient reduce-scatter becomes an all-to-all of
// block-wise int8, averaged in f32 by the rank that holds the shard; --quantized-gradient-bits 4
// (zero's own zero_quantized_gradient_bits) packs int4 instead, DeepSpeed's width, and
// --loco-err-beta B adds ZeRO++'s LoCo error feedback (zero_optimization.zeropp_loco_param's
// err_beta B): each rank carries what its packings lost into its next ones.
// --tp N splits every layer over N ranks (Megatron tensor parallelism; the config's
// "tensor_parallel": {"autotp_size": N} says the same) and --sp adds sequence parallelism; the
// remaining factor of the ranks is data parallel, over which ZeRO shards. The byte vocabulary's
// table (257 rows) is padded to a multiple of N, as Megatron pads its vocabulary, and the loss
// masks the padding out of the softmax (GPTConfig::padded_vocab_size); --init and --export read
// and write the real tokens' rows, so a GPT-2 file loads at any N.
// --pp N cuts the model's units into N pipeline stages (the config's "pipeline": {"stages": N},
// or Megatron's pipeline_model_parallel_size) run by a checked schedule (--schedule, default
// 1f1b; --vpp V chunks per stage with the interleaved schedule); each step runs the
// accumulation's micro-batches through the pipeline. The built-in config then uses ZeRO stage 1
// (stages 2 and 3 do not compose with a pipeline). The step line adds the bubble fraction;
// the profiler's reports are gathered from every stage and printed stage by stage.
// --experts E makes every second block's MLP a mixture of E GPT-MLP experts behind a top-k
// router (--k 1 or 2; the config's "moe" section gives the rest: capacity_factor, min_capacity,
// drop_tokens, use_rts, noisy_gate_policy, ..., expert_interval), and --ep N splits the experts
// over N expert-parallel ranks, the tokens travelling to their experts by all-to-all; the dense
// parameters stay data parallel over all ranks (DeepSpeed's layout). The step line adds the
// load-balancing loss and the share of routed choices dropped past their expert's capacity
// (with --pp, summed over the stages, each of which routes its own blocks). --experts and --ep
// combine with --pp (each stage's experts split over its ep ranks), --sp N (each Ulysses rank
// routes its own positions) and --tp (each expert's hidden units split over the tensor-parallel
// ranks, as Megatron's expert tensor parallelism; with --sp too, the MoE layers gather the rows
// over tp and route them all; --etp 1 keeps the experts whole instead, the tp ranks holding
// different ones as more expert-parallel ranks: the config's moe.expert_tensor_parallel_size).
// --sp N (a number) is DeepSpeed-Ulysses sequence parallelism: each of N ranks holds seq/N
// positions of every sequence, attention gets whole sequences for heads/N heads by all-to-all,
// and ZeRO shards over the data x sequence ranks ("sequence_parallel_size" in the config). It
// combines with --tp (each tensor-parallel rank's heads split over its N ranks) and --pp.
// --sp without a number is Megatron's sequence parallelism beside --tp.
//
// --device cuda (the train_gpt_cuda build: this file compiled by nvcc, when CMake finds it) trains
// on the GPU: Compute<Cuda>, bf16, the --ranks ranks as threads sharing one GPU over
// CudaLocalComm or, under mpiexec (built with NCCL and MPI), one process per GPU over NcclComm
// (each on its node-local GPU), the optimizer's fused passes on the device (or on the host with
// --offload-cpu, the config's "offload_optimizer": {"device": "cpu"}: ZeRO-Offload), ZeRO stages
// 0-3, data parallel only (tensor, pipeline, expert and sequence parallelism run on the host);
// train_gpt_cuda defaults to it and train_gpt refuses it. GPT-2 small is --layers 12 --heads 12
// --channels 768 --seq 1024 (with --tokens for GPT-2's vocabulary, and --init for its weights);
// --delayed-update N (--offload-cpu; stages 1-2, or 3 in bf16) runs the host optimizer a step late
// beside the next window from step N + 1 on (ZeRO-Offload's delayed parameter update, DPU:
// EngineOptions::delayed_param_update; the first N steps update in step() as a warm-up).
// --grads-on-device (the optimizer offloaded to the cpu, by --offload-cpu or the config; stages
// 2-3) sums a step's --grad-accum micro-batches of gradient shards in device memory and copies
// them to the host once a step (EngineOptions::accumulate_grads_on_device), not once a
// micro-batch.
// --offload-ratio R (the optimizer offloaded to the cpu; in (0, 1]) offloads that fraction of the
// states and keeps the last units' on the GPU, updated there (ZeRO-Offload++'s Twin-Flow: the
// config's zero_optimization.offload_optimizer.ratio); with --delayed-update only the offloaded
// units' update is delayed.
// --activation-mb sizes the activation arena (default 512; GPT-2 small at batch 8 needs about
// 20000). The step line adds the model's TFLOP/s (6N + 6LCT per token, every rank's tokens) and,
// on a GPU whose datasheet bf16 peak is known, the MFU against the peak of every GPU in use (one
// for --ranks over CudaLocalComm, one a process under mpiexec).
// The config's flops_profiler, wall_clock_breakdown, memory_breakdown and comms_logger sections
// print zero::profile's reports (docs/observability.md); --profile switches all four on (the
// flops profile at step 2) and --metrics adds their figures to the JSONL lines.
// The closing sample continues the start of the validation text by temperature / top-k sampling
// seeded from --seed (--temperature 0 is greedy); bytes outside printable ASCII print escaped.
// --export writes the trained weights at the end as one Hugging Face GPT-2 safetensors file,
// streamed unit by unit from the live engine (no rank holds the whole model), or with
// --export-shard-bytes N as Hugging Face's shards of at most N bytes of data beside
// model.safetensors.index.json (save_pretrained's max_shard_size); --init reads either back
// (the file, the index, or the directory that holds them). --nvme-path puts the fp32 master and
// AdamW states in swap files under DIR (ZeRO-Infinity; the same as "offload_optimizer": {"device":
// "nvme", "nvme_path": DIR}).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <parallel/comm/text_collectives.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/config/auto_values.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>
#include <zero/data/token_file.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/sampler.hpp>
#include <zero/profile/mfu.hpp>
#include <zero/profile/monitor.hpp>

#include "../cli_number.hpp"
#include "../training_run.hpp"

// Inside zero (rather than `using namespace zero` at file scope): a using-directive that reaches
// the global scope makes `cuda` ambiguous (zero::cuda, CCCL's ::cuda) in the stubs nvcc generates
// for CUB's kernels when train_gpt_cuda compiles this file.
namespace zero::train_gpt {
namespace {

using namespace zero::examples;  // the examples' shared run (training_run.hpp)

struct Options : RunFlags {          // the flags train_llama takes too (run_flags.hpp), and these
  std::optional<int> shard_size;     // hybrid sharding (default: the config's mics_shard_size)
  bool quantized_weights = false;    // ZeRO++ qwZ (or the config's zero_quantized_weights)
  bool quantized_gradients = false;  // ZeRO++ qgZ (or the config's zero_quantized_gradients)
  std::optional<int> quantized_gradient_bits;  // qgZ's 8 or 4 (zero_quantized_gradient_bits)
  std::optional<double> loco_err_beta;         // LoCo (zeropp_loco_param.err_beta)
  std::optional<int> hpz_size;        // ZeRO++ hpZ (default: the config's zero_hpz_partition_size)
  std::optional<int> experts, ep, k;  // MoE: experts per layer, expert-parallel size, top-k
  std::optional<int> etp;             // MoE: expert tensor-parallel size (1 or tp)
  std::int64_t layers = 4, heads = 4, channels = 128;
  bool profile = false;
  std::optional<std::int64_t> delayed_update;  // DPU after this many steps (--delayed-update)
  bool grads_on_device = false;                // --grads-on-device
  std::optional<double> offload_ratio;         // offload_optimizer.ratio (--offload-ratio)
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "train_gpt: %s (see the comment at the top of train_gpt.cpp)\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  o.data = ZERO_DEFAULT_CORPUS;
#if defined(ZERO_TRAIN_GPT_CUDA)
  o.device = "cuda";  // the train_gpt_cuda build trains on the GPU
#else
  o.device = "host";
#endif
  const auto own_switch = [&](const std::string& flag) {
    bool* on = flag == "--profile"               ? &o.profile
               : flag == "--grads-on-device"     ? &o.grads_on_device
               : flag == "--quantized-weights"   ? &o.quantized_weights
               : flag == "--quantized-gradients" ? &o.quantized_gradients
                                                 : nullptr;
    if (on != nullptr) *on = true;
    return on != nullptr;
  };
  const auto own_flag = [&](const FlagValue& v) {
    const std::string& flag = v.flag;
    const auto count = [&] { return static_cast<int>(v.positive()); };
    if (flag == "--shard-size")
      o.shard_size = count();
    else if (flag == "--hpz-size")
      o.hpz_size = count();
    else if (flag == "--quantized-gradient-bits")
      o.quantized_gradient_bits = static_cast<int>(v.integer(4, 8));
    else if (flag == "--loco-err-beta")
      o.loco_err_beta = v.real();
    else if (flag == "--experts")
      o.experts = count();
    else if (flag == "--ep")
      o.ep = count();
    else if (flag == "--etp")
      o.etp = count();
    else if (flag == "--k")
      o.k = count();
    else if (flag == "--layers")
      o.layers = v.positive();
    else if (flag == "--heads")
      o.heads = v.positive();
    else if (flag == "--channels")
      o.channels = v.positive();
    else if (flag == "--delayed-update")
      o.delayed_update = v.integer();
    else if (flag == "--offload-ratio")
      o.offload_ratio = v.real();
    else
      return false;
    return true;
  };
  const auto check = [](const Options& f) {
    check_run_flags(f);
    expect<ConfigError>(!f.delayed_update || (*f.delayed_update >= 0 && f.device == "cuda"),
                        "--delayed-update N (N >= 0 warm-up steps) delays the host optimizer of "
                        "--offload-cpu: it needs --device cuda");
    // Without offload (from --offload-cpu or the config) or at stage 1 the engine refuses it.
    expect<ConfigError>(!f.grads_on_device || f.device == "cuda",
                        "--grads-on-device sums the offloaded gradient shards on the GPU: it needs "
                        "--device cuda");
    // The config's parser checks the range, and make_config the offload it needs.
    expect<ConfigError>(!f.offload_ratio || f.device == "cuda",
                        "--offload-ratio R keeps part of the offloaded states on the GPU: it "
                        "needs --device cuda");
    expect<ConfigError>(!f.vocab || !f.tokens.empty(),
                        "--vocab is the vocabulary of the --tokens files (a --data text is byte "
                        "tokens, 257)");
  };
  parse_flags(argc, argv, o, own_switch, own_flag, check, usage);
  return o;
}

// The built-in DeepSpeed config (what a user would write for this small run) or --config's, with
// the flags that override keys written into the JSON before it is parsed, so the notices about
// keys without effect describe the config that runs.
Config make_config(const Options& o) {
  // ZeRO++'s and hybrid sharding's keys, from their flags.
  const auto zero_flags = [&](nlohmann::json& j) {
    if (o.shard_size) j["zero_optimization"]["mics_shard_size"] = *o.shard_size;
    if (o.hpz_size) j["zero_optimization"]["zero_hpz_partition_size"] = *o.hpz_size;
    if (o.quantized_weights) j["zero_optimization"]["zero_quantized_weights"] = true;
    if (o.quantized_gradients) j["zero_optimization"]["zero_quantized_gradients"] = true;
    if (o.quantized_gradient_bits) {
      j["zero_optimization"]["zero_quantized_gradient_bits"] = *o.quantized_gradient_bits;
    }
    if (o.loco_err_beta) {
      j["zero_optimization"]["zeropp_loco_param"]["err_beta"] = *o.loco_err_beta;
    }
    if (o.offload_ratio) j["zero_optimization"]["offload_optimizer"]["ratio"] = *o.offload_ratio;
  };
  nlohmann::json j = builtin_config(o.run, o.pp.value_or(1) > 1 ? 1 : 3);
  zero_flags(j);
  if (!o.config.empty()) {
    j = read_config_json(o.config);
    if (!j.is_object()) return Config::from_json(j);  // the parser names the problem
    zero_flags(j);
    override_config(j, o.config, o.run);
  }
  write_run_flags(j, o);
  if (o.experts) j["moe"]["num_experts"] = *o.experts;
  if (o.ep) j["moe"]["ep_size"] = *o.ep;
  if (o.etp) j["moe"]["expert_tensor_parallel_size"] = *o.etp;
  if (o.k) j["moe"]["k"] = *o.k;
  Config c;
  try {
    c = Config::from_json(j);
  } catch (const ConfigError& e) {
    if (o.config.empty()) throw;
    throw ConfigError(o.config + ": " + e.what());
  }
  expect<ConfigError>(
      !o.offload_ratio || c.zero_optimization.offload_optimizer.device == OffloadDevice::cpu,
      "--offload-ratio ", o.offload_ratio.value_or(1.0),
      " divides the optimizer's states between the host and the GPU: it needs them offloaded to "
      "the cpu (--offload-cpu, or the config's zero_optimization.offload_optimizer.device "
      "\"cpu\")");
  apply_tensor_parallel_flags(c, o);
  if (o.profile) {
    c.flops_profiler.enabled = true;
    // The second step (past the warm-up), or the only one.
    c.flops_profiler.profile_step =
        std::min<std::int64_t>(1, std::max<std::int64_t>(o.run.steps - 1, 0));
    c.wall_clock_breakdown = true;
    c.memory_breakdown = true;
    c.comms_logger.enabled = true;
  }
  return c;
}

// The run's tokens: --tokens files (GPT-2's vocabulary unless --vocab), else --data's bytes.
Corpus load_corpus(const Options& o) {
  return examples::load_corpus(o.data, o.tokens, o.val_tokens,
                               o.token_format.value_or(data::TokenFormat::llmc),
                               o.vocab.value_or(50257));
}

// The rows of the model's embedding: the vocabulary padded to a multiple of tp, as Megatron pads
// it, so each tensor-parallel rank holds an equal slice (the padding is masked out of the loss).
std::int64_t padded_vocab(std::int64_t vocab, std::int64_t tp) {
  return (vocab + tp - 1) / tp * tp;
}

// What both training paths build alike over groups: the batch sizes for its data-parallel
// ranks (ep x dp: expert-parallel ranks read different rows, as DeepSpeed's), the train and
// validation loaders of this data-parallel rank (the tp, sp and pp ranks of a data-parallel rank
// read the same rows), the model's shape (its byte vocabulary padded to a multiple of tp as
// Megatron pads it) and the model, split over the tensor-parallel group, the Ulysses group and
// with its experts over the expert-parallel group.
template <class Model>
struct RunSetup {
  int dp;
  Config::BatchSizes sizes;
  data::DataLoader train_loader, val_loader;
  nn::GPTConfig gpt;
  Model model;

  template <class Comm>
  RunSetup(const Options& o, const Config& cfg, const Corpus& corpus,
           parallel::ProcessGroups<Comm>& groups)
      : dp(data_group(groups).size()),
        sizes(cfg.resolve_batch(dp)),
        train_loader(corpus.train, loader_config(sizes, o.seq, dp, data_group(groups).rank(), true,
                                                 o.seed, corpus.vocab)),
        val_loader(corpus.val, loader_config(sizes, o.seq, dp, data_group(groups).rank(), false,
                                             o.seed, corpus.vocab)),
        gpt(model_config(o, corpus, groups.tp().size())),
        model(gpt, parallel::TensorParallel(groups.tp(), cfg.tensor_parallel.sequence_parallel),
              parallel::SequenceParallel(groups.cp()),
              nn::MoEBlocks::from_config(cfg.moe, parallel::ExpertParallel(groups.ep()),
                                         groups.tp().size())) {}

  /// The ranks that read different rows: ep x dp.
  template <class Comm>
  static Comm& data_group(parallel::ProcessGroups<Comm>& groups) {
    return groups.get({parallel::Axis::ep, parallel::Axis::dp});
  }

 private:
  static nn::GPTConfig model_config(const Options& o, const Corpus& corpus, int tp) {
    nn::GPTConfig gc;
    gc.vocab_size = corpus.vocab;
    if (padded_vocab(corpus.vocab, tp) != corpus.vocab) {
      gc.padded_vocab_size = padded_vocab(corpus.vocab, tp);
    }
    gc.max_seq_len = o.seq;
    gc.num_layers = o.layers;
    gc.num_heads = o.heads;
    gc.channels = o.channels;
    return gc;
  }
};

// The engine settings of both paths.
engine::EngineOptions engine_options(const Options& o) {
  engine::EngineOptions eo;
  eo.seed = o.seed;
  eo.activation_bytes = static_cast<std::size_t>(o.activation_mb) << 20;
  if (o.delayed_update) {
    eo.delayed_param_update = true;
    eo.delayed_update_after = *o.delayed_update;
  }
  eo.accumulate_grads_on_device = o.grads_on_device;
  return eo;
}

// What the MoE layers routed over a step: the load-balancing loss (mean over micro-steps) and
// the choices dropped past their expert's capacity, summed over micro-steps and ranks.
struct RoutingTotals {
  double aux_loss = 0, dropped = 0, choices = 0, micro_steps = 0;

  // This rank's step: the model's MoE window (reset at the step's start) over its micro-steps.
  template <class Model>
  static RoutingTotals of_window(const Model& model, std::int64_t micro_steps) {
    const nn::MoEStats s = model.moe_window_stats();
    return {s.aux_loss, static_cast<double>(s.dropped), static_cast<double>(s.choices),
            static_cast<double>(micro_steps)};
  }
  // The totals of every data-parallel rank (a collective; the mean aux loss). In a pipeline,
  // each stage holds its own MoE blocks' share: stages (the pp group) sums those first.
  template <class Eng, class Comm = void>
  RoutingTotals over_ranks(Eng& eng, Comm* stages = nullptr) const {
    double v[4] = {aux_loss, dropped, choices, micro_steps};
    if constexpr (!std::is_void_v<Comm>) {
      if (stages != nullptr) stages->all_reduce(std::span<double>(v, 3), parallel::ReduceOp::sum);
    }
    eng.sum_over_data_parallel(std::span<double>(v, 4));
    return {v[3] > 0 ? v[0] / v[3] : 0, v[1], v[2], v[3]};
  }
  double dropped_fraction() const { return choices > 0 ? dropped / choices : 0; }
  // " | aux 0.0123 | dropped 4.1%" with MoE layers, else empty.
  std::string line() const {
    if (choices == 0) return {};
    char text[64];
    std::snprintf(text, sizeof text, " | aux %.4f | dropped %.1f%%", aux_loss,
                  100.0 * dropped_fraction());
    return text;
  }
};

// Parameters of the whole model (tensors split over tp or ep counted whole, once); with active,
// those one token passes through, for its FLOPs: with top-k routing over E experts a token uses
// k of each MoE block's experts, so the expert units count k/E of their parameters. Every
// pipeline stage counts the whole model (the full model object is on every rank).
template <class Model>
double count_parameters(const Model& model, const Config& cfg, bool active = false) {
  double n = 0;
  for (int u = 0; u < model.num_units(); ++u) {
    double unit = 0;
    for (const nn::ParamSpec& p : model.unit_params(u)) {
      unit += static_cast<double>(p.logical_shape().numel());
    }
    if constexpr (nn::HasExpertUnits<Model>) {
      if (active && cfg.moe.active() && model.unit_is_expert(u)) {
        unit *= static_cast<double>(cfg.moe.k) / static_cast<double>(cfg.moe.num_experts);
      }
    }
    n += unit;
  }
  return n;
}

// "; hybrid sharding: ZeRO shards over groups of 2 ranks, 2 replicas" under hybrid sharding
// (EngineOptions::shard_size below the dp ranks), or of ZeRO++ hpZ's secondary groups
// (EngineOptions::hpz_size below them), else empty; then ZeRO++'s quantized exchanges.
std::string shard_note(const engine::EngineOptions& options, int dp) {
  const int shard_size = options.shard_size, hpz_size = options.hpz_size;
  const std::string quantized =
      std::string(options.quantized_weights ? "; qwZ: parameters gathered as block-wise int8"
                                            : "") +
      (options.quantized_gradients ? "; qgZ: gradients reduced by an all-to-all of block-wise int" +
                                         std::to_string(options.quantized_gradient_bits)
                                   : "") +
      (options.loco ? " with LoCo error feedback (err_beta " +
                          std::to_string(options.loco_err_beta).substr(0, 4) + ")"
                    : "");
  if (hpz_size > 1 && hpz_size < dp) {
    return "; hpZ: the backward gathers inside groups of " + std::to_string(hpz_size) +
           " ranks from secondary shards" + quantized;
  }
  if (shard_size <= 0 || shard_size >= dp) return quantized;
  return "; hybrid sharding: ZeRO shards over groups of " + std::to_string(shard_size) +
         " ranks, " + std::to_string(dp / shard_size) + " replicas" + quantized;
}

// " (MoE: 4 experts, top-2, 1 block in 2, ep 2)" for a mixture-of-experts config (", each
// expert over tp 2", or ", whole experts over tp 2", added with tensor parallelism), else empty.
std::string moe_note(const Config& cfg) {
  if (!cfg.moe.active()) return {};
  const std::int64_t tp = cfg.tensor_parallel.tp_size;
  const bool whole = nn::expert_tensor_parallel_of(cfg.moe.expert_tensor_parallel_size, tp) ==
                     nn::ExpertTensorParallel::experts;
  return " (MoE: " + std::to_string(cfg.moe.num_experts) + " experts, top-" +
         std::to_string(cfg.moe.k) + ", 1 block in " + std::to_string(cfg.moe.expert_interval) +
         ", ep " + std::to_string(cfg.moe.ep_size) +
         (tp > 1
              ? (whole ? ", whole experts over tp " : ", each expert over tp ") + std::to_string(tp)
              : std::string()) +
         ")";
}

// The run's checkpoints: --save-dir, --save-every and --resume.
Checkpoints checkpoints_of(const Options& o) {
  return {"train_gpt", o.save_dir, o.resume, o.save_every, o.run.steps};
}

// Trains with pipeline stages (tp x dp x pp ranks; --pp): each step runs the accumulation's
// micro-batches through the schedule. Rank 0 prints; the loss and the closing sample's logits
// come from the last stage.
// Returns whether the loss fell.
template <class E, class Comm>
bool train_pipeline(const Options& o, const Config& cfg, const Corpus& corpus, Comm& comm) {
  using Pipe = parallel::pipeline::pipeline_engine_of_t<E>;
  const bool leader = comm.rank() == 0;
  const auto tp = static_cast<int>(cfg.tensor_parallel.tp_size);
  const auto pp = static_cast<int>(cfg.pipeline.stages);
  const auto sp = static_cast<int>(cfg.sequence_parallel_size);  // Ulysses, in every stage
  // Experts split over ep ranks in every stage (each stage's MoE blocks exchange tokens over
  // its own ep group), each expert's hidden units over the stage's tp ranks.
  const auto ep = static_cast<int>(cfg.moe.active() ? cfg.moe.ep_size : 1);
  if (sp > 1) parallel::check_sequence_split(o.seq, sp);
  const parallel::Grid grid = parallel::Grid::for_world(comm.size(), tp, sp, ep, pp);
  profile::Monitor monitor(cfg, comm.rank(), cfg.resolve_batch(comm.size() / (tp * pp * sp)).micro);
  if (monitor.logger()) comm.set_logger(monitor.logger());  // before the groups split from comm
  parallel::ProcessGroups<Comm> groups(comm, grid);
  RunSetup<typename E::model_type> run(o, cfg, corpus, groups);
  const int dp = run.dp;
  const auto& sizes = run.sizes;
  const nn::GPTConfig& gc = run.gpt;
  auto& model = run.model;
  parallel::pipeline::PipelineOptions po;
  po.schedule = parallel::pipeline::parse_schedule_kind(cfg.pipeline.schedule);
  po.virtual_stages = static_cast<int>(cfg.pipeline.virtual_stages);
  po.partition_method = cfg.pipeline.partition_method;
  Pipe pipe(model, comm, groups, cfg, po, engine_options(o));
  auto& eng = pipe.engine();
  // Each stage runs its own units: the profiler's reports are gathered from every stage (those
  // of the stages' ranks with rank 0's tp, sp, ep and dp coordinates).
  monitor.collect_stages(
      [&groups](const std::string& s) { return parallel::all_gather_text(groups.pp(), s); });
  const std::int64_t first_step = checkpoints_of(o).resume_into(eng, run.train_loader, leader);
  if (leader) {
    for (const auto& w : pipe.partition().warnings) std::printf("train_gpt: %s\n", w.c_str());
    std::printf(
        "train_gpt: %lld parameters%s (L=%lld, H=%lld, C=%lld, V=%lld, T=%lld), ZeRO stage %d on "
        "%d data-parallel x %d tensor-parallel%s x %d pipeline ranks (%s schedule, units %s); "
        "global batch %lld = %lld micro x %lld accumulation x %d ranks; %lld steps\n",
        static_cast<long long>(count_parameters(model, cfg)), moe_note(cfg).c_str(),
        static_cast<long long>(o.layers), static_cast<long long>(o.heads),
        static_cast<long long>(o.channels), static_cast<long long>(gc.vocab_size),
        static_cast<long long>(o.seq), E::stage, dp, tp,
        sp > 1 ? (" x " + std::to_string(sp) + " Ulysses sequence-parallel").c_str() : "", pp,
        std::string(name_of(po.schedule)).c_str(), pipe.partition().describe().c_str(),
        static_cast<long long>(sizes.train), static_cast<long long>(sizes.micro),
        static_cast<long long>(sizes.accumulation), dp, static_cast<long long>(o.run.steps));
  }
  std::ofstream metrics = open_metrics(o.metrics, leader);
  double first_loss = NAN, loss = NAN;
  StepClock clock;
  std::int64_t since_print = 0;
  for (std::int64_t step = first_step; step < o.run.steps; ++step) {
    std::vector<data::Batch> held;  // the micro-batches' data lives through the step
    std::vector<RankBatch> mine;    // and this rank's positions of them (Ulysses)
    std::vector<engine::MicroBatch> batches;
    for (std::int64_t m = 0; m < sizes.accumulation; ++m) held.push_back(run.train_loader.next());
    mine.reserve(held.size());
    for (const auto& b : held)
      batches.push_back(mine.emplace_back(b, model.sequence_parallel()).micro());
    model.reset_moe_window_stats();
    monitor.begin_step(eng, step + 1);
    const auto r = pipe.train_batch(batches);
    const nlohmann::json observed = monitor.end_step(eng, pipe.stage_model(), step + 1);
    // A collective over the stages and the data-parallel ranks: only a MoE model pays it.
    const RoutingTotals routing =
        cfg.moe.active()
            ? RoutingTotals::of_window(model, sizes.accumulation).over_ranks(eng, &groups.pp())
            : RoutingTotals{};
    if (metrics.is_open() && observed.contains("flops_profile")) {
      metrics << nlohmann::json{{"step", step + 1},
                                {"flops_profile", observed["flops_profile"]},
                                {"flops_profile_stages", observed["flops_profile_stages"]}}
                     .dump()
              << "\n";
    }
    loss = mean_over_dp(eng, r.loss);
    if (std::isnan(first_loss)) first_loss = loss;
    ++since_print;
    const bool print_due = (step + 1) % cfg.steps_per_print == 0 || step + 1 == o.run.steps;
    // Each stage holds its own units' states: the line shows the largest (a max over the
    // pipeline group, which every rank joins when a line is due).
    double state_bytes = 0;
    if (print_due) {
      state_bytes = static_cast<double>(eng.memory_report().total());
      groups.pp().all_reduce(std::span<double>(&state_bytes, 1), parallel::ReduceOp::max);
    }
    if (leader && print_due) {
      const auto [tokens_per_s, ms] = clock.lap(since_print, sizes.train * o.seq);
      std::printf(
          "step %4lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tokens/s | %.1f ms/step | "
          "bubble %.2f | largest stage state %.2f MB%s%s\n",
          static_cast<long long>(step + 1), loss, eng.lr(), eng.last_grad_norm(), tokens_per_s, ms,
          r.bubble_fraction, state_bytes / 1e6, routing.line().c_str(),
          eng.last_step_skipped() ? " | skipped" : "");
      std::fflush(stdout);
      since_print = 0;
      if (metrics.is_open()) {
        nlohmann::json line = metrics_line(eng, step + 1, loss, tokens_per_s, ms, observed);
        line["bubble"] = r.bubble_fraction;
        if (cfg.moe.active()) {
          line["moe_aux_loss"] = routing.aux_loss;
          line["moe_dropped_fraction"] = routing.dropped_fraction();
        }
        metrics << line.dump() << "\n" << std::flush;
      }
    }
    checkpoints_of(o).save_if_due(eng, run.train_loader, step + 1, leader);
  }
  monitor.finish();
  const data::Batch val = run.val_loader.next();
  const RankBatch val_mine(val, model.sequence_parallel());
  const double val_loss = mean_over_dp(eng, pipe.evaluate(val_mine.micro()));
  if (leader) print_losses(first_loss, loss, corpus.vocab, corpus.val_held_out, val_loss);
  if (sp > 1) {  // the sampler would need the last position's logits from the last sp rank
    if (leader) std::printf("train_gpt: no sample with Ulysses sequence parallelism\n");
    return loss < first_loss || first_step > 0;
  }
  // Every rank runs the pipelined forward; the last stage holds the logits and draws the byte,
  // which the pipeline group then shares.
  print_sample(o, corpus, leader, model.tensor_parallel().sequence_parallel() ? tp : 1,
               [&](const engine::MicroBatch& window, std::int64_t row, nn::Sampler& sampler) {
                 (void)pipe.evaluate(window);
                 std::int32_t next = 0;
                 if (pipe.holds_last_unit()) {
                   next = sampler.next(std::span<const float>(
                       last_row_logits<false>(model, row, sample_vocab(corpus))));
                 }
                 groups.pp().broadcast(std::span<std::int32_t>(&next, 1), pp - 1);
                 return next;
               });
  return loss < first_loss || first_step > 0;
}

// --init and --export read and write GPT-2's tensors; what this run cannot map onto them is
// refused before it trains (the pipeline path dropped both flags without a word, and a MoE
// model's export failed only after the whole run).
void check_gpt2_weight_files(const Options& o, const Config& cfg) {
  if (o.init.empty() && o.export_path.empty()) return;
  const char* flags = !o.init.empty() && !o.export_path.empty() ? "--init and --export"
                      : !o.init.empty()                         ? "--init"
                                                                : "--export";
  expect<ConfigError>(cfg.pipeline.stages <= 1, flags,
                      " with pipeline parallelism (pipeline.stages = ", cfg.pipeline.stages,
                      ") is not supported: a stage holds only its own layers; save a checkpoint "
                      "(--save-dir) and convert it with zero_to_safetensors");
  expect<ConfigError>(!cfg.moe.active(), flags,
                      " reads and writes GPT-2 weights; a mixture-of-experts model is not GPT-2 "
                      "(save a checkpoint and convert it with zero_to_safetensors)");
  // A vocabulary padded for tensor parallelism is no obstacle: the files hold the real tokens'
  // rows (load_gpt2_weights and save_gpt2_weights take the vocabulary).
}

// Trains with engine type E on comm (tp x dp ranks); rank 0 prints. Returns whether the loss
// fell.
template <class E, class Comm>
bool train(const Options& o, const Config& cfg, const Corpus& corpus, Comm& comm) {
  constexpr bool on_device = E::backend_type::Device::kind != DeviceKind::host;
  const bool leader = comm.rank() == 0;
  const auto tp = static_cast<int>(cfg.tensor_parallel.tp_size);
  check_gpt2_weight_files(o, cfg);
  if (cfg.pipeline.stages > 1) {
    if constexpr (E::stage <= 1 && !on_device) {
      return train_pipeline<E>(o, cfg, corpus, comm);
    } else {
      throw ConfigError("pipeline.stages > 1 needs ZeRO stage 0 or 1");  // the config refuses it
    }
  }
  const auto sp = static_cast<int>(cfg.sequence_parallel_size);
  const auto ep = static_cast<int>(cfg.moe.active() ? cfg.moe.ep_size : 1);
  expect<ConfigError>(comm.size() % (tp * sp * ep) == 0, "tensor_parallel.tp_size = ", tp,
                      ", sequence_parallel_size = ", sp, " and moe.ep_size = ", ep,
                      " do not divide the ", comm.size(), " ranks");
  if (sp > 1) parallel::check_sequence_split(o.seq, sp);
  profile::Monitor monitor(cfg, comm.rank(), cfg.resolve_batch(comm.size() / (tp * sp)).micro);
  if (monitor.logger()) comm.set_logger(monitor.logger());  // before the groups split from comm
  parallel::ProcessGroups<Comm> groups(
      comm, parallel::Grid({.tp = tp, .cp = sp, .ep = ep, .dp = comm.size() / (tp * sp * ep)}));
  RunSetup<typename E::model_type> run(o, cfg, corpus, groups);
  const int dp = run.dp;
  const auto& sizes = run.sizes;
  const nn::GPTConfig& gc = run.gpt;
  auto& model = run.model;
  E eng(model, groups, cfg, engine_options(o));
  // The embedding may be padded past the vocabulary (tensor parallelism): the file holds the
  // real tokens' rows.
  if (!o.init.empty()) engine::load_gpt2_weights(eng, o.init, corpus.vocab);
  const std::int64_t first_step = checkpoints_of(o).resume_into(eng, run.train_loader, leader);
  const auto mem = eng.memory_report();
  if (leader) {
    std::printf(
        "train_gpt: %lld parameters%s (L=%lld, H=%lld, C=%lld, V=%lld, T=%lld), ZeRO stage %d on "
        "%d data-parallel ranks x %d tensor-parallel%s%s in %s; global batch %lld = %lld micro x "
        "%lld accumulation x %d ranks; %lld steps; model state on rank 0: %.2f MB%s\n",
        static_cast<long long>(count_parameters(model, cfg)), moe_note(cfg).c_str(),
        static_cast<long long>(o.layers), static_cast<long long>(o.heads),
        static_cast<long long>(o.channels), static_cast<long long>(gc.vocab_size),
        static_cast<long long>(o.seq), E::stage, dp, tp,
        model.tensor_parallel().sequence_parallel() ? " (sequence parallel)" : "",
        sp > 1 ? (" x " + std::to_string(sp) + " Ulysses sequence-parallel").c_str() : "",
        std::string(name_of(dtype_of<typename E::T>)).c_str(), static_cast<long long>(sizes.train),
        static_cast<long long>(sizes.micro), static_cast<long long>(sizes.accumulation), dp,
        static_cast<long long>(o.run.steps), static_cast<double>(mem.total()) / 1e6,
        shard_note(eng.options(), eng.comm().size()).c_str());
  }
  std::ofstream metrics = open_metrics(o.metrics, leader);
  // The model's FLOPs per token, and the peak they are measured against: the GPUs' on a device
  // (tokens/s and TFLOP/s count every rank's tokens, so MFU divides by every GPU's peak).
  const double flops_per_token = profile::gpt_flops_per_token(
      static_cast<std::int64_t>(count_parameters(model, cfg, /*active=*/true)), o.layers,
      o.channels, o.seq);
  const int gpus = on_device ? gpus_of(comm) : 1;
  const double peak_tflops = on_device ? device_peak_tflops() * gpus : 0.0;

  StepLines lines(leader, o.run.steps, cfg.steps_per_print, sizes.train * o.seq, flops_per_token,
                  peak_tflops, metrics);
  double first_loss = NAN, loss = NAN;
  for (std::int64_t step = first_step; step < o.run.steps; ++step) {
    double step_loss = 0;
    model.reset_moe_window_stats();
    monitor.begin_step(eng, step + 1);
    for (std::int64_t m = 0; m < sizes.accumulation; ++m) {
      const data::Batch batch = run.train_loader.next();  // backward reads its targets too
      const RankBatch mine(batch, model.sequence_parallel());
      step_loss += static_cast<double>(static_cast<float>(eng.forward(mine.micro())));
      eng.backward();
    }
    const RoutingTotals routed = RoutingTotals::of_window(model, sizes.accumulation);
    eng.step();
    const nlohmann::json observed = monitor.end_step(eng, model, step + 1);
    if (metrics.is_open() && observed.contains("flops_profile")) {
      metrics
          << nlohmann::json{{"step", step + 1}, {"flops_profile", observed["flops_profile"]}}.dump()
          << "\n";
    }
    loss = mean_over_dp(eng, step_loss / static_cast<double>(sizes.accumulation));
    // A collective: only a model with MoE layers pays it.
    const RoutingTotals routing = cfg.moe.active() ? routed.over_ranks(eng) : routed;
    if (std::isnan(first_loss)) first_loss = loss;
    lines.after_step(eng, step + 1, loss, routing.line(), observed, [&](nlohmann::json& line) {
      if (cfg.moe.active()) {
        line["moe_aux_loss"] = routing.aux_loss;
        line["moe_dropped_fraction"] = routing.dropped_fraction();
      }
    });
    checkpoints_of(o).save_if_due(eng, run.train_loader, step + 1, leader);
  }
  if (!o.export_path.empty()) {
    const auto written =
        engine::save_gpt2_weights(eng, o.export_path, o.export_dtype, corpus.vocab,
                                  static_cast<std::uint64_t>(o.export_shard_bytes));
    if (leader) {
      std::printf("train_gpt: exported %zu tensors to %s (%.1f MB, %s, %zu file%s)\n",
                  written.tensors, o.export_path.c_str(), static_cast<double>(written.bytes) / 1e6,
                  std::string(name_of(o.export_dtype)).c_str(), written.files,
                  written.files == 1 ? "" : "s: shards and an index");
    }
  }
  monitor.finish();
  const data::Batch val = run.val_loader.next();
  const RankBatch val_mine(val, model.sequence_parallel());
  const double val_loss =
      mean_over_dp(eng, static_cast<double>(static_cast<float>(eng.evaluate(val_mine.micro()))));
  if (leader) print_losses(first_loss, loss, corpus.vocab, corpus.val_held_out, val_loss);
  if (sp > 1) {  // the sampler would need the last position's logits from the last sp rank
    if (leader) std::printf("train_gpt: no sample with Ulysses sequence parallelism\n");
    return loss < first_loss || first_step > 0;
  }

  // Every rank takes part: the stage-3 forward gathers units collectively; every rank draws the
  // same numbers from the same logits, so all pick the same bytes.
  print_sample(o, corpus, leader, model.tensor_parallel().sequence_parallel() ? tp : 1,
               [&](const engine::MicroBatch& window, std::int64_t row, nn::Sampler& sampler) {
                 eng.evaluate(window);
                 return sampler.next(std::span<const float>(
                     last_row_logits<on_device>(model, row, sample_vocab(corpus))));
               });
  return loss < first_loss || first_step > 0;
}

// Fills "auto" for this world size, says once (rank 0) what it chose and which keys have no
// effect, then trains with the engine the config names (stage, f32 or bf16, offload): on the
// host, or with Device = Cuda on the GPU (bf16, data parallel only).
template <class Device, class Comm>
bool run(const Options& o, const Config& parsed, const Corpus& corpus, Comm& comm) {
  Config cfg = parsed;
  const auto tp = std::max<std::int64_t>(1, cfg.tensor_parallel.tp_size);
  const auto pp = std::max<std::int64_t>(1, cfg.pipeline.stages);
  // The ranks that read different samples: sequence-parallel ranks share theirs.
  const auto sp = std::max<std::int64_t>(1, cfg.sequence_parallel_size);
  expect<ConfigError>(comm.size() % (tp * pp * sp) == 0, "tensor_parallel.tp_size = ", tp,
                      ", pipeline.stages = ", pp, " and sequence_parallel_size = ", sp,
                      " do not divide the ", comm.size(), " ranks");
  const auto chosen =
      fill_auto(o.run, cfg, o.channels, static_cast<int>(comm.size() / (tp * pp * sp)));  // dp
  if (comm.rank() == 0) {
    print_config_notes("train_gpt", cfg, chosen);
    if (engine::offload_cpu_already_host<None, Device>(cfg)) {
      std::printf("train_gpt: config: %s\n", engine::host_offload_note().c_str());
    }
    std::fflush(stdout);
  }
  if constexpr (std::is_same_v<Device, Host>) {
    return zero::dispatch<nn::GPT, Precisions<float, bf16>>(
        cfg, [&]<class E>(std::type_identity<E>) { return train<E>(o, cfg, corpus, comm); });
  } else {
    expect<ConfigError>(tp == 1 && pp == 1 && cfg.sequence_parallel_size <= 1 && !cfg.moe.active(),
                        "train_gpt --device cuda trains data-parallel GPT (ZeRO stages 0-3): "
                        "tensor, pipeline, sequence and expert parallelism run on the host "
                        "(--device host)");
    expect<ConfigError>(!cfg.fp16.enabled.value_or(false) && cfg.bf16_enabled.value_or(true),
                        "train_gpt --device cuda trains in bf16 (--precision bf16, or the "
                        "config's \"bf16\": {\"enabled\": true})");
    return zero::dispatch<nn::GPT, Precisions<bf16>, Compute<Device>>(
        cfg, [&]<class E>(std::type_identity<E>) { return train<E>(o, cfg, corpus, comm); });
  }
}

}  // namespace
}  // namespace zero::train_gpt

int main(int argc, char** argv) try {
  using namespace zero;
  using namespace zero::train_gpt;
  const Options o = parse(argc, argv);
  const Config cfg = make_config(o);
  const Corpus corpus = load_corpus(o);
#if defined(ZERO_TRAIN_GPT_CUDA)
  expect<ConfigError>(o.device == "cuda",
                      "train_gpt_cuda trains on the GPU (--device cuda, its default); train_gpt "
                      "trains on the host");
  using Device = Cuda;
  const char* program = "train_gpt_cuda";
#else
  expect<ConfigError>(o.device == "host",
                      "--device cuda: this train_gpt was built without CUDA; build the "
                      "train_gpt_cuda target (configured when CMake finds nvcc) and run that");
  using Device = Host;
  const char* program = "train_gpt";
#endif
  const bool improved =
      examples::run_ranks<Device>(argc, argv, o.ranks, cfg.comm_timeout_s, program,
                                  [&](auto& comm) { return run<Device>(o, cfg, corpus, comm); });
  // Exit 1 says so in words too: CTest ignores the exit code of a test with a pass regex, so
  // those tests fail on these lines (FAIL_REGULAR_EXPRESSION) instead.
  if (!improved) std::fprintf(stderr, "train_gpt: FAILED: the training loss did not fall\n");
  return improved ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\ntrain_gpt: FAILED: an error stopped the run\n", e.what());
  return 1;
}
