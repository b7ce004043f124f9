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
//                 [--tp 2 [--sp]] [--sp N] [--nvme-path DIR]
//                 [--device host|cuda] [--offload-cpu] [--activation-mb 512]
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
// --nvme-path puts the fp32 master and AdamW states in swap files (ZeRO-Infinity).
// --device cuda (the train_llama_cuda build, this file compiled by nvcc) trains on the GPU in
// bf16, data parallel only (tensor and sequence parallelism run on the host): the --ranks ranks
// as threads sharing one GPU over CudaLocalComm, with --offload-cpu ZeRO-Offload's host AdamW.
// The step line reports the loss, tokens/s, the model's TFLOP/s (6N + 6LCT per token) and, on a
// GPU whose datasheet peak is known, MFU. The exit code is 1 when the loss did not fall.
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

struct Options {
  std::string config;
  int ranks = 2;
  ConfigFlags run;  // --steps, --batch, --grad-accum, --stage, --lr, --warmup, --precision, ...
  std::int64_t seq = 64;
  std::uint64_t seed = 1234;
  std::string model, hf_config;  // a preset's name; a config.json (or its directory)
  std::optional<std::int64_t> layers, heads, kv_heads, channels, intermediate, vocab;
  std::optional<double> rope_theta;
  bool checkpoint_activations = false;
  std::string data = ZERO_DEFAULT_CORPUS, tokens, val_tokens, init, export_dir, metrics, save_dir,
              resume, nvme_path;
  data::TokenFormat token_format = data::TokenFormat::raw_i32;
  DType export_dtype = DType::f32;
  std::int64_t export_shard_bytes = 0;  // 0: one file
  std::int64_t save_every = 0;
  std::optional<int> tp, ulysses;
  bool sp = false;  // Megatron sequence parallelism (with --tp)
  bool offload_cpu = false;
#if defined(ZERO_TRAIN_LLAMA_CUDA)
  std::string device = "cuda";
#else
  std::string device = "host";
#endif
  std::int64_t activation_mb = 512;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "%s: %s (see the comment at the top of train_llama.cpp)\n", program,
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    const bool sp_size =
        flag == "--sp" && i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9';
    if (flag == "--checkpoint-activations" || flag == "--offload-cpu" ||
        (flag == "--sp" && !sp_size)) {  // no value
      (flag == "--sp"            ? o.sp
       : flag == "--offload-cpu" ? o.offload_cpu
                                 : o.checkpoint_activations) = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[i + 1];
    // Numbers are read whole and in range (examples/cli_number.hpp); a bad one ends in usage().
    auto read = [&](auto parse_number) {
      try {
        return parse_number();
      } catch (const ConfigError& e) {
        usage(e.what());
      }
    };
    auto integer = [&](std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
      return read([&] { return parse_integer(flag, v, min, max); });
    };
    auto positive = [&] { return integer(1, std::numeric_limits<int>::max()); };  // a count
    auto real = [&] { return read([&] { return parse_real(flag, v); }); };
    if (read([&] { return read_config_flag(flag, v, o.run); })) continue;
    if (flag == "--config")
      o.config = v;
    else if (flag == "--ranks")
      o.ranks = static_cast<int>(positive());
    else if (flag == "--seq")
      o.seq = positive();
    else if (flag == "--seed")
      o.seed = static_cast<std::uint64_t>(integer(0));
    else if (flag == "--metrics")
      o.metrics = v;
    else if (flag == "--model")
      o.model = v;
    else if (flag == "--hf-config")
      o.hf_config = v;
    else if (flag == "--layers")
      o.layers = positive();
    else if (flag == "--heads")
      o.heads = positive();
    else if (flag == "--kv-heads")
      o.kv_heads = positive();
    else if (flag == "--channels")
      o.channels = positive();
    else if (flag == "--intermediate")
      o.intermediate = positive();
    else if (flag == "--vocab")
      o.vocab = positive();
    else if (flag == "--rope-theta")
      o.rope_theta = real();
    else if (flag == "--data")
      o.data = v;
    else if (flag == "--tokens")
      o.tokens = v;
    else if (flag == "--val-tokens")
      o.val_tokens = v;
    else if (flag == "--token-format")
      o.token_format = read([&] { return token_format_of(v); });
    else if (flag == "--init")
      o.init = v;
    else if (flag == "--export")
      o.export_dir = v;
    else if (flag == "--export-dtype")
      o.export_dtype = read([&] { return export_dtype_of(v); });
    else if (flag == "--export-shard-bytes")
      o.export_shard_bytes = integer(0);
    else if (flag == "--save-dir")
      o.save_dir = v;
    else if (flag == "--save-every")
      o.save_every = positive();
    else if (flag == "--resume")
      o.resume = v;
    else if (flag == "--tp")
      o.tp = static_cast<int>(positive());
    else if (flag == "--sp")
      o.ulysses = static_cast<int>(positive());
    else if (flag == "--nvme-path")
      o.nvme_path = v;
    else if (flag == "--device") {
      if (v != "host" && v != "cuda") usage("--device must be host or cuda, not '" + v + "'");
      o.device = v;
    } else if (flag == "--activation-mb")
      o.activation_mb = integer(1, std::int64_t{1} << 40);
    else
      usage("unknown flag " + flag);
  }
  if (!o.model.empty() && !o.hf_config.empty()) {
    usage("--model and --hf-config both give the shape: pass one");
  }
  if ((o.save_every > 0 || !o.resume.empty()) && o.save_dir.empty()) {
    usage("--save-every and --resume need --save-dir");
  }
  if (o.tokens.empty() && (!o.val_tokens.empty() || o.token_format != data::TokenFormat::raw_i32)) {
    usage("--val-tokens and --token-format describe --tokens files");
  }
  if ((o.export_shard_bytes > 0 || o.export_dtype != DType::f32) && o.export_dir.empty()) {
    usage("--export-dtype and --export-shard-bytes describe --export's files");
  }
  if (o.offload_cpu && o.device != "cuda") {
    usage("--offload-cpu moves the optimizer from the GPU to the host: it needs --device cuda");
  }
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
  nlohmann::json j = builtin_config(o.run, 3);
  if (!o.config.empty()) {
    j = read_config_json(o.config);
    if (!j.is_object()) return Config::from_json(j);  // the parser names the problem
    override_config(j, o.config, o.run);
  }
  if (o.offload_cpu) j["zero_optimization"]["offload_optimizer"]["device"] = "cpu";
  if (!o.nvme_path.empty()) {
    j["zero_optimization"]["offload_optimizer"]["device"] = "nvme";
    j["zero_optimization"]["offload_optimizer"]["nvme_path"] = o.nvme_path;
  }
  if (o.ulysses) j["sequence_parallel_size"] = *o.ulysses;
  Config c;
  try {
    c = Config::from_json(j);
  } catch (const ConfigError& e) {
    if (o.config.empty()) throw;
    throw ConfigError(o.config + ": " + e.what());
  }
  expect<ConfigError>(c.pipeline.stages <= 1, program,
                      " trains without pipeline stages (pipeline.stages = ", c.pipeline.stages,
                      "); nn::LayerLlama runs under parallel::pipeline::PipelineEngine in a "
                      "program of your own");
  expect<ConfigError>(!c.moe.active(), "Llama has no mixture-of-experts layers (moe)");
  if (o.tp) c.tensor_parallel.tp_size = *o.tp;
  expect<ConfigError>(!o.sp || c.tensor_parallel.tp_size > 1,
                      "--sp without a size is Megatron's sequence parallelism, which needs tensor "
                      "parallelism (--tp 2 or more); --sp N is Ulysses over N ranks");
  if (o.sp) c.tensor_parallel.sequence_parallel = true;
  return c;
}

