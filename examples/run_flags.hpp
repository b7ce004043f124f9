#pragma once
// The command-line flags the training examples (train_gpt, train_llama) share, and the walk over
// argv that reads them: ConfigFlags (the DeepSpeed keys a flag sets: --steps, --batch, --stage,
// ...) and RunFlags (the run's ranks, data, weights files, checkpoints, parallelism and device),
// from which each program's Options derive, adding its own flags through parse_flags' callbacks.
// Numbers are read whole and in range (cli_number.hpp); a bad value, a missing one or an unknown
// flag ends in the program's usage().
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include <zero/config/config.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/data/token_file.hpp>

#include "cli_number.hpp"

namespace zero::examples {

/// The flags every training example takes that set DeepSpeed config keys.
struct ConfigFlags {
  std::int64_t steps = 100, batch = 8, grad_accum = 1;
  std::optional<int> stage;
  std::optional<double> lr;
  std::optional<std::int64_t> warmup, print_every;
  std::string precision;  ///< f32 or bf16; empty: the config's, else f32
};

/// Reads flag's value v into f when flag is one of f's (--steps, --batch, --grad-accum, --stage,
/// --lr, --warmup, --print-every, --precision) and returns true; false for another flag. A value
/// that is not one (examples/cli_number.hpp: read whole and in range) is a ConfigError naming
/// the flag.
inline bool read_config_flag(const std::string& flag, const std::string& v, ConfigFlags& f) {
  const auto positive = [&] { return parse_integer(flag, v, 1, std::numeric_limits<int>::max()); };
  if (flag == "--steps") {
    f.steps = parse_integer(flag, v, 0);
  } else if (flag == "--batch") {
    f.batch = positive();
  } else if (flag == "--grad-accum") {
    f.grad_accum = positive();
  } else if (flag == "--stage") {
    f.stage = static_cast<int>(parse_integer(flag, v, 0, 3));
  } else if (flag == "--lr") {
    f.lr = parse_real(flag, v);
  } else if (flag == "--warmup") {
    f.warmup = positive();
  } else if (flag == "--print-every") {
    f.print_every = positive();  // 0 and -5 became 1
  } else if (flag == "--precision") {
    expect<ConfigError>(v == "f32" || v == "bf16", "--precision must be f32 or bf16, not '", v,
                        "'");
    f.precision = v;
  } else {
    return false;
  }
  return true;
}

/// --token-format's value: llmc, raw_u16 or raw_i32 (ConfigError otherwise).
inline data::TokenFormat token_format_of(const std::string& v) {
  if (v == "llmc") return data::TokenFormat::llmc;
  if (v == "raw_u16") return data::TokenFormat::raw_u16;
  if (v == "raw_i32") return data::TokenFormat::raw_i32;
  raise<ConfigError>("--token-format must be llmc, raw_u16 or raw_i32, not '", v, "'");
}

/// --export-dtype's value: f32, bf16 or f16 (ConfigError otherwise).
inline DType export_dtype_of(const std::string& v) {
  if (v == "f32") return DType::f32;
  if (v == "bf16") return DType::bf16;
  if (v == "f16") return DType::f16;
  raise<ConfigError>("--export-dtype must be f32, bf16 or f16, not '", v, "'");
}

/// A flag's value, read whole and in range (cli_number.hpp): a bad one throws ConfigError naming
/// the flag.
struct FlagValue {
  const std::string& flag;
  const std::string& text;

