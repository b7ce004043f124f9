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
//               [--device host|cuda] [--offload-cpu [--delayed-update N] [--grads-on-device]]
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
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <parallel/comm/local_comm.hpp>
#include <parallel/comm/text_collectives.hpp>
#include <parallel/launch_env.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#if defined(ZERO_WITH_MPI)
#include <parallel/comm/mpi_comm.hpp>
#endif
#if defined(ZERO_TRAIN_GPT_CUDA)
#include <cuda_runtime.h>

#include <parallel/comm/cuda_local_comm.cuh>
#include <zero/core/cuda_check.cuh>
#if defined(ZERO_WITH_NCCL) && defined(ZERO_WITH_MPI)
#include <parallel/comm/nccl_comm.cuh>
#endif
#endif
#include <zero/config/auto_values.hpp>
#include <zero/data/byte_tokenizer.hpp>
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

// Inside zero (rather than `using namespace zero` at file scope): a using-directive that reaches
// the global scope makes `cuda` ambiguous (zero::cuda, CCCL's ::cuda) in the stubs nvcc generates
// for CUB's kernels when train_gpt_cuda compiles this file.
namespace zero::train_gpt {
namespace {

struct Options {
  std::string config;
  int ranks = 2;
  std::optional<int> stage;
  std::optional<int> shard_size;     // hybrid sharding (default: the config's mics_shard_size)
  bool quantized_weights = false;    // ZeRO++ qwZ (or the config's zero_quantized_weights)
  bool quantized_gradients = false;  // ZeRO++ qgZ (or the config's zero_quantized_gradients)
  std::optional<int> quantized_gradient_bits;  // qgZ's 8 or 4 (zero_quantized_gradient_bits)
  std::optional<double> loco_err_beta;         // LoCo (zeropp_loco_param.err_beta)
  std::optional<int> hpz_size;        // ZeRO++ hpZ (default: the config's zero_hpz_partition_size)
  std::optional<int> tp;              // tensor-parallel size (default: the config's, else 1)
  bool sp = false;                    // Megatron sequence parallelism (with --tp)
  std::optional<int> ulysses;         // Ulysses sequence-parallel size (--sp N)
  std::optional<int> experts, ep, k;  // MoE: experts per layer, expert-parallel size, top-k
  std::optional<int> etp;             // MoE: expert tensor-parallel size (1 or tp)
  std::optional<int> pp, vpp;  // pipeline stages and chunks per stage (default: the config's)
  std::string schedule;        // pipeline schedule (default: the config's, else 1f1b)
  std::int64_t steps = 100, batch = 8, seq = 64, layers = 4, heads = 4, channels = 128;
  std::int64_t grad_accum = 1;
  std::optional<std::int64_t> warmup;
  std::string precision;  // f32 or bf16; empty: the config's, else f32
  std::optional<double> lr;
  std::uint64_t seed = 1234;
  std::optional<std::int64_t> print_every;  // steps_per_print; 10 in the built-in config
  std::string data = ZERO_DEFAULT_CORPUS, tokens, val_tokens, init, metrics, save_dir, resume,
              export_path;
  DType export_dtype = DType::f32;
  std::int64_t export_shard_bytes = 0;                       // 0: one file
  data::TokenFormat token_format = data::TokenFormat::llmc;  // of --tokens and --val-tokens
  std::optional<std::int64_t> vocab;  // the --tokens files' vocabulary (default: GPT-2's 50257)
  std::string nvme_path;
  std::int64_t save_every = 0;
  double temperature = 0.8;
  int top_k = 40;
  std::int64_t sample_bytes = 96;
  bool profile = false;
  bool offload_cpu = false;  // ZeRO-Offload on the GPU (--offload-cpu)
#if defined(ZERO_TRAIN_GPT_CUDA)
  std::string device = "cuda";  // the train_gpt_cuda build trains on the GPU
#else
  std::string device = "host";
#endif
  std::int64_t activation_mb = 512;
  std::optional<std::int64_t> delayed_update;  // DPU after this many steps (--delayed-update)
  bool grads_on_device = false;                // --grads-on-device
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "train_gpt: %s (see the comment at the top of train_gpt.cpp)\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    const bool sp_size = flag == "--sp" && i + 1 < argc && argv[i + 1][0] >= '0' &&
                         argv[i + 1][0] <= '9';  // --sp N: Ulysses
    if (flag == "--profile" || flag == "--offload-cpu" || flag == "--grads-on-device" ||
        flag == "--quantized-weights" || flag == "--quantized-gradients" ||
        (flag == "--sp" && !sp_size)) {  // no value
      (flag == "--sp"                    ? o.sp
       : flag == "--offload-cpu"         ? o.offload_cpu
       : flag == "--grads-on-device"     ? o.grads_on_device
       : flag == "--quantized-weights"   ? o.quantized_weights
       : flag == "--quantized-gradients" ? o.quantized_gradients
                                         : o.profile) = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[i + 1];
    // Numbers are read whole and in range (examples/cli_number.hpp); a bad one ends in usage().
    auto read = [&](auto parse) {
      try {
        return parse();
      } catch (const zero::ConfigError& e) {
        usage(e.what());
      }
    };
    auto integer = [&](std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
      return read([&] { return zero::examples::parse_integer(flag, v, min, max); });
    };
    auto positive = [&] { return integer(1, std::numeric_limits<int>::max()); };  // a count
    auto real = [&] { return read([&] { return zero::examples::parse_real(flag, v); }); };
    if (flag == "--config")
      o.config = v;
    else if (flag == "--ranks")
      o.ranks = static_cast<int>(positive());
    else if (flag == "--stage")
      o.stage = static_cast<int>(integer(0, 3));
    else if (flag == "--shard-size")
      o.shard_size = static_cast<int>(positive());
    else if (flag == "--hpz-size")
      o.hpz_size = static_cast<int>(positive());
    else if (flag == "--quantized-gradient-bits")
      o.quantized_gradient_bits = static_cast<int>(integer(4, 8));
    else if (flag == "--loco-err-beta")
      o.loco_err_beta = real();
    else if (flag == "--tp")
      o.tp = static_cast<int>(positive());
    else if (flag == "--sp")
      o.ulysses = static_cast<int>(positive());
    else if (flag == "--experts")
      o.experts = static_cast<int>(positive());
    else if (flag == "--ep")
      o.ep = static_cast<int>(positive());
    else if (flag == "--etp")
      o.etp = static_cast<int>(positive());
    else if (flag == "--k")
      o.k = static_cast<int>(positive());
    else if (flag == "--pp")
      o.pp = static_cast<int>(positive());
    else if (flag == "--vpp")
      o.vpp = static_cast<int>(positive());
    else if (flag == "--schedule")
      o.schedule = v;
    else if (flag == "--steps")
      o.steps = integer();
    else if (flag == "--batch")
      o.batch = positive();
    else if (flag == "--seq")
      o.seq = positive();
    else if (flag == "--grad-accum")
      o.grad_accum = positive();
    else if (flag == "--warmup")
      o.warmup = positive();
    else if (flag == "--precision") {
      if (v != "f32" && v != "bf16") usage("--precision must be f32 or bf16, not '" + v + "'");
      o.precision = v;
    } else if (flag == "--layers")
      o.layers = positive();
    else if (flag == "--heads")
      o.heads = positive();
    else if (flag == "--channels")
      o.channels = positive();
    else if (flag == "--lr")
      o.lr = real();
    else if (flag == "--seed")
      o.seed = static_cast<std::uint64_t>(integer(0));  // -1 became 2^64 - 1
    else if (flag == "--print-every")
      o.print_every = positive();  // 0 and -5 became 1
    else if (flag == "--data")
      o.data = v;
    else if (flag == "--tokens")
      o.tokens = v;
    else if (flag == "--val-tokens")
      o.val_tokens = v;
    else if (flag == "--vocab")
      o.vocab = positive();
    else if (flag == "--init")
      o.init = v;
    else if (flag == "--metrics")
      o.metrics = v;
    else if (flag == "--save-dir")
      o.save_dir = v;
    else if (flag == "--save-every")
      o.save_every = positive();  // -2 never saved
    else if (flag == "--export")
      o.export_path = v;
    else if (flag == "--export-shard-bytes")
      o.export_shard_bytes = integer(0);
    else if (flag == "--temperature")
      o.temperature = real();
    else if (flag == "--top-k")
      o.top_k = static_cast<int>(integer(0, std::numeric_limits<int>::max()));
    else if (flag == "--sample-bytes")
      o.sample_bytes = integer();
    else if (flag == "--nvme-path")
      o.nvme_path = v;
    else if (flag == "--token-format") {
      if (v == "llmc")
        o.token_format = data::TokenFormat::llmc;
      else if (v == "raw_u16")
        o.token_format = data::TokenFormat::raw_u16;
      else if (v == "raw_i32")
        o.token_format = data::TokenFormat::raw_i32;
      else
        usage("--token-format must be llmc, raw_u16 or raw_i32, not '" + v + "'");
    } else if (flag == "--export-dtype") {
      if (v == "f32")
        o.export_dtype = DType::f32;
      else if (v == "bf16")
        o.export_dtype = DType::bf16;
      else if (v == "f16")
        o.export_dtype = DType::f16;
      else
        usage("--export-dtype must be f32, bf16 or f16, not '" + v + "'");
    } else if (flag == "--resume")
      o.resume = v;
    else if (flag == "--device") {
      if (v != "host" && v != "cuda") usage("--device must be host or cuda, not '" + v + "'");
      o.device = v;
    } else if (flag == "--activation-mb")
      o.activation_mb = integer(1, std::int64_t{1} << 40);  // MiB; 2^44 << 20 wrapped to 0
    else if (flag == "--delayed-update")
      o.delayed_update = integer();
    else
      usage("unknown flag " + flag);
  }
  if (o.ranks < 1) usage("--ranks must be >= 1");
  if (o.activation_mb < 1) usage("--activation-mb must be positive");
  if (o.delayed_update && (*o.delayed_update < 0 || o.device != "cuda")) {
    usage(
        "--delayed-update N (N >= 0 warm-up steps) delays the host optimizer of --offload-cpu: "
        "it needs --device cuda");
  }
  // Without offload (from --offload-cpu or the config) or at stage 1 the engine refuses it.
  if (o.grads_on_device && o.device != "cuda") {
    usage(
        "--grads-on-device sums the offloaded gradient shards on the GPU: it needs --device cuda");
  }
  if (o.steps < 0 || o.batch < 1 || o.seq < 1 || o.grad_accum < 1) {
    usage("--steps, --batch, --seq and --grad-accum must be positive");
  }
  if (!(o.temperature >= 0) || o.top_k < 0 || o.sample_bytes < 0) {
    usage("--temperature, --top-k and --sample-bytes must be >= 0");
  }
  if ((o.save_every > 0 || !o.resume.empty()) && o.save_dir.empty()) {
    usage("--save-every and --resume need --save-dir");
  }
  if (o.token_format != data::TokenFormat::llmc && o.tokens.empty()) {
    usage("--token-format says how the --tokens file is stored");
  }
  if (o.vocab && o.tokens.empty()) {
    usage("--vocab is the vocabulary of the --tokens files (a --data text is byte tokens, 257)");
  }
  if (!o.val_tokens.empty() && o.tokens.empty()) {
    usage("--val-tokens is the validation file beside --tokens (a --data text is split itself)");
  }
  return o;
}

// The built-in DeepSpeed config (what a user would write for this small run) or --config's, with
// the flags that override keys written into the JSON before it is parsed, so the notices about
// keys without effect describe the config that runs.
Config make_config(const Options& o) {
  nlohmann::json j = {
      {"train_batch_size", o.batch},
      {"gradient_clipping", 1.0},
      {"steps_per_print", o.print_every.value_or(10)},
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", o.lr.value_or(1e-3)}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.0}}}}},
      {"scheduler",
       {{"type", "WarmupCosineLR"},
        {"params",
         {{"total_num_steps", std::max<std::int64_t>(o.steps, 1)},
          {"warmup_num_steps", o.warmup.value_or(std::max<std::int64_t>(1, o.steps / 10))},
          {"cos_min_ratio", 0.1}}}}},
      {"zero_optimization", {{"stage", o.stage.value_or(o.pp.value_or(1) > 1 ? 1 : 3)}}}};
  if (o.precision == "bf16") j["bf16"] = {{"enabled", true}};
  // The pipeline's micro-batches per step (and plain accumulation) in the built-in config.
  if (o.grad_accum > 1) j["gradient_accumulation_steps"] = o.grad_accum;
  if (o.shard_size) j["zero_optimization"]["mics_shard_size"] = *o.shard_size;
  if (o.hpz_size) j["zero_optimization"]["zero_hpz_partition_size"] = *o.hpz_size;
  if (o.quantized_weights) j["zero_optimization"]["zero_quantized_weights"] = true;
  if (o.quantized_gradients) j["zero_optimization"]["zero_quantized_gradients"] = true;
  if (o.quantized_gradient_bits) {
    j["zero_optimization"]["zero_quantized_gradient_bits"] = *o.quantized_gradient_bits;
  }
  if (o.loco_err_beta) j["zero_optimization"]["zeropp_loco_param"]["err_beta"] = *o.loco_err_beta;
  if (!o.config.empty()) {
    std::ifstream in(o.config);
    if (!in.good()) throw ConfigError("config: cannot open '" + o.config + "'");
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError(o.config + ": invalid JSON: " + e.what());
    }
    if (!j.is_object()) return Config::from_json(j);  // the parser names the problem
    if (o.stage) j["zero_optimization"]["stage"] = *o.stage;
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
    if (o.print_every) j["steps_per_print"] = *o.print_every;
    // A flag overrides the file's value; an "auto" value takes the flag anyway (fill_auto).
    const auto overrides = [&](const char* path) {
      const auto* v = config::json_at(j, path);
      return v != nullptr && !(v->is_string() && v->get<std::string>() == "auto");
    };
    // --lr and --warmup set the file's keys whether it gives them or leaves them to their
    // defaults (a file without optimizer.params.lr trained at 1e-3 under --lr 3e-4); a file
    // without the section they belong to is an error, not a flag without effect.
    const auto given_or_default = [&](const char* path) {
      const auto* v = config::json_at(j, path);
      return v == nullptr || !(v->is_string() && v->get<std::string>() == "auto");
    };
    const std::string scheduler = j.contains("scheduler") && j["scheduler"].is_object() &&
                                          j["scheduler"].contains("type") &&
                                          j["scheduler"]["type"].is_string()
                                      ? config::lowercase(j["scheduler"]["type"].get<std::string>())
                                      : "";
    const bool warms_to_own_peak = scheduler == "warmuplr" || scheduler == "warmupdecaylr";
    const bool has_warmup = warms_to_own_peak || scheduler == "warmupcosinelr";
    if (o.lr) {
      expect<ConfigError>(j.contains("optimizer") && j["optimizer"].is_object(), "--lr: ", o.config,
                          " has no optimizer section to set it in");
      if (given_or_default("optimizer.params.lr")) j["optimizer"]["params"]["lr"] = *o.lr;
      // WarmupLR and WarmupDecayLR ramp to warmup_max_lr, not to the optimizer's lr.
      if (warms_to_own_peak && given_or_default("scheduler.params.warmup_max_lr")) {
        j["scheduler"]["params"]["warmup_max_lr"] = *o.lr;
      }
    }
    if (o.warmup) {
      expect<ConfigError>(has_warmup, "--warmup: ", o.config,
                          scheduler.empty()
                              ? std::string(" has no scheduler")
                              : " has scheduler type " + j["scheduler"]["type"].get<std::string>() +
                                    ", which has no warmup_num_steps",
                          " (WarmupLR, WarmupDecayLR and WarmupCosineLR have one)");
      if (given_or_default("scheduler.params.warmup_num_steps")) {
        j["scheduler"]["params"]["warmup_num_steps"] = *o.warmup;
      }
    }
    if (!o.precision.empty()) {  // the flag's precision, whatever the file enables
      const bool bf16 = o.precision == "bf16";
      if (bf16 || overrides("bf16.enabled")) j["bf16"]["enabled"] = bf16;
      if (overrides("bfloat16.enabled")) j["bfloat16"]["enabled"] = bf16;
      if (overrides("fp16.enabled")) j["fp16"]["enabled"] = false;
    }
  }
  if (o.offload_cpu) j["zero_optimization"]["offload_optimizer"]["device"] = "cpu";
  if (!o.nvme_path.empty()) {
    j["zero_optimization"]["offload_optimizer"]["device"] = "nvme";
    j["zero_optimization"]["offload_optimizer"]["nvme_path"] = o.nvme_path;
  }
  if (o.experts) j["moe"]["num_experts"] = *o.experts;
  if (o.ep) j["moe"]["ep_size"] = *o.ep;
  if (o.etp) j["moe"]["expert_tensor_parallel_size"] = *o.etp;
  if (o.k) j["moe"]["k"] = *o.k;
  if (o.ulysses) j["sequence_parallel_size"] = *o.ulysses;
  Config c;
  try {
    c = Config::from_json(j);
  } catch (const ConfigError& e) {
    if (o.config.empty()) throw;
    throw ConfigError(o.config + ": " + e.what());
  }
  if (o.pp || o.vpp || !o.schedule.empty()) {  // re-read so the pipeline checks see the flags
    nlohmann::json with = j;
    if (o.pp) with["pipeline"]["stages"] = *o.pp;
    if (o.vpp) with["pipeline"]["virtual_stages"] = *o.vpp;
    if (!o.schedule.empty()) with["pipeline"]["schedule"] = o.schedule;
    c = Config::from_json(with);
  }
  if (o.tp) c.tensor_parallel.tp_size = *o.tp;
  // Megatron's sequence parallelism splits the tensor-parallel regions: at tp 1 it does nothing.
  expect<ConfigError>(!o.sp || c.tensor_parallel.tp_size > 1,
                      "--sp without a size is Megatron's sequence parallelism, which needs tensor "
                      "parallelism (--tp 2 or more); --sp N is Ulysses over N ranks");
  if (o.sp) c.tensor_parallel.sequence_parallel = true;
  if (o.profile) {
    c.flops_profiler.enabled = true;
    // The second step (past the warm-up), or the only one.
    c.flops_profiler.profile_step =
        std::min<std::int64_t>(1, std::max<std::int64_t>(o.steps - 1, 0));
    c.wall_clock_breakdown = true;
    c.memory_breakdown = true;
    c.comms_logger.enabled = true;
  }
  return c;
}

// Fills the config's "auto" values from the flags and defaults (as the HF Trainer does) for dp
// ranks; returns what it chose.
std::vector<std::string> fill_auto(const Options& o, Config& c, int dp) {
  config::AutoValues v;
  v.train_batch_size = o.batch;
  v.gradient_accumulation = o.grad_accum;
  v.lr = o.lr.value_or(1e-3);
  v.betas = {0.9, 0.95};
  v.weight_decay = 0.0;
  v.gradient_clipping = 1.0;
  v.warmup_steps = o.warmup.value_or(std::max<std::int64_t>(1, o.steps / 10));
  v.total_steps = std::max<std::int64_t>(o.steps, 1);
  v.precision = o.precision == "bf16" ? "bf16" : "fp32";
  v.hidden_size = o.channels;
  return config::fill_auto(c, v, dp);
}

using Clock = std::chrono::steady_clock;

struct Corpus {
  std::shared_ptr<const data::TokenFile> train, val;
  bool val_held_out = true;  // false: val is the training file (--tokens without --val-tokens)
  std::vector<std::int32_t> prompt;  // the start of the validation text, for the sample
  std::int64_t vocab = 257;
};

Corpus load_corpus(const Options& o) {
  Corpus c;
  if (!o.tokens.empty()) {  // token files: --val-tokens, else the training rows
    c.train =
        std::make_shared<const data::TokenFile>(data::TokenFile::open(o.tokens, o.token_format));
    c.val_held_out = !o.val_tokens.empty();
    c.val = c.val_held_out ? std::make_shared<const data::TokenFile>(
                                 data::TokenFile::open(o.val_tokens, o.token_format))
                           : c.train;
    c.vocab = o.vocab.value_or(50257);  // GPT-2's, unless the files are another tokenizer's
    return c;
  }
  // The corpus as byte tokens (256 = end of text), 90% train, 10% validation, held in memory
  // under names that say which split of the text file a loader's message is about.
  data::PreparedText text = data::tokenize_text_file(o.data, 0.1);
  c.prompt.assign(text.val.begin(),
                  text.val.begin() +
                      std::min<std::ptrdiff_t>(16, static_cast<std::ptrdiff_t>(text.val.size())));
  c.train = std::make_shared<const data::TokenFile>(
      data::TokenFile::from_tokens(std::move(text.train), o.data + " (its 90% training split)"));
  c.val = std::make_shared<const data::TokenFile>(
      data::TokenFile::from_tokens(std::move(text.val), o.data + " (its 10% validation split)"));
  return c;
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
        train_loader(corpus.train, loader_config(o, corpus, data_group(groups).rank(), true)),
        val_loader(corpus.val, loader_config(o, corpus, data_group(groups).rank(), false)),
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
  // The training loader reads whole steps (shuffled); the validation loader one micro-batch a
  // rank, all the evaluation reads, so the 10% validation split need not hold a global batch.
  data::LoaderConfig loader_config(const Options& o, const Corpus& corpus, int dp_rank,
                                   bool training) const {
    data::LoaderConfig lc;
    lc.global_batch = training ? sizes.train : sizes.micro * dp;
    lc.seq_len = o.seq;
    lc.world_size = dp;
    lc.rank = dp_rank;
    lc.micro_batches = training ? static_cast<int>(sizes.accumulation) : 1;
    lc.shuffle = training;
    lc.seed = o.seed;
    lc.vocab_size = corpus.vocab;
    return lc;
  }
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

// A loader batch as the engine's micro-batch (views: the batch must outlive its use), with its
// rows' place in the step's global batch, so dropout masks follow the rows.
engine::MicroBatch micro_of(const data::Batch& b) {
  engine::MicroBatch micro{b.inputs.data(), b.targets.data(), b.rows, b.seq_len};
  micro.first_row = b.first_row;
  return micro;
}

// A loader batch as this rank feeds it: the whole batch, or with Ulysses sequence parallelism
// this rank's positions of it (the slice lives as long as the micro-step reads it).
struct RankBatch {
  const data::Batch& batch;
  std::optional<parallel::SequenceSlice> slice;

  RankBatch(const data::Batch& b, const parallel::SequenceParallel& sp) : batch(b) {
    if (sp.active()) slice.emplace(b.inputs.data(), b.targets.data(), b.rows, b.seq_len, sp);
  }
  engine::MicroBatch micro() const {
    if (!slice) return micro_of(batch);
    engine::MicroBatch micro{slice->tokens.data(), slice->targets.data(), slice->batch,
                             slice->seq_len};
    micro.first_row = batch.first_row;  // the same rows, this rank's positions of them
    return micro;
  }
};

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

// v averaged over eng's data-parallel group (through the engine, whose communicator may move
// device memory only).
template <class Eng>
double mean_over_dp(Eng& eng, double v) {
  if constexpr (requires(std::span<double> s) { eng.sum_over_data_parallel(s); }) {
    eng.sum_over_data_parallel(std::span<double>(&v, 1));
    return v / eng.world_size();
  } else {
    eng.comm().all_reduce(std::span<double>(&v, 1), parallel::ReduceOp::avg);
    return v;
  }
}

// Loads --resume into eng and the loader's position; returns the step to start from (0 without).
template <class Eng>
std::int64_t resume_if_asked(const Options& o, Eng& eng, data::DataLoader& loader, bool leader) {
  if (o.resume.empty()) return 0;
  const auto client = eng.load_checkpoint(o.save_dir, o.resume == "latest" ? "" : o.resume);
  const auto first_step = client.at("next_step").template get<std::int64_t>();
  loader.restore(data::LoaderState::from_json(client.at("loader")));
  if (leader) {
    std::printf("train_gpt: resumed from %s/%s at step %lld\n", o.save_dir.c_str(),
                o.resume.c_str(), static_cast<long long>(first_step));
  }
  return first_step;
}

// The --metrics file (appended to) on the leader, or none: ConfigError when it cannot be opened,
// rather than a run that writes nothing.
std::ofstream open_metrics(const Options& o, bool leader) {
  std::ofstream metrics;
  if (leader && !o.metrics.empty()) {
    metrics.open(o.metrics, std::ios::app);
    expect<ConfigError>(metrics.is_open(), "--metrics ", o.metrics, ": cannot open it to append (",
                        std::strerror(errno), ")");
  }
  return metrics;
}

// The --metrics line of a printed step: the figures every run has, and the Monitor's wall-clock
// and memory breakdowns when they were due (observed, end_step's JSON); the caller adds its own.
template <class Eng>
nlohmann::json metrics_line(const Eng& eng, std::int64_t step, double loss, double tokens_per_s,
                            double ms, const nlohmann::json& observed) {
  nlohmann::json line = {{"step", step},
                         {"loss", loss},
                         {"lr", eng.lr()},
                         {"grad_norm", eng.last_grad_norm()},
                         {"loss_scale", eng.loss_scale()},
                         {"tokens_per_s", tokens_per_s},
                         {"ms_per_step", ms},
                         {"model_state_bytes", eng.memory_report().total()},
                         {"skipped", eng.last_step_skipped()}};
  for (const char* key : {"wall_clock", "memory", "wall_clock_stages", "memory_stages"}) {
    if (observed.contains(key)) line[key] = observed[key];
  }
  return line;
}

// Saves a checkpoint after `done` steps when --save-every says so (and after the last step).
template <class Eng>
void save_if_due(const Options& o, Eng& eng, const data::DataLoader& loader, std::int64_t done,
                 bool leader) {
  if (o.save_every <= 0 || (done % o.save_every != 0 && done != o.steps)) return;
  const auto saved =
      eng.save_checkpoint(o.save_dir, "step" + std::to_string(done),
                          {{"next_step", done}, {"loader", loader.state().to_json()}});
  if (leader) {
    std::printf("train_gpt: saved %s (%.1f MB)\n", saved.path.string().c_str(),
                static_cast<double>(saved.total_bytes) / 1e6);
  }
}

// The closing line: the loss at the first and last step beside the uniform guess, and the
// validation loss, or, with no held-out tokens, the loss on the first training rows (which
// training has seen, so it is no validation figure).
void print_losses(double first_loss, double loss, const Corpus& corpus, double val_loss) {
  std::printf("loss %.4f -> %.4f (uniform over %lld tokens: %.4f); %s %.4f\n", first_loss, loss,
              static_cast<long long>(corpus.vocab), std::log(static_cast<double>(corpus.vocab)),
              corpus.val_held_out ? "validation loss" : "loss on training rows (no --val-tokens)",
              val_loss);
}

// The bytes a sample draws from: the byte vocabulary without end-of-text.
std::int64_t sample_vocab(const Corpus& corpus) {
  return std::min<std::int64_t>(corpus.vocab, 256);
}

// Row `row` of the logits of model's last forward, its first `bytes` columns as floats (with
// tensor parallelism each rank holds rows/tp columns of the padded table: they are gathered).
// On a device (no tensor parallelism there) the row is copied out of device memory.
template <bool OnDevice, class Model>
std::vector<float> last_row_logits(const Model& model, const nn::GPTConfig& gc, int tp,
                                   std::int64_t row, std::int64_t bytes) {
  using Elem = typename Model::value_type;
  const std::int64_t local_vocab = gc.vocab_rows() / tp;
  std::vector<Elem> whole(static_cast<std::size_t>(gc.vocab_rows()));
  if constexpr (OnDevice) {
#if defined(ZERO_TRAIN_GPT_CUDA)
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());  // the forward ran on the engine's own stream
    ZERO_CUDA_CHECK(cudaMemcpy(whole.data(), model.logits().data() + row * local_vocab,
                               whole.size() * sizeof(Elem), cudaMemcpyDeviceToHost));
#endif
  } else {
    parallel::region_forward(parallel::Region::gather_from_tp, model.tensor_parallel(),
                             model.logits().data() + row * local_vocab, whole.data(), 1,
                             local_vocab);
  }
  std::vector<float> out(static_cast<std::size_t>(bytes));
  for (std::size_t v = 0; v < out.size(); ++v) out[v] = static_cast<float>(whole[v]);
  return out;
}

// The closing sample: continues the start of the validation text by --sample-bytes bytes, each
// from next(window, row, sampler), which runs the model on the window and returns the byte drawn
// from the logits of its last real row. The window slides once the context fills seq; with
// sequence parallelism (split = tp) it is padded on the right to a multiple of tp (attention is
// causal, so the last real row does not see the padding). Rank 0 prints.
template <class Next>
void print_sample(const Options& o, const Corpus& corpus, bool leader, std::int64_t split,
                  Next&& next) {
  if (corpus.prompt.empty() || o.sample_bytes <= 0) return;
  std::vector<std::int32_t> context = corpus.prompt;
  const std::size_t prompt = context.size();
  nn::Sampler sampler(o.temperature, o.top_k, o.seed);
  for (std::int64_t i = 0; i < o.sample_bytes; ++i) {
    const auto T = std::min<std::int64_t>(static_cast<std::int64_t>(context.size()), o.seq);
    const std::int64_t padded = (T + split - 1) / split * split;
    std::vector<std::int32_t> window(context.end() - T, context.end());
    window.resize(static_cast<std::size_t>(padded), window.back());
    context.push_back(next(engine::MicroBatch{window.data(), nullptr, 1, padded}, T - 1, sampler));
  }
  if (leader) {
    const auto ids = std::span<const std::int32_t>(context);
    std::printf(
        "sample (temperature %g, top-k %d, seed %llu):\n  prompt: %s\n  output: %s\n",
        o.temperature, o.top_k, static_cast<unsigned long long>(o.seed),
        data::ByteTokenizer::escape(data::ByteTokenizer::decode(ids.subspan(1, prompt - 1)))
            .c_str(),
        data::ByteTokenizer::escape(data::ByteTokenizer::decode(ids.subspan(prompt))).c_str());
  }
}

// The datasheet bf16 peak of the GPU the CUDA runtime uses now, in TFLOP/s (0: not listed, or no
// CUDA in this build).
double device_peak_tflops() {
#if defined(ZERO_TRAIN_GPT_CUDA)
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return 0.0;
  }
  return profile::datasheet_bf16_tflops(prop.name);
#else
  return 0.0;
#endif
}

