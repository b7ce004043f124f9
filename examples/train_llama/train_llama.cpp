// train_llama: trains a Llama-family decoder (nn::LayerLlama: RMSNorm, the rotary embedding,
// grouped-query attention, a SwiGLU MLP) with the ZeRO engine, configured like a DeepSpeed run.
// It starts from a Hugging Face Llama checkpoint (--init: the model's directory, whose
// config.json gives the shape and whose model.safetensors, or shards and their index, give the
// weights) and writes one back (--export DIR: config.json and the weights, the layout
// LlamaForCausalLM.from_pretrained reads). Without flags it trains a small Llama from scratch on
// the bundled corpus's bytes, 2 ranks in one process (LocalComm threads) at ZeRO stage 3.
//
//   ./train_llama [--config ds.json] [--ranks 2] [--stage 3] [--precision f32|bf16]
//                 [--steps 100] [--batch 8] [--seq 64] [--grad-accum 1] [--lr 1e-3]
//                 [--warmup N] [--seed 1234] [--print-every 10] [--metrics metrics.jsonl]
//                 [--model tiny|llama2-7b|llama2-13b|llama3-8b|llama3.1-8b|llama3.2-1b |
//                  --hf-config config.json|DIR]
//                 [--layers 4] [--heads 4] [--kv-heads 2] [--channels 128]
//                 [--intermediate 352] [--vocab V] [--rope-theta 10000]
//                 [--checkpoint-activations]
//                 [--data corpus.txt |
//                  --tokens train.bin [--val-tokens val.bin] [--token-format raw_i32|raw_u16|llmc]]
//                 [--init DIR | model.safetensors | model.safetensors.index.json]
//                 [--export DIR [--export-dtype f32|bf16|f16] [--export-shard-bytes N]]
//                 [--save-dir ckpt --save-every 50] [--resume latest|<tag>]
//                 [--tp 2 [--sp]] [--sp N] [--pp 2 [--vpp 2] [--schedule
//                 gpipe|1f1b|interleaved|zb]]
//                 [--nvme-path DIR]
//                 [--device host|cuda] [--offload-cpu] [--activation-mb 512]
//                 [--temperature 0.8] [--top-k 40] [--sample-bytes 96]
//
// The shape comes from --hf-config (a config.json, or the directory that holds one), else from
// the config.json beside --init's weights, else from --model's preset, else the built-in small
// model (4 layers, 4 query heads over 2 key/value heads of 32 channels, 352 SwiGLU units); the
// shape flags then change what they name. The vocabulary is the shape's, or --vocab, or, for the
// built-in model on a text's bytes, the byte vocabulary (257) rounded up to a multiple of 64 as
// Megatron pads its vocabulary (320). Llama's tokenizers are not part of zero: tokenize with
// Hugging Face's and write the ids as int32 (--token-format raw_i32; numpy's
// np.array(ids, dtype=np.int32).tofile("train.bin")), or as uint16 for vocabularies up to 65536.
//
// Under mpiexec every process is one rank over MpiComm (train_llama_cuda: NcclComm, one GPU a
// process). The DeepSpeed JSON (--config, or the built-in one: AdamW, WarmupCosineLR, clipping
// 1.0, ZeRO-3) picks the stage and precision (f32, or bf16 with "bf16": {"enabled": true}),
// optimizer, schedule, batch sizes and offload; its "auto" values are filled as the Hugging Face
// Trainer fills them, and keys without effect are named. --tp N splits every layer over N ranks
// (Megatron tensor parallelism: qkv_proj in whole key/value groups, so num_kv_heads must divide
// by N) and --sp adds Megatron's sequence parallelism; --sp N is DeepSpeed-Ulysses over N ranks.
// --pp N cuts the model's units (the embedding, each decoder layer, the head) into N pipeline
// stages (the config's "pipeline" section: stages, schedule, virtual_stages, partition_method)
// run by parallel::pipeline::PipelineEngine, each step the accumulation's micro-batches through
// the schedule (--schedule, default 1f1b; --vpp V chunks a stage with the interleaved one); the
// built-in config then takes ZeRO stage 1, and the step line adds the bubble fraction. It
// combines with --tp and --sp; --init and --export, which read and write whole models, are
// refused with it (resume its checkpoint without stages to export).
// --nvme-path puts the fp32 master and AdamW states in swap files (ZeRO-Infinity).
// --device cuda (the train_llama_cuda build, this file compiled by nvcc) trains on the GPU in
// bf16, data parallel only (tensor and sequence parallelism run on the host): the --ranks ranks
// as threads sharing one GPU over CudaLocalComm, with --offload-cpu ZeRO-Offload's host AdamW.
// The step line reports the loss, tokens/s, the model's TFLOP/s (6N + 6LCT per token) and, on a
// GPU whose datasheet peak is known, MFU. On a text's bytes the run closes with a sample, as
// train_gpt's: the start of the validation text continued by temperature / top-k sampling
// seeded from --seed (--temperature 0 is greedy; none with Ulysses sequence parallelism, nor on
// --tokens files, whose tokenizer is not zero's). The exit code is 1 when the loss did not fall.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <parallel/comm/text_collectives.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/io/llama_hf_config.hpp>
#include <zero/nn/layer_llama.hpp>
#include <zero/nn/llama_config.hpp>
#include <zero/profile/mfu.hpp>
#include <zero/profile/monitor.hpp>