  std::int64_t integer(std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) const {
    return parse_integer(flag, text, min, max);
  }
  /// A count: 1 to INT_MAX.
  std::int64_t positive() const { return integer(1, std::numeric_limits<int>::max()); }
  double real() const { return parse_real(flag, text); }
};

/// The flags both training examples take beside ConfigFlags. A program's Options derive from it
/// (setting `device` to its build's default first) and add their own.
struct RunFlags {
  std::string config;  ///< --config: a DeepSpeed JSON (else the program's built-in one)
  int ranks = 2;       ///< --ranks: threads of this process, without mpiexec
  ConfigFlags run;  ///< --steps, --batch, --grad-accum, --stage, --lr, --warmup, --precision, ...
  std::int64_t seq = 64;
  std::uint64_t seed = 1234;
  std::string data;  ///< --data: a text trained on as bytes (empty: the program's corpus)
  std::string tokens, val_tokens;                 ///< --tokens, --val-tokens: token files
  std::optional<data::TokenFormat> token_format;  ///< --token-format (empty: the program's)
  std::optional<std::int64_t> vocab;    ///< --vocab: the --tokens files' (train_gpt), the model's
  std::string init;                     ///< --init: weights to start from
  std::string export_path;              ///< --export: weights written at the end
  DType export_dtype = DType::f32;      ///< --export-dtype
  std::int64_t export_shard_bytes = 0;  ///< --export-shard-bytes (0: one file)
  std::string metrics;                  ///< --metrics: a JSONL file appended to
  std::string save_dir, resume;         ///< --save-dir, --resume latest|<tag>
  std::int64_t save_every = 0;          ///< --save-every
  std::string nvme_path;                ///< --nvme-path: ZeRO-Infinity's swap folder
  std::optional<int> tp;                ///< --tp: tensor-parallel size
  bool sp = false;                      ///< --sp alone: Megatron's sequence parallelism
  std::optional<int> ulysses;           ///< --sp N: Ulysses sequence-parallel size
  std::optional<int> pp, vpp;           ///< --pp, --vpp: pipeline stages, chunks a stage
  std::string schedule;                 ///< --schedule (empty: the config's, else 1f1b)
  bool offload_cpu = false;             ///< --offload-cpu: ZeRO-Offload on the GPU
  std::string device;                   ///< --device host|cuda
  std::int64_t activation_mb = 512;     ///< --activation-mb: the activation arena
  double temperature = 0.8;             ///< --temperature: the closing sample's (0: greedy)
  int top_k = 40;                       ///< --top-k: the closing sample's (0: every token)
  std::int64_t sample_bytes = 96;       ///< --sample-bytes: the closing sample's length (0: none)
};

/// Sets the switch (a flag without a value) argv[i] of f and returns true: --offload-cpu, and
/// --sp without a number after it (Megatron's sequence parallelism; --sp N is Ulysses); false for
/// another flag.
inline bool read_run_switch(int argc, char** argv, int i, RunFlags& f) {
  const std::string flag = argv[i];
  if (flag == "--offload-cpu") {
    f.offload_cpu = true;
  } else if (flag == "--sp" && !(i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9')) {
    f.sp = true;
  } else {
    return false;
  }
  return true;
}

/// Reads flag's value into f when flag is one of RunFlags' (ConfigFlags' among them) and returns
/// true; false for another flag. A bad value throws ConfigError naming the flag.
inline bool read_run_flag(const FlagValue& v, RunFlags& f) {
  const std::string& flag = v.flag;
  const auto count = [&] { return static_cast<int>(v.positive()); };
  if (read_config_flag(flag, v.text, f.run)) return true;
  if (flag == "--config") {
    f.config = v.text;
  } else if (flag == "--ranks") {
    f.ranks = count();
  } else if (flag == "--seq") {
    f.seq = v.positive();
  } else if (flag == "--seed") {
    f.seed = static_cast<std::uint64_t>(v.integer(0));  // -1 became 2^64 - 1
  } else if (flag == "--data") {
    f.data = v.text;
  } else if (flag == "--tokens") {
    f.tokens = v.text;
  } else if (flag == "--val-tokens") {
    f.val_tokens = v.text;
  } else if (flag == "--token-format") {
    f.token_format = token_format_of(v.text);
  } else if (flag == "--vocab") {
    f.vocab = v.positive();
  } else if (flag == "--init") {
    f.init = v.text;
  } else if (flag == "--export") {
    f.export_path = v.text;
  } else if (flag == "--export-dtype") {
    f.export_dtype = export_dtype_of(v.text);
  } else if (flag == "--export-shard-bytes") {
    f.export_shard_bytes = v.integer(0);
  } else if (flag == "--metrics") {
    f.metrics = v.text;
  } else if (flag == "--save-dir") {
    f.save_dir = v.text;
  } else if (flag == "--save-every") {
    f.save_every = v.positive();  // -2 never saved
  } else if (flag == "--resume") {
    f.resume = v.text;
  } else if (flag == "--nvme-path") {
    f.nvme_path = v.text;
  } else if (flag == "--tp") {
    f.tp = count();
  } else if (flag == "--sp") {
    f.ulysses = count();
  } else if (flag == "--pp") {
    f.pp = count();
  } else if (flag == "--vpp") {
    f.vpp = count();
  } else if (flag == "--schedule") {
    f.schedule = v.text;
  } else if (flag == "--device") {
    expect<ConfigError>(v.text == "host" || v.text == "cuda",
                        "--device must be host or cuda, not '", v.text, "'");
    f.device = v.text;
  } else if (flag == "--activation-mb") {
    f.activation_mb = v.integer(1, std::int64_t{1} << 40);  // MiB; 2^44 << 20 wrapped to 0
  } else if (flag == "--temperature") {
    f.temperature = v.real();
  } else if (flag == "--top-k") {
    f.top_k = static_cast<int>(v.integer(0, std::numeric_limits<int>::max()));
  } else if (flag == "--sample-bytes") {
    f.sample_bytes = v.integer();
  } else {
    return false;
  }
  return true;
}

/// Walks argv into f: RunFlags' switches and flags, then the program's own, own_switch(flag) ->
/// bool for a flag without a value and own_flag(const FlagValue&) -> bool for one with a value
/// (each returns whether it knew the flag); then check(f), where a program's checks of its flags
/// together throw ConfigError. An unknown flag, a missing value and any ConfigError end in
/// usage(why).
template <class Flags, class OwnSwitch, class OwnFlag, class Check, class Usage>
void parse_flags(int argc, char** argv, Flags& f, OwnSwitch&& own_switch, OwnFlag&& own_flag,
                 Check&& check, Usage&& usage) {
  static_assert(std::is_base_of_v<RunFlags, Flags>);
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (read_run_switch(argc, argv, i, f) || own_switch(flag)) continue;
      if (i + 1 >= argc) usage(flag + " needs a value");
      const std::string text = argv[++i];
      const FlagValue v{flag, text};
      if (!read_run_flag(v, f) && !own_flag(v)) usage("unknown flag " + flag);
    }
    check(f);
  } catch (const ConfigError& e) {
    usage(e.what());
  }
}