// Trains with engine type E on comm (tp x sp x dp ranks); rank 0 prints. Returns whether the
// loss fell.
template <class E, class Comm>
bool train(const Options& o, const Config& cfg, const ModelShape& shape, const Corpus& corpus,
           Comm& comm) {
  constexpr bool on_device = E::backend_type::Device::kind != DeviceKind::host;
  const bool leader = comm.rank() == 0;
  const auto tp = static_cast<int>(cfg.tensor_parallel.tp_size);
  const auto sp = static_cast<int>(cfg.sequence_parallel_size);
  expect<ConfigError>(comm.size() % (tp * sp) == 0, "tensor_parallel.tp_size = ", tp,
                      " and sequence_parallel_size = ", sp, " do not divide the ", comm.size(),
                      " ranks");
  if (sp > 1) parallel::check_sequence_split(o.seq, sp);
  const int dp = comm.size() / (tp * sp);
  const Config::BatchSizes sizes = cfg.resolve_batch(dp);
  profile::Monitor monitor(cfg, comm.rank(), sizes.micro);
  if (monitor.logger()) comm.set_logger(monitor.logger());  // before the groups split from comm
  parallel::ProcessGroups<Comm> groups(comm, parallel::Grid({.tp = tp, .cp = sp, .dp = dp}));
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
  E eng(model, groups, cfg, options);
  if (leader) {
    std::printf(
        "%s: %lld parameters (L=%lld, heads=%lld, kv_heads=%lld, C=%lld, F=%lld, V=%lld, T=%lld; "
        "shape from %s), ZeRO stage %d on %d data-parallel x %d tensor-parallel%s%s ranks in %s; "
        "global batch %lld = %lld micro x %lld accumulation x %d ranks; %lld steps; model state "
        "on rank 0: %.2f MB\n",
        program, static_cast<long long>(lc.num_parameters()), static_cast<long long>(lc.num_layers),
        static_cast<long long>(lc.num_heads), static_cast<long long>(lc.num_kv_heads),
        static_cast<long long>(lc.channels), static_cast<long long>(lc.intermediate_size),
        static_cast<long long>(lc.vocab_size), static_cast<long long>(o.seq), shape.source.c_str(),
        E::stage, dp, tp,
        cfg.tensor_parallel.sequence_parallel && tp > 1 ? " (sequence parallel)" : "",
        sp > 1 ? (" x " + std::to_string(sp) + " Ulysses sequence-parallel").c_str() : "",
        std::string(name_of(dtype_of<typename E::T>)).c_str(), static_cast<long long>(sizes.train),
        static_cast<long long>(sizes.micro), static_cast<long long>(sizes.accumulation), dp,
        static_cast<long long>(o.run.steps),
        static_cast<double>(eng.memory_report().total()) / 1e6);
    std::fflush(stdout);
  }
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
  const double peak_tflops = on_device ? device_peak_tflops() * gpus_of(comm) : 0.0;
  StepLines lines(leader, o.run.steps, cfg.steps_per_print, sizes.train * o.seq, flops_per_token,
                  peak_tflops, metrics);
  double first_loss = NAN, loss = NAN;
  for (std::int64_t step = first_step; step < o.run.steps; ++step) {
    double step_loss = 0;
    monitor.begin_step(eng, step + 1);
    for (std::int64_t m = 0; m < sizes.accumulation; ++m) {
      const data::Batch batch = train_loader.next();  // backward reads its targets too
      const RankBatch mine(batch, model.sequence_parallel());
      step_loss += static_cast<double>(static_cast<float>(eng.forward(mine.micro())));
      eng.backward();
    }
    eng.step();
    const nlohmann::json observed = monitor.end_step(eng, model, step + 1);
    loss = mean_over_dp(eng, step_loss / static_cast<double>(sizes.accumulation));
    if (std::isnan(first_loss)) first_loss = loss;
    lines.after_step(eng, step + 1, loss, "", observed, [](nlohmann::json&) {});
    checkpoints.save_if_due(eng, train_loader, step + 1, leader);
  }
  if (!o.export_dir.empty()) {
    const std::filesystem::path dir(o.export_dir);
    std::filesystem::create_directories(dir);
    const auto written =
        engine::save_llama_weights(eng, dir / "model.safetensors", lc, o.export_dtype,
                                   static_cast<std::uint64_t>(o.export_shard_bytes));
    if (leader) {
      io::llama::write_hf_config(lc, dir / "config.json");
      std::printf(
          "%s: exported %zu tensors to %s (config.json and %zu weights file%s, %.1f MB, "
          "%s)\n",
          program, written.tensors, o.export_dir.c_str(), written.files,
          written.files == 1 ? "" : "s with their index", static_cast<double>(written.bytes) / 1e6,
          std::string(name_of(o.export_dtype)).c_str());
    }
  }
  monitor.finish();
  const data::Batch val = val_loader.next();
  const RankBatch val_mine(val, model.sequence_parallel());
  const double val_loss =
      mean_over_dp(eng, static_cast<double>(static_cast<float>(eng.evaluate(val_mine.micro()))));
  if (leader) print_losses(first_loss, loss, lc.vocab_size, corpus.val_held_out, val_loss);
  return loss < first_loss || first_step > 0 || o.run.steps == 0;
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
  expect<ConfigError>(comm.size() % (tp * sp) == 0, "tensor_parallel.tp_size = ", tp,
                      " and sequence_parallel_size = ", sp, " do not divide the ", comm.size(),
                      " ranks");
  const auto chosen =
      fill_auto(o.run, cfg, shape.model.channels, static_cast<int>(comm.size() / (tp * sp)));
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
    expect<ConfigError>(tp == 1 && sp == 1, program,
                        " --device cuda trains data-parallel Llama (ZeRO stages 0-3): tensor "
                        "and sequence parallelism run on the host (--device host)");
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
  const Corpus corpus =
      examples::load_corpus(o.data, o.tokens, o.val_tokens, o.token_format, shape.model.vocab_size);
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