// The pipeline engine with E's model and policies (E = Engine<GPT<T>, Policies...>).
template <class E>
struct pipeline_engine_of;
template <class M, class... Policies>
struct pipeline_engine_of<engine::Engine<M, Policies...>> {
  using type = parallel::pipeline::PipelineEngine<M, Policies...>;
};

// Trains with pipeline stages (tp x dp x pp ranks; --pp): each step runs the accumulation's
// micro-batches through the schedule. Rank 0 prints; the loss and the closing sample's logits
// come from the last stage.
// Returns whether the loss fell.
template <class E, class Comm>
bool train_pipeline(const Options& o, const Config& cfg, const Corpus& corpus, Comm& comm) {
  using Pipe = typename pipeline_engine_of<E>::type;
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
  const std::int64_t first_step = resume_if_asked(o, eng, run.train_loader, leader);
  if (leader) {
    for (const auto& w : pipe.partition().warnings) std::printf("train_gpt: %s\n", w.c_str());
    std::string layout;
    for (const auto& part : pipe.partition().parts) {
      layout += (layout.empty() ? "" : " | ") + std::to_string(part.first) + "-" +
                std::to_string(part.last - 1);
    }
    std::printf(
        "train_gpt: %lld parameters%s (L=%lld, H=%lld, C=%lld, V=%lld, T=%lld), ZeRO stage %d on "
        "%d data-parallel x %d tensor-parallel%s x %d pipeline ranks (%s schedule, units %s); "
        "global batch %lld = %lld micro x %lld accumulation x %d ranks; %lld steps\n",
        static_cast<long long>(count_parameters(model, cfg)), moe_note(cfg).c_str(),
        static_cast<long long>(o.layers), static_cast<long long>(o.heads),
        static_cast<long long>(o.channels), static_cast<long long>(gc.vocab_size),
        static_cast<long long>(o.seq), E::stage, dp, tp,
        sp > 1 ? (" x " + std::to_string(sp) + " Ulysses sequence-parallel").c_str() : "", pp,
        std::string(name_of(po.schedule)).c_str(), layout.c_str(),
        static_cast<long long>(sizes.train), static_cast<long long>(sizes.micro),
        static_cast<long long>(sizes.accumulation), dp, static_cast<long long>(o.steps));
  }
  std::ofstream metrics = open_metrics(o, leader);
  double first_loss = NAN, loss = NAN;
  auto last = Clock::now();
  std::int64_t since_print = 0;
  for (std::int64_t step = first_step; step < o.steps; ++step) {
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
    const bool print_due = (step + 1) % cfg.steps_per_print == 0 || step + 1 == o.steps;
    // Each stage holds its own units' states: the line shows the largest (a max over the
    // pipeline group, which every rank joins when a line is due).
    double state_bytes = 0;
    if (print_due) {
      state_bytes = static_cast<double>(eng.memory_report().total());
      groups.pp().all_reduce(std::span<double>(&state_bytes, 1), parallel::ReduceOp::max);
    }
    if (leader && print_due) {
      const auto now = Clock::now();
      const double seconds = std::chrono::duration<double>(now - last).count();
      last = now;
      const double tokens_per_s = static_cast<double>(since_print * sizes.train * o.seq) / seconds;
      const double ms = 1e3 * seconds / static_cast<double>(since_print);
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
    save_if_due(o, eng, run.train_loader, step + 1, leader);
  }
  monitor.finish();
  const data::Batch val = run.val_loader.next();
  const RankBatch val_mine(val, model.sequence_parallel());
  const double val_loss = mean_over_dp(eng, pipe.evaluate(val_mine.micro()));
  if (leader) print_losses(first_loss, loss, corpus, val_loss);
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
                       last_row_logits<false>(model, gc, tp, row, sample_vocab(corpus))));
                 }
                 groups.pp().broadcast(std::span<std::int32_t>(&next, 1), pp - 1);
                 return next;
               });
  return loss < first_loss || first_step > 0;
}