#include "../cli_number.hpp"
#include "../training_run.hpp"

// Inside zero, not `using namespace zero` at file scope: with nvcc, a using-directive reaching
// the global scope makes `cuda` ambiguous (zero::cuda, CCCL's ::cuda) in CUB's kernel stubs.
namespace zero::train_llama {
namespace {

using namespace zero::examples;  // the examples' shared run (training_run.hpp)

#if defined(ZERO_TRAIN_LLAMA_CUDA)
constexpr const char* program = "train_llama_cuda";
#else
constexpr const char* program = "train_llama";
#endif

struct Options : RunFlags {      // the flags train_gpt takes too (run_flags.hpp), and these
  std::string model, hf_config;  // a preset's name; a config.json (or its directory)
  std::optional<std::int64_t> layers, heads, kv_heads, channels, intermediate;
  std::optional<double> rope_theta;
  bool checkpoint_activations = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "%s: %s (see the comment at the top of train_llama.cpp)\n", program,
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  o.data = ZERO_DEFAULT_CORPUS;
#if defined(ZERO_TRAIN_LLAMA_CUDA)
  o.device = "cuda";
#else
  o.device = "host";
#endif
  const auto own_switch = [&](const std::string& flag) {
    if (flag != "--checkpoint-activations") return false;
    o.checkpoint_activations = true;
    return true;
  };
  const auto own_flag = [&](const FlagValue& v) {
    const std::string& flag = v.flag;
    if (flag == "--model")
      o.model = v.text;
    else if (flag == "--hf-config")
      o.hf_config = v.text;
    else if (flag == "--layers")
      o.layers = v.positive();
    else if (flag == "--heads")
      o.heads = v.positive();
    else if (flag == "--kv-heads")
      o.kv_heads = v.positive();
    else if (flag == "--channels")
      o.channels = v.positive();
    else if (flag == "--intermediate")
      o.intermediate = v.positive();
    else if (flag == "--rope-theta")
      o.rope_theta = v.real();
    else
      return false;
    return true;
  };
  const auto check = [](const Options& f) {
    check_run_flags(f);
    expect<ConfigError>(f.model.empty() || f.hf_config.empty(),
                        "--model and --hf-config both give the shape: pass one");
  };
  parse_flags(argc, argv, o, own_switch, own_flag, check, usage);
  return o;
}

// The config.json that gives the shape: --hf-config's, else the one beside --init's weights
// (in its directory, or beside its file), else none.
std::optional<std::filesystem::path> shape_file(const Options& o) {
  if (!o.hf_config.empty()) return std::filesystem::path(o.hf_config);
  if (o.init.empty()) return std::nullopt;
  const std::filesystem::path init(o.init);
  std::error_code ec;
  const std::filesystem::path dir =
      std::filesystem::is_directory(init, ec) ? init : init.parent_path();
  const std::filesystem::path file = dir / "config.json";
  if (std::filesystem::exists(file, ec)) return file;
  return std::nullopt;
}

// The byte vocabulary (256 bytes and end-of-text) rounded up to a multiple of 64.
constexpr std::int64_t byte_vocab_padded = (257 + 63) / 64 * 64;

// The model's shape (see the top of the file) and, when it came from a file, the file's name and
// whether it ties the LM head to the token table.
struct ModelShape {
  nn::LlamaConfig model;
  std::string source = "built-in";
  bool tied = false;
};

ModelShape model_shape(const Options& o) {
  ModelShape s;
  if (const auto file = shape_file(o)) {
    expect<ConfigError>(o.model.empty(), "--model ", o.model, " and ", file->string(),
                        " both give the shape: leave out --model, or start --init from a "
                        "directory without a config.json");
    const io::llama::HfLlamaConfig hf = io::llama::read_hf_config(*file);
    s.model = hf.model;
    s.tied = hf.tied;
    s.source = file->string();
  } else if (!o.model.empty()) {
    s.model = nn::LlamaConfig::preset(o.model);
    s.source = "preset " + o.model;
  } else {
    s.model.num_layers = 4;
    s.model.num_heads = 4;
    s.model.num_kv_heads = 2;
    s.model.channels = 128;
    s.model.intermediate_size = 352;
    if (!o.tokens.empty()) {
      expect<ConfigError>(o.vocab.has_value(),
                          "--tokens needs the model's vocabulary: --vocab, --model, or a "
                          "config.json (--hf-config, or beside --init's weights)");
    }
    s.model.vocab_size = byte_vocab_padded;
  }
  if (o.layers) s.model.num_layers = *o.layers;
  if (o.heads) s.model.num_heads = *o.heads;
  if (o.kv_heads) s.model.num_kv_heads = *o.kv_heads;
  if (o.channels) s.model.channels = *o.channels;
  if (o.intermediate) s.model.intermediate_size = *o.intermediate;
  if (o.vocab) s.model.vocab_size = *o.vocab;
  if (o.rope_theta) s.model.rope_theta = *o.rope_theta;
  s.model.checkpoint_activations = o.checkpoint_activations;
  s.model.validate();
  if (o.tokens.empty()) {
    expect<ConfigError>(s.model.vocab_size >= 257, "the model's vocabulary (", s.model.vocab_size,
                        ") cannot hold the text's byte tokens (257: 256 bytes and end-of-text); "
                        "train on --tokens, or give --vocab 257 or more");
  }
  return s;
}

// The built-in DeepSpeed config or --config's, with the flags written into the JSON before it is
// parsed, so the notices about keys without effect describe the config that runs.
Config make_config(const Options& o) {
  // Stages 2 and 3 do not compose with a pipeline: its built-in config takes stage 1.
  nlohmann::json j = builtin_config(o.run, o.pp.value_or(1) > 1 ? 1 : 3);
  if (!o.config.empty()) {
    j = read_config_json(o.config);
    if (!j.is_object()) return Config::from_json(j);  // the parser names the problem
    override_config(j, o.config, o.run);
  }
  write_run_flags(j, o);
  Config c;
  try {
    c = Config::from_json(j);
  } catch (const ConfigError& e) {
    if (o.config.empty()) throw;
    throw ConfigError(o.config + ": " + e.what());
  }
  expect<ConfigError>(!c.moe.active(), "Llama has no mixture-of-experts layers (moe)");
  apply_tensor_parallel_flags(c, o);
  // --init and --export read and write whole models; a pipeline stage holds only its own layers.
  // A checkpoint loads at any layout, with stages or without: it carries the model across.
  expect<ConfigError>(c.pipeline.stages <= 1 || o.init.empty(),
                      "--init with pipeline parallelism (pipeline.stages = ", c.pipeline.stages,
                      ") is not supported: a stage holds only its own layers; load the weights "
                      "in a run without stages that saves a checkpoint (--save-dir), and resume "
                      "it with stages (--resume)");
  expect<ConfigError>(c.pipeline.stages <= 1 || o.export_path.empty(),
                      "--export with pipeline parallelism (pipeline.stages = ", c.pipeline.stages,
                      ") is not supported: a stage holds only its own layers; save a checkpoint "
                      "(--save-dir) and resume it in a run without stages that exports it");
  return c;
}

// What one training step gives the loop: its mean loss over this rank's micro-batches and, in a
// pipeline, the fraction of the step the busiest stage waited.
struct StepResult {
  double loss = 0;
  std::optional<double> bubble;
};

// What the step loop uses of a run that train() set up, for either engine.
struct RunParts {
  bool leader;
  Config::BatchSizes sizes;
  const parallel::SequenceParallel& sequence;  // the model's (Ulysses)
  data::DataLoader& train_loader;
  data::DataLoader& val_loader;
  profile::Monitor& monitor;
  double peak_tflops;         // the GPUs' datasheet peak (0: no MFU)
  std::int64_t sample_split;  // a sample's window is padded to a multiple of it (tp under sp)
};

// The run on an engine eng (E, or a pipeline's stage engine) whose model the Monitor reads
// (stage_model: the model, or the stage's units): step(batches) trains one step on the
// accumulation's micro-batches, evaluate(micro) gives the validation loss and
// next_token(window, row, sampler) runs the model on a window and draws the token after its row
// `row` (every rank the same: print_sample). Rank 0 prints. Returns whether the loss fell.
template <class Eng, class StageModel, class Step, class Evaluate, class NextToken>
bool train_steps(const Options& o, const Config& cfg, const ModelShape& shape, const Corpus& corpus,
                 RunParts& run, Eng& eng, const StageModel& stage_model, Step&& step_fn,
                 Evaluate&& evaluate, NextToken&& next_token) {
  const nn::LlamaConfig& lc = shape.model;
  const bool leader = run.leader;
  const Config::BatchSizes& sizes = run.sizes;
  const parallel::SequenceParallel& sequence = run.sequence;
  data::DataLoader& train_loader = run.train_loader;
  profile::Monitor& monitor = run.monitor;
  if (!o.init.empty()) {
    engine::load_llama_weights(eng, o.init, lc);
    if (leader) {
      std::printf(
          "%s: weights from %s%s\n", program, o.init.c_str(),
          shape.tied ? " (its LM head is tied to the token table: training unties them)" : "");
    }
  }
  const Checkpoints checkpoints{program, o.save_dir, o.resume, o.save_every, o.run.steps};
  const std::int64_t first_step = checkpoints.resume_into(eng, train_loader, leader);
  std::ofstream metrics = open_metrics(o.metrics, leader);
  const double flops_per_token =
      profile::gpt_flops_per_token(lc.num_parameters(), lc.num_layers, lc.channels, o.seq);
  StepLines lines(leader, o.run.steps, cfg.steps_per_print, sizes.train * o.seq, flops_per_token,
                  run.peak_tflops, metrics);
  double first_loss = NAN, loss = NAN;
  for (std::int64_t step = first_step; step < o.run.steps; ++step) {
    std::vector<data::Batch> held;  // the micro-batches' data lives through the step
    std::vector<RankBatch> mine;    // and this rank's positions of them (Ulysses)
    std::vector<engine::MicroBatch> batches;
    held.reserve(static_cast<std::size_t>(sizes.accumulation));
    mine.reserve(held.capacity());
    for (std::int64_t m = 0; m < sizes.accumulation; ++m) {
      batches.push_back(
          mine.emplace_back(held.emplace_back(train_loader.next()), sequence).micro());
    }
    monitor.begin_step(eng, step + 1);
    const StepResult r = step_fn(std::span<const engine::MicroBatch>(batches));
    const nlohmann::json observed = monitor.end_step(eng, stage_model, step + 1);
    loss = mean_over_dp(eng, r.loss);
    if (std::isnan(first_loss)) first_loss = loss;
    char bubble[32] = "";
    if (r.bubble) std::snprintf(bubble, sizeof bubble, " | bubble %.2f", *r.bubble);
    lines.after_step(eng, step + 1, loss, bubble, observed, [&](nlohmann::json& line) {
      if (r.bubble) line["bubble"] = *r.bubble;
    });
    checkpoints.save_if_due(eng, train_loader, step + 1, leader);
  }
  if (!o.export_path.empty()) {
    const std::filesystem::path dir(o.export_path);
    std::filesystem::create_directories(dir);
    const auto written =
        engine::save_llama_weights(eng, dir / "model.safetensors", lc, o.export_dtype,
                                   static_cast<std::uint64_t>(o.export_shard_bytes));
    if (leader) {
      io::llama::write_hf_config(lc, dir / "config.json");
      std::printf(
          "%s: exported %zu tensors to %s (config.json and %zu weights file%s, %.1f MB, "
          "%s)\n",
          program, written.tensors, o.export_path.c_str(), written.files,
          written.files == 1 ? "" : "s with their index", static_cast<double>(written.bytes) / 1e6,
          std::string(name_of(o.export_dtype)).c_str());
    }
  }
  monitor.finish();
  const data::Batch val = run.val_loader.next();
  const RankBatch val_mine(val, sequence);
  const double val_loss = mean_over_dp(eng, evaluate(val_mine.micro()));
  if (leader) print_losses(first_loss, loss, lc.vocab_size, corpus.val_held_out, val_loss);
  // Under Ulysses the sampler would need the last position's logits from the last sp rank.
  if (sequence.size() > 1) {
    if (leader) std::printf("%s: no sample with Ulysses sequence parallelism\n", program);
  } else {
    print_sample(o, corpus, leader, run.sample_split, next_token);
  }
  return loss < first_loss || first_step > 0 || o.run.steps == 0;
}

// Trains with engine type E on comm (tp x sp x dp ranks, or x pp with pipeline stages, which
// run E's model and policies under parallel::pipeline::PipelineEngine); rank 0 prints. Returns
// whether the loss fell.
template <class E, class Comm>
bool train(const Options& o, const Config& cfg, const ModelShape& shape, const Corpus& corpus,
           Comm& comm) {
  constexpr bool on_device = E::backend_type::Device::kind != DeviceKind::host;
  const bool leader = comm.rank() == 0;
  const auto tp = static_cast<int>(cfg.tensor_parallel.tp_size);
  const auto sp = static_cast<int>(cfg.sequence_parallel_size);
  const auto pp = static_cast<int>(std::max<std::int64_t>(1, cfg.pipeline.stages));
  const parallel::Grid grid = parallel::Grid::for_world(comm.size(), tp, sp, 1, pp);
  if (sp > 1) parallel::check_sequence_split(o.seq, sp);
  const int dp = grid.size(parallel::Axis::dp);
  const Config::BatchSizes sizes = cfg.resolve_batch(dp);
  profile::Monitor monitor(cfg, comm.rank(), sizes.micro);
  if (monitor.logger()) comm.set_logger(monitor.logger());  // before the groups split from comm
  parallel::ProcessGroups<Comm> groups(comm, grid);
  const nn::LlamaConfig& lc = shape.model;
  typename E::model_type model(
      lc,
      tp > 1 ? parallel::TensorParallel(groups.tp(), cfg.tensor_parallel.sequence_parallel)
             : parallel::TensorParallel(),
      sp > 1 ? parallel::SequenceParallel(groups.cp()) : parallel::SequenceParallel());
  const int dp_rank = groups.dp().rank();
  data::DataLoader train_loader(
      corpus.train, loader_config(sizes, o.seq, dp, dp_rank, true, o.seed, lc.vocab_size));
  data::DataLoader val_loader(
      corpus.val, loader_config(sizes, o.seq, dp, dp_rank, false, o.seed, lc.vocab_size));
  engine::EngineOptions options;
  options.seed = o.seed;
  options.activation_bytes = static_cast<std::size_t>(o.activation_mb) << 20;
  RunParts run{leader,
               sizes,
               model.sequence_parallel(),
               train_loader,
               val_loader,
               monitor,
               on_device ? device_peak_tflops() * gpus_of(comm) : 0.0,
               model.tensor_parallel().sequence_parallel() ? tp : 1};
  // The run's first line: the model, where its shape came from and the layout.
  const auto describe = [&](const auto& eng, const std::string& pipeline) {
    if (!leader) return;
    std::printf(
        "%s: %lld parameters (L=%lld, heads=%lld, kv_heads=%lld, C=%lld, F=%lld, V=%lld, T=%lld; "
        "shape from %s), ZeRO stage %d on %d data-parallel x %d tensor-parallel%s%s%s ranks in "
        "%s; global batch %lld = %lld micro x %lld accumulation x %d ranks; %lld steps; model "
        "state on rank 0: %.2f MB\n",
        program, static_cast<long long>(lc.num_parameters()), static_cast<long long>(lc.num_layers),
        static_cast<long long>(lc.num_heads), static_cast<long long>(lc.num_kv_heads),
        static_cast<long long>(lc.channels), static_cast<long long>(lc.intermediate_size),
        static_cast<long long>(lc.vocab_size), static_cast<long long>(o.seq), shape.source.c_str(),
        E::stage, dp, tp,
        cfg.tensor_parallel.sequence_parallel && tp > 1 ? " (sequence parallel)" : "",
        sp > 1 ? (" x " + std::to_string(sp) + " Ulysses sequence-parallel").c_str() : "",
        pipeline.c_str(), std::string(name_of(dtype_of<typename E::T>)).c_str(),
        static_cast<long long>(sizes.train), static_cast<long long>(sizes.micro),
        static_cast<long long>(sizes.accumulation), dp, static_cast<long long>(o.run.steps),
        static_cast<double>(eng.memory_report().total()) / 1e6);
    std::fflush(stdout);
  };
  if (pp > 1) {
    if constexpr (E::stage <= 1 && !on_device) {
      parallel::pipeline::PipelineOptions po;
      po.schedule = parallel::pipeline::parse_schedule_kind(cfg.pipeline.schedule);
      po.virtual_stages = static_cast<int>(cfg.pipeline.virtual_stages);
      po.partition_method = cfg.pipeline.partition_method;
      parallel::pipeline::pipeline_engine_of_t<E> pipe(model, comm, groups, cfg, po, options);
      // Each stage runs its own units: the profiler's reports come from every stage.
      monitor.collect_stages([&groups](const std::string& text) {
        return parallel::all_gather_text(groups.pp(), text);
      });
      if (leader) {
        for (const auto& w : pipe.partition().warnings) std::printf("%s: %s\n", program, w.c_str());
      }
      describe(pipe.engine(), " x " + std::to_string(pp) + " pipeline (" +
                                  std::string(name_of(po.schedule)) + " schedule, units " +
                                  pipe.partition().describe() + ")");
      return train_steps(
          o, cfg, shape, corpus, run, pipe.engine(), pipe.stage_model(),
          [&](std::span<const engine::MicroBatch> batches) {
            const auto r = pipe.train_batch(batches);
            return StepResult{r.loss, r.bubble_fraction};
          },
          [&](const engine::MicroBatch& micro) { return pipe.evaluate(micro); },
          // Every rank runs the pipelined forward; the last stage holds the logits and draws
          // the token, which the pipeline group then shares.
          [&](const engine::MicroBatch& window, std::int64_t row, nn::Sampler& sampler) {
            (void)pipe.evaluate(window);
            std::int32_t next = 0;
            if (pipe.holds_last_unit()) {
              next = sampler.next(
                  std::span<const float>(last_row_logits<false>(model, row, sample_vocab(corpus))));
            }
            groups.pp().broadcast(std::span<std::int32_t>(&next, 1), pp - 1);
            return next;
          });
    } else {
      throw ConfigError(std::string(program) + ": pipeline.stages > 1 needs ZeRO stage 0 or 1 " +
                        "on the host");  // the config and run() refuse it first
    }
  }
  E eng(model, groups, cfg, options);
  describe(eng, "");
  return train_steps(
      o, cfg, shape, corpus, run, eng, model,
      [&](std::span<const engine::MicroBatch> batches) {
        double sum = 0;
        for (const engine::MicroBatch& micro : batches) {
          sum += static_cast<double>(static_cast<float>(eng.forward(micro)));
          eng.backward();
        }
        eng.step();
        return StepResult{sum / static_cast<double>(batches.size()), std::nullopt};
      },
      [&](const engine::MicroBatch& micro) {
        return static_cast<double>(static_cast<float>(eng.evaluate(micro)));
      },
      // Every rank takes part (stage 3 gathers units collectively) and draws the same numbers
      // from the same logits, so all pick the same token.
      [&](const engine::MicroBatch& window, std::int64_t row, nn::Sampler& sampler) {
        eng.evaluate(window);
        return sampler.next(
            std::span<const float>(last_row_logits<on_device>(model, row, sample_vocab(corpus))));
      });
}

// Fills "auto" for this world size, says once (rank 0) what it chose and which keys have no
// effect, then trains with the engine the config names: on the host (f32 or bf16), or with
// Device = Cuda on the GPU (bf16, data parallel only).
template <class Device, class Comm>
bool run(const Options& o, const Config& parsed, const ModelShape& shape, const Corpus& corpus,
         Comm& comm) {
  Config cfg = parsed;
  const auto tp = std::max<std::int64_t>(1, cfg.tensor_parallel.tp_size);
  const auto sp = std::max<std::int64_t>(1, cfg.sequence_parallel_size);
  const auto pp = std::max<std::int64_t>(1, cfg.pipeline.stages);
  expect<ConfigError>(comm.size() % (tp * sp * pp) == 0, "tensor_parallel.tp_size = ", tp,
                      ", sequence_parallel_size = ", sp, " and pipeline.stages = ", pp,
                      " do not divide the ", comm.size(), " ranks");
  const auto chosen =
      fill_auto(o.run, cfg, shape.model.channels, static_cast<int>(comm.size() / (tp * sp * pp)));
  if (comm.rank() == 0) {
    print_config_notes(program, cfg, chosen);
    if (engine::offload_cpu_already_host<None, Device>(cfg)) {
      std::printf("%s: config: %s\n", program, engine::host_offload_note().c_str());
    }
    std::fflush(stdout);
  }
  const auto train_with = [&]<class E>(std::type_identity<E>) {
    return train<E>(o, cfg, shape, corpus, comm);
  };
  if constexpr (std::is_same_v<Device, Host>) {
    return zero::dispatch<nn::LayerLlama, Precisions<float, bf16>>(cfg, train_with);
  } else {
    expect<ConfigError>(tp == 1 && sp == 1 && pp == 1, program,
                        " --device cuda trains data-parallel Llama (ZeRO stages 0-3): tensor, "
                        "sequence and pipeline parallelism run on the host (--device host)");
    expect<ConfigError>(!cfg.fp16.enabled.value_or(false) && cfg.bf16_enabled.value_or(true),
                        program,
                        " --device cuda trains in bf16 (--precision bf16, or the config's "
                        "\"bf16\": {\"enabled\": true})");
    return zero::dispatch<nn::LayerLlama, Precisions<bf16>, Compute<Device>>(cfg, train_with);
  }
}

}  // namespace
}  // namespace zero::train_llama