/// What RunFlags' flags need of each other, as a ConfigError naming the remedy.
inline void check_run_flags(const RunFlags& f) {
  expect<ConfigError>((f.save_every == 0 && f.resume.empty()) || !f.save_dir.empty(),
                      "--save-every and --resume need --save-dir");
  expect<ConfigError>(!f.token_format || !f.tokens.empty(),
                      "--token-format says how the --tokens files are stored");
  expect<ConfigError>(f.val_tokens.empty() || !f.tokens.empty(),
                      "--val-tokens is the validation file beside --tokens (a --data text is "
                      "split itself)");
  expect<ConfigError>(
      (f.export_shard_bytes == 0 && f.export_dtype == DType::f32) || !f.export_path.empty(),
      "--export-dtype and --export-shard-bytes describe --export's files");
  expect<ConfigError>(!f.offload_cpu || f.device == "cuda",
                      "--offload-cpu moves the optimizer from the GPU to the host: it needs "
                      "--device cuda");
  expect<ConfigError>(f.temperature >= 0 && f.top_k >= 0 && f.sample_bytes >= 0,
                      "--temperature, --top-k and --sample-bytes must be >= 0");
}

/// Writes the DeepSpeed keys of RunFlags' flags into the config's JSON j: the optimizer's offload
/// (--offload-cpu; --nvme-path, ZeRO-Infinity), sequence_parallel_size (--sp N) and the pipeline
/// (--pp, --vpp, --schedule).
inline void write_run_flags(nlohmann::json& j, const RunFlags& f) {
  if (f.offload_cpu) j["zero_optimization"]["offload_optimizer"]["device"] = "cpu";
  if (!f.nvme_path.empty()) {
    j["zero_optimization"]["offload_optimizer"]["device"] = "nvme";
    j["zero_optimization"]["offload_optimizer"]["nvme_path"] = f.nvme_path;
  }
  if (f.ulysses) j["sequence_parallel_size"] = *f.ulysses;
  if (f.pp) j["pipeline"]["stages"] = *f.pp;
  if (f.vpp) j["pipeline"]["virtual_stages"] = *f.vpp;
  if (!f.schedule.empty()) j["pipeline"]["schedule"] = f.schedule;
}

/// Sets the parsed config's tensor parallelism from --tp and --sp (Megatron's sequence
/// parallelism, which needs tp > 1).
inline void apply_tensor_parallel_flags(Config& c, const RunFlags& f) {
  if (f.tp) c.tensor_parallel.tp_size = *f.tp;
  // Megatron's sequence parallelism splits the tensor-parallel regions: at tp 1 it does nothing.
  expect<ConfigError>(!f.sp || c.tensor_parallel.tp_size > 1,
                      "--sp without a size is Megatron's sequence parallelism, which needs tensor "
                      "parallelism (--tp 2 or more); --sp N is Ulysses over N ranks");
  if (f.sp) c.tensor_parallel.sequence_parallel = true;
}

}  // namespace zero::examples