// The GPUs the ranks of comm compute on, for MFU: CudaLocalComm runs its ranks as threads on one
// GPU; NcclComm, the other device communicator, has one GPU a rank.
template <class Comm>
int gpus_of(const Comm& comm) {
  if constexpr (requires { Comm::comm_name; }) {
    if (std::string_view(Comm::comm_name) == "CudaLocalComm") return 1;
  }
  return comm.size();
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
  const std::int64_t first_step = resume_if_asked(o, eng, run.train_loader, leader);
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
        static_cast<long long>(o.steps), static_cast<double>(mem.total()) / 1e6,
        shard_note(eng.options(), eng.comm().size()).c_str());
  }
  std::ofstream metrics = open_metrics(o, leader);
  const bool tty = leader && ::isatty(STDOUT_FILENO);
  // The model's FLOPs per token, and the peak they are measured against: the GPUs' on a device
  // (tokens/s and TFLOP/s count every rank's tokens, so MFU divides by every GPU's peak).
  const double flops_per_token = profile::gpt_flops_per_token(
      static_cast<std::int64_t>(count_parameters(model, cfg, /*active=*/true)), o.layers,
      o.channels, o.seq);
  const int gpus = on_device ? gpus_of(comm) : 1;
  const double peak_tflops = on_device ? device_peak_tflops() * gpus : 0.0;

  const std::int64_t print_every = cfg.steps_per_print;
  auto last = Clock::now();
  double first_loss = NAN, loss = NAN;
  std::int64_t since_print = 0;
  for (std::int64_t step = first_step; step < o.steps; ++step) {
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
    ++since_print;
    const bool print = (step + 1) % print_every == 0 || step + 1 == o.steps;
    if (tty && !print) {
      const int width = 30;
      const auto filled = static_cast<int>(width * (step + 1) / std::max<std::int64_t>(o.steps, 1));
      std::printf("\r[%.*s%*s] %lld/%lld loss %.4f", filled, "##############################",
                  width - filled, "", static_cast<long long>(step + 1),
                  static_cast<long long>(o.steps), loss);
      std::fflush(stdout);
    }
    if (print) {
      const auto now = Clock::now();
      const double seconds = std::chrono::duration<double>(now - last).count();
      last = now;
      const double tokens_per_s = static_cast<double>(since_print * sizes.train * o.seq) / seconds;
      const double ms = 1e3 * seconds / static_cast<double>(since_print);
      since_print = 0;
      const double state_mb = static_cast<double>(eng.memory_report().total()) / 1e6;
      const double model_tflops = flops_per_token * tokens_per_s / 1e12;
      char mfu[32] = "";
      if (peak_tflops > 0) {
        std::snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100.0 * model_tflops / peak_tflops);
      }
      if (leader) {
        std::printf(
            "%sstep %4lld | loss %.4f | lr %.2e | grad norm %.3f | scale %g | %.0f tokens/s"
            " | %.3g TFLOP/s%s | %.1f ms/step | state %.2f MB%s%s\n",
            tty ? "\r" : "", static_cast<long long>(step + 1), loss, eng.lr(), eng.last_grad_norm(),
            eng.loss_scale(), tokens_per_s, model_tflops, mfu, ms, state_mb, routing.line().c_str(),
            eng.last_step_skipped() ? " | skipped" : "");
        std::fflush(stdout);
        if (metrics.is_open()) {
          nlohmann::json line = metrics_line(eng, step + 1, loss, tokens_per_s, ms, observed);
          line["model_tflops"] = model_tflops;
          line["activation_peak_bytes"] = eng.activation_peak_bytes();
          if (peak_tflops > 0) line["mfu"] = model_tflops / peak_tflops;
          if (cfg.moe.active()) {
            line["moe_aux_loss"] = routing.aux_loss;
            line["moe_dropped_fraction"] = routing.dropped_fraction();
          }
          metrics << line.dump() << "\n" << std::flush;
        }
      }
    }
    save_if_due(o, eng, run.train_loader, step + 1, leader);
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
  if (leader) print_losses(first_loss, loss, corpus, val_loss);
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
                     last_row_logits<on_device>(model, gc, tp, row, sample_vocab(corpus))));
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
  const auto chosen = fill_auto(o, cfg, static_cast<int>(comm.size() / (tp * pp * sp)));  // dp
  if (comm.rank() == 0) {
    for (const auto& w : cfg.warnings) std::fprintf(stderr, "train_gpt: config: %s\n", w.c_str());
    for (const auto& n : cfg.notices) std::printf("train_gpt: config: %s\n", n.c_str());
    for (const auto& c : chosen) std::printf("train_gpt: config: auto: %s\n", c.c_str());
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

// Started by mpirun or mpiexec, or as one of several srun tasks (parallel::launched_by_mpi); a
// lone srun task, or a batch script running train_gpt directly (no step: launch_env finds
// nothing), keeps the LocalComm ranks.
bool launched_by_mpi() {
  return parallel::launched_by_mpi(parallel::launch_env());
}

#if defined(ZERO_WITH_MPI)
// fn(), and on an exception from it with other ranks running, the message and MPI_Abort: the
// other ranks may be inside a collective this rank will never join (NCCL's wait for a peer has
// no deadline while it connects), and MPI_Finalize, which the unwinding would run, can wait for
// them too. One rank alone rethrows, so main reports it as on the host.
template <class Fn>
bool abort_others_on_error(parallel::MpiComm& world, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    if (world.size() <= 1) throw;
    std::fprintf(stderr, "train_gpt: rank %d: %s\n", world.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(world.native_handle(), 1);
    throw;  // not reached: MPI_Abort ends the job
  }
}
#endif

}  // namespace
}  // namespace zero::train_gpt