int main(int argc, char** argv) try {
  using namespace zero;
  using namespace zero::train_llama;
  const Options o = parse(argc, argv);
  const Config cfg = make_config(o);
  const ModelShape shape = model_shape(o);
  const Corpus corpus = examples::load_corpus(o.data, o.tokens, o.val_tokens,
                                              o.token_format.value_or(data::TokenFormat::raw_i32),
                                              shape.model.vocab_size);
#if defined(ZERO_TRAIN_LLAMA_CUDA)
  expect<ConfigError>(o.device == "cuda",
                      "train_llama_cuda trains on the GPU (--device cuda, its default); "
                      "train_llama trains on the host");
  using Device = Cuda;
#else
  expect<ConfigError>(o.device == "host",
                      "--device cuda: this train_llama was built without CUDA; build the "
                      "train_llama_cuda target (configured when CMake finds nvcc) and run that");
  using Device = Host;
#endif
  const bool improved = examples::run_ranks<Device>(
      argc, argv, o.ranks, cfg.comm_timeout_s, program,
      [&](auto& comm) { return run<Device>(o, cfg, shape, corpus, comm); });
  // CTest ignores the exit code of a test with a pass regex: those tests fail on these lines.
  if (!improved) std::fprintf(stderr, "%s: FAILED: the training loss did not fall\n", program);
  return improved ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s: %s\n%s: FAILED: an error stopped the run\n", zero::train_llama::program,
               e.what(), zero::train_llama::program);
  return 1;
}