int main(int argc, char** argv) try {
  using namespace zero;
  using namespace zero::train_gpt;
  const Options o = parse(argc, argv);
  const Config cfg = make_config(o);
  const Corpus corpus = load_corpus(o);
  bool improved = true;
#if defined(ZERO_TRAIN_GPT_CUDA)
  expect<ConfigError>(o.device == "cuda",
                      "train_gpt_cuda trains on the GPU (--device cuda, its default); train_gpt "
                      "trains on the host");
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  expect<CudaError>(found == cudaSuccess && devices > 0,
                    "train_gpt_cuda: no CUDA device is visible (cudaGetDeviceCount: ",
                    found == cudaSuccess ? "0 devices" : cudaGetErrorString(found),
                    "); it needs an NVIDIA GPU and a working driver (check nvidia-smi and "
                    "CUDA_VISIBLE_DEVICES), or train_gpt on the host");
  if (launched_by_mpi()) {
#if defined(ZERO_WITH_NCCL) && defined(ZERO_WITH_MPI)
    // One process per GPU: NCCL over the ranks mpiexec started, each on the GPU of its index
    // among its node's ranks (modulo the node's devices).
    auto world = parallel::MpiComm::world(argc, argv, parallel::CommOptions{cfg.comm_timeout_s});
    improved = abort_others_on_error(world, [&] {
      parallel::NcclComm nccl(world);
      return run<Cuda>(o, cfg, corpus, nccl);
    });
#else
    throw ConfigError(
        "train_gpt_cuda runs under mpiexec, one process per GPU over NCCL, but was built without "
        "NCCL or MPI (ZERO_WITH_NCCL, ZERO_WITH_MPI); without mpiexec its --ranks ranks share "
        "one GPU");
#endif
  } else {
    parallel::CudaLocalComm::run(
        o.ranks,
        [&](parallel::CudaLocalComm& comm) {
          const bool ok = run<Cuda>(o, cfg, corpus, comm);
          if (comm.rank() == 0) improved = ok;
        },
        parallel::CommOptions{cfg.comm_timeout_s});
  }
#else
  expect<ConfigError>(o.device == "host",
                      "--device cuda: this train_gpt was built without CUDA; build the "
                      "train_gpt_cuda target (configured when CMake finds nvcc) and run that");
  if (launched_by_mpi()) {
#if defined(ZERO_WITH_MPI)
    auto world = parallel::MpiComm::world(argc, argv, parallel::CommOptions{cfg.comm_timeout_s});
    improved = abort_others_on_error(world, [&] { return run<Host>(o, cfg, corpus, world); });
#else
    throw ConfigError("train_gpt runs under mpiexec but was built without MPI (ZERO_WITH_MPI)");
#endif
  } else {
    parallel::LocalComm::run(
        o.ranks,
        [&](parallel::LocalComm& comm) {
          const bool ok = run<Host>(o, cfg, corpus, comm);
          if (comm.rank() == 0) improved = ok;
        },
        parallel::CommOptions{cfg.comm_timeout_s});
  }
#endif
  // Exit 1 says so in words too: CTest ignores the exit code of a test with a pass regex, so
  // those tests fail on these lines (FAIL_REGULAR_EXPRESSION) instead.
  if (!improved) std::fprintf(stderr, "train_gpt: FAILED: the training loss did not fall\n");
  return improved ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\ntrain_gpt: FAILED: an error stopped the run\n", e.what());
  return 1;
}
