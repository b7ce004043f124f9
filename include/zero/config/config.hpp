#pragma once
// zero::Config: a DeepSpeed-compatible JSON config. Keys and defaults follow DeepSpeed
// (runtime/config.py, runtime/zero/config.py, fp16 loss scaler); "auto" (HF Trainer style) leaves
// a value for the program to fill in (config/auto_values.hpp); every invalid value or
// inconsistent combination is a ConfigError naming the key path; unknown keys are collected as
// warnings naming the nearest known key. Every key read is listed in config/key_table.hpp, whose
// rows say whether zero applies it; the keys that have no effect are listed once in notices.

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/config/aio.hpp>
#include <zero/config/json_reader.hpp>
#include <zero/config/key_table.hpp>
#include <zero/config/moe.hpp>
#include <zero/config/observability.hpp>
#include <zero/config/pipeline.hpp>
#include <zero/config/tensor_parallel.hpp>
#include <zero/config/zero_optimization.hpp>
#include <zero/core/error.hpp>

namespace zero {

/// "fp16": dynamic loss scaling when loss_scale is 0 (DeepSpeed semantics).
struct Fp16Config {
  std::optional<bool> enabled = false;  ///< empty: "auto", the engine's Precision decides
  double loss_scale = 0;                ///< 0 = dynamic
  int initial_scale_power = 16;
  std::int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
};

/// "optimizer" or "scheduler": a type name and its parameters (numbers or lists of numbers);
/// parameters set to "auto" are listed in auto_params for the program to fill.
struct NamedParams {
  std::string type;
  std::map<std::string, std::vector<double>> params;  ///< scalars are one-element lists
  std::set<std::string> lists;  ///< the params given as JSON lists (betas), one element or more
  std::map<std::string, std::string> words;  ///< string parameters (scheduler warmup_type)
  std::vector<std::string> auto_params;

  /// The scalar parameter key, or fallback when absent or auto.
  double get(const std::string& key, double fallback) const {
    const auto it = params.find(key);
    return it == params.end() || it->second.empty() ? fallback : it->second.front();
  }
};

/// A whole training config.
struct Config {
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> train_micro_batch_size_per_gpu;
  std::optional<std::int64_t> gradient_accumulation_steps;
  std::optional<double> gradient_clipping = 0.0;  ///< 0 = off; empty = "auto"
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;  ///< print zero::profile's memory breakdown every steps_per_print
  std::string communication_data_type;  ///< empty: the model's dtype
  double comm_timeout_s = 300;          ///< zero's own key: deadline of every collective wait
  bool comm_timeout_given = false;      ///< comm_timeout_s was set (the engine then applies it)
  std::string nonfinite_policy;  ///< zero's own key: "skip" or "raise" on Inf/NaN; empty: skip
  Fp16Config fp16;
  std::optional<bool> bf16_enabled = false;  ///< empty: "auto"
  std::optional<NamedParams> optimizer;
  std::optional<NamedParams> scheduler;
  config::ZeroOptimizationConfig zero_optimization;
  config::AioConfig aio;                         ///< NVMe offload I/O (zero/offload)
  config::TensorParallelConfig tensor_parallel;  ///< tensor and sequence parallelism
  config::PipelineConfig pipeline;               ///< pipeline parallelism
  config::MoEConfig moe;                         ///< mixture of experts, expert parallelism
  std::int64_t sequence_parallel_size = 1;       ///< Ulysses sequence-parallel ranks
  config::FlopsProfilerConfig flops_profiler;    ///< zero::profile's FLOPs report
  config::CommsLoggerConfig comms_logger;        ///< zero::profile's communication summary
  std::vector<std::string> warnings;             ///< unknown keys and other non-fatal findings
  /// "accepted but has no effect in zero: <key> (<why>)", one per such key (see key_table.hpp).
  std::vector<std::string> notices;
  /// Key paths set to "auto", for the program to fill (config/auto_values.hpp).
  std::vector<std::string> auto_keys;
  /// The JSON this config was parsed from (the notices are recomputed from it once "auto" is
  /// filled, since whether a key takes effect can depend on the filled precision).
  nlohmann::json source;

  /// The largest batch-size key accepted (train_batch_size and its two factors).
  static constexpr std::int64_t max_batch_key = 2147483647;

  /// Parses a config; throws ConfigError naming the key path of the first bad value.
  static Config from_json(const nlohmann::json& j) {
    expect<ConfigError>(j.is_object(), "config: expected a JSON object at the top, got ",
                        j.type_name());
    Config c;
    auto log = std::make_shared<config::ReadLog>();
    config::JsonReader r(j, "", log);
    c.train_batch_size = r.integer("train_batch_size");
    c.train_micro_batch_size_per_gpu = r.integer("train_micro_batch_size_per_gpu");
    c.gradient_accumulation_steps = r.integer("gradient_accumulation_steps");
    // Batch sizes are counts of samples per step: positive, and below 2^31 so their products
    // with each other and the data-parallel size stay exact (resolve_batch).
    auto positive = [&](const char* key, const std::optional<std::int64_t>& v) {
      expect<ConfigError>(!v || (*v > 0 && *v <= max_batch_key), r.where(key), ": ", v.value_or(0),
                          " must be in [1, ", max_batch_key, "]");
    };
    positive("train_batch_size", c.train_batch_size);
    positive("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
    positive("gradient_accumulation_steps", c.gradient_accumulation_steps);
    if (c.train_batch_size && c.train_micro_batch_size_per_gpu && c.gradient_accumulation_steps) {
      const std::int64_t per_rank =
          *c.train_micro_batch_size_per_gpu * *c.gradient_accumulation_steps;
      expect<ConfigError>(*c.train_batch_size % per_rank == 0, r.where("train_batch_size"), ": ",
                          *c.train_batch_size, " is not train_micro_batch_size_per_gpu ",
                          *c.train_micro_batch_size_per_gpu, " x gradient_accumulation_steps ",
                          *c.gradient_accumulation_steps, " x a whole number of ranks");
    }
    c.gradient_clipping = r.number_or_auto("gradient_clipping", 0.0);
    expect<ConfigError>(c.gradient_clipping.value_or(0) >= 0, r.where("gradient_clipping"), ": ",
                        c.gradient_clipping.value_or(0), " must be >= 0 (0 turns clipping off)");
    c.prescale_gradients = r.boolean("prescale_gradients").value_or(false);
    c.gradient_predivide_factor = r.number("gradient_predivide_factor").value_or(1.0);
    expect<ConfigError>(c.gradient_predivide_factor > 0, r.where("gradient_predivide_factor"),
                        ": must be positive");
    c.steps_per_print = r.integer("steps_per_print").value_or(10);
    expect<ConfigError>(c.steps_per_print > 0, r.where("steps_per_print"), ": ", c.steps_per_print,
                        " must be positive");
    c.wall_clock_breakdown = r.boolean("wall_clock_breakdown").value_or(false);
    // DeepSpeed lowercases it; null is its default (the model's dtype).
    c.communication_data_type =
        config::lowercase(r.string_or_null("communication_data_type").value_or(""));
    if (!c.communication_data_type.empty()) {
      const auto& t = c.communication_data_type;
      expect<ConfigError>(t == "fp32" || t == "fp16" || t == "bf16",
                          r.where("communication_data_type"), ": '", t,
                          "' is not one of fp32, fp16, bf16");
    }
    const auto timeout = r.number("comm_timeout_s");
    c.comm_timeout_given = timeout.has_value();
    c.comm_timeout_s = timeout.value_or(300);
    expect<ConfigError>(c.comm_timeout_s > 0, r.where("comm_timeout_s"), ": ", c.comm_timeout_s,
                        " must be positive (seconds)");
    c.nonfinite_policy = r.string("nonfinite_policy").value_or("");
    expect<ConfigError>(
        c.nonfinite_policy.empty() || c.nonfinite_policy == "skip" || c.nonfinite_policy == "raise",
        r.where("nonfinite_policy"), ": '", c.nonfinite_policy, "' is not one of skip, raise");
    c.memory_breakdown = r.boolean("memory_breakdown").value_or(false);

    read_fp16(r.object("fp16"), c);
    {
      auto b = r.object("bf16");
      c.bf16_enabled = b.boolean_or_auto("enabled", false);
      config::read_inert(b);
      collect(b, c.warnings);
    }
    if (r.has("bfloat16")) {  // DeepSpeed's older spelling, read only without bf16 (as DeepSpeed)
      auto b = r.object("bfloat16");
      const std::optional<bool> enabled = b.boolean("enabled");
      if (r.has("bf16")) {
        // bf16 decides; a bfloat16.enabled given against a bf16.enabled given is refused.
        expect<ConfigError>(!enabled || !c.bf16_enabled || *c.bf16_enabled == *enabled,
                            "bfloat16.enabled: ", enabled.value_or(false) ? "true" : "false",
                            " contradicts bf16.enabled; write only bf16");
      } else {
        c.bf16_enabled = enabled.value_or(false);
      }
      config::read_inert(b);
      collect(b, c.warnings);
    }
    expect<ConfigError>(!(c.fp16.enabled.value_or(false) && c.bf16_enabled.value_or(false)),
                        "fp16.enabled and bf16.enabled are both true: choose one precision");
    if (r.has("optimizer"))
      c.optimizer = read_named(r.object("optimizer"), c.warnings, optimizer_types(), {});
    if (r.has("scheduler")) {
      c.scheduler =
          read_named(r.object("scheduler"), c.warnings, scheduler_types(), {"warmup_type"});
      warn_short_decay(*c.scheduler, c.warnings);
    }
    read_zero(r.object("zero_optimization"), c);
    {
      std::vector<std::string> unknown;
      c.aio = config::AioConfig::read(r.object("aio"), unknown);
      for (const auto& k : unknown) c.warnings.push_back(unknown_key_warning(k));
    }
    {
      std::vector<std::string> unknown;
      c.tensor_parallel = config::TensorParallelConfig::read(r.object("tensor_parallel"), unknown);
      c.tensor_parallel.merge_megatron(r);
      c.pipeline = config::PipelineConfig::read(r.object("pipeline"), unknown);
      c.pipeline.merge_megatron(r);
      check_pipeline_zero(r, c);
      c.moe = config::MoEConfig::read(r.object("moe"), unknown);
      c.sequence_parallel_size = r.int32("sequence_parallel_size").value_or(1);
      expect<ConfigError>(c.sequence_parallel_size >= 1, r.where("sequence_parallel_size"), " = ",
                          c.sequence_parallel_size, "; expected >= 1");
      c.flops_profiler = config::FlopsProfilerConfig::read(r.object("flops_profiler"), unknown);
      c.comms_logger = config::CommsLoggerConfig::read(r.object("comms_logger"), unknown);
      for (const auto& k : unknown) c.warnings.push_back(unknown_key_warning(k));
    }
    config::read_inert(r);  // the keys and whole sections listed without effect
    collect(r, c.warnings);
    finish(j, *log, c);
    return c;
  }
  /// Parses JSON text; parse errors name the position.
  static Config from_json_string(const std::string& text) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      raise<ConfigError>("config: invalid JSON: ", e.what());
    }
    return from_json(j);
  }
  /// Parses a JSON file; errors name the file.
  static Config from_json_file(const std::string& path) {
    std::ifstream in(path);
    expect<ConfigError>(in.good(), "config: cannot open '", path, "'");
    std::stringstream text;
    text << in.rdbuf();
    try {
      return from_json_string(text.str());
    } catch (const ConfigError& e) {
      raise<ConfigError>(path, ": ", e.what());
    }
  }

  /// Resolved batch sizes: train = micro * accumulation * dp.
  struct BatchSizes {
    std::int64_t train, micro, accumulation;
  };
  /// Applies DeepSpeed's batch-size rule for data-parallel size dp: any two of train, micro and
  /// accumulation give the third; one of train or micro alone means accumulation 1; all three
  /// must agree. Throws ConfigError with the numbers when they cannot.
  BatchSizes resolve_batch(std::int64_t dp) const {
    expect<ConfigError>(dp > 0 && dp <= max_batch_key, "resolve_batch: data-parallel size ", dp,
                        " must be in [1, ", max_batch_key, "]");
    // Each factor is below 2^31 (from_json), so two of them multiply exactly; three may not.
    const auto product = [&](std::int64_t a, std::int64_t b, std::int64_t c) {
      std::int64_t ab = 0, abc = 0;
      expect<ConfigError>(
          !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc),
          "train_micro_batch_size_per_gpu ", a, " x gradient_accumulation_steps ", b,
          " x data-parallel size ", c, " overflows a 64-bit batch size");
      return abc;
    };
    const auto& t = train_batch_size;
    const auto& m = train_micro_batch_size_per_gpu;
    const auto& g = gradient_accumulation_steps;
    BatchSizes b{};
    if (t && m && g) {
      b = {*t, *m, *g};
    } else if (t && m) {
      expect<ConfigError>(*t % (*m * dp) == 0, "train_batch_size ", *t,
                          " is not divisible by train_micro_batch_size_per_gpu ", *m,
                          " x data-parallel size ", dp);
      b = {*t, *m, *t / (*m * dp)};
    } else if (t && g) {
      expect<ConfigError>(*t % (*g * dp) == 0, "train_batch_size ", *t,
                          " is not divisible by gradient_accumulation_steps ", *g,
                          " x data-parallel size ", dp);
      b = {*t, *t / (*g * dp), *g};
    } else if (m && g) {
      b = {product(*m, *g, dp), *m, *g};
    } else if (t) {
      expect<ConfigError>(*t % dp == 0, "train_batch_size ", *t,
                          " is not divisible by the data-parallel size ", dp);
      b = {*t, *t / dp, 1};
    } else if (m) {
      b = {*m * dp, *m, 1};
    } else {
      raise<ConfigError>(
          "train_batch_size or train_micro_batch_size_per_gpu must be given "
          "(gradient_accumulation_steps alone does not fix the batch)");
    }
    expect<ConfigError>(b.train == product(b.micro, b.accumulation, dp), "train_batch_size ",
                        b.train, " != train_micro_batch_size_per_gpu ", b.micro,
                        " x gradient_accumulation_steps ", b.accumulation, " x data-parallel size ",
                        dp);
    return b;
  }

  /// Fills "auto" bucket sizes from the model's hidden size with HF Trainer's rules
  /// (reduce_bucket_size = hidden^2, prefetch = 0.9 hidden^2, persistence = 10 hidden).
  void resolve_auto_buckets(std::int64_t hidden) {
    auto& z = zero_optimization;
    if (!z.reduce_bucket_size) z.reduce_bucket_size = hidden * hidden;
    if (!z.stage3_prefetch_bucket_size) z.stage3_prefetch_bucket_size = hidden * hidden * 9 / 10;
    if (!z.stage3_param_persistence_threshold) z.stage3_param_persistence_threshold = 10 * hidden;
  }

 private:
  static const std::vector<std::string>& optimizer_types() {
    static const std::vector<std::string> types = {"Adam", "AdamW",   "SGD",    "Lion",
                                                   "LAMB", "RMSprop", "Adagrad"};
    return types;
  }
  static const std::vector<std::string>& scheduler_types() {
    static const std::vector<std::string> types = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                                   "OneCycle", "LRRangeTest"};
    return types;
  }

  // DeepSpeed's warning for a decay that ends before its warmup does (the run never reaches
  // the lr it warms up to, or drops from it at once): total_num_steps < warmup_num_steps, its
  // default 1000 included; not judged while either is "auto".
  static void warn_short_decay(const NamedParams& s, std::vector<std::string>& warnings) {
    if (s.type != "WarmupDecayLR" && s.type != "WarmupCosineLR") return;
    const auto given = [&](const char* key) { return s.params.contains(key); };
    const auto is_auto = [&](const char* key) {
      return std::find(s.auto_params.begin(), s.auto_params.end(), key) != s.auto_params.end();
    };
    if (!given("total_num_steps") || is_auto("warmup_num_steps")) return;
    const double total = s.get("total_num_steps", 0.0);
    const double warmup = s.get("warmup_num_steps", 1000.0);
    if (total < warmup) {
      warnings.push_back(zero::detail::concat("scheduler.params.total_num_steps: ", total,
                                              " is less than warmup_num_steps ", warmup, " (",
                                              s.type, " decays before its warmup ends)"));
    }
  }

  static void collect(const config::JsonReader& r, std::vector<std::string>& warnings) {
    for (const auto& k : r.unknown_keys()) warnings.push_back(unknown_key_warning(k));
  }
  static std::string unknown_key_warning(const std::string& path) {
    const std::string near = config::nearest_key(path);
    return "unknown key " + path + " (ignored" +
           (near.empty() ? "" : "; did you mean " + near + "?") + ")";
  }

  // Keys that may be "auto": the ones a program fills (auto_values.hpp), and sizes whose
  // DeepSpeed default serves. Any other "auto" would silently become a default: an error.
  static bool may_be_auto(const std::string& path) {
    static const std::vector<std::string> allowed = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "pipeline.stages"};
    return std::find(allowed.begin(), allowed.end(), path) != allowed.end() ||
           path.starts_with("optimizer.params.") || path.starts_with("scheduler.params.");
  }

  // After parsing: every key read must be in the key table (a parser change that forgets the
  // table is caught by any config that sets the key), "auto" only where a program fills it,
  // and the notices of the keys without effect.
  static void finish(const nlohmann::json& j, const config::ReadLog& log, Config& c) {
    for (const auto& path : log.read) {
      expect<Error>(config::find_key(path) != nullptr, "config: the parser reads ", path,
                    " but config/key_table.hpp does not list it (say whether zero applies it)");
    }
    for (const auto& path : log.autos) {
      expect<ConfigError>(may_be_auto(path), path,
                          ": \"auto\" is not filled in for this key; give a value");
      c.auto_keys.push_back(path);
    }
    for (const auto& [kind, named] :
         {std::pair{"optimizer", &c.optimizer}, std::pair{"scheduler", &c.scheduler}}) {
      if (*named) {
        for (const auto& p : (*named)->auto_params) {
          c.auto_keys.push_back(std::string(kind) + ".params." + p);
        }
      }
    }
    c.source = j;
    c.notices = config::no_effect_notices(j);
  }

  // A pipeline runs several micro-batches through each stage per step; ZeRO-2 and ZeRO-3 would
  // put a collective inside every one of them, which DeepSpeed refuses too.
  static void check_pipeline_zero(const config::JsonReader& r, const Config& c) {
    const int stage = c.zero_optimization.stage;
    if (c.pipeline.stages == 1 || stage < 2) return;
    const std::string size_key = r.has("pipeline_model_parallel_size")
                                     ? r.where("pipeline_model_parallel_size")
                                     : "pipeline.stages";
    raise<ConfigError>(
        size_key, " = ", c.pipeline.stages, " with zero_optimization.stage = ", stage,
        ": pipeline parallelism works with ZeRO stage 0 or 1 only. ",
        stage == 2 ? "ZeRO-2 would reduce-scatter the gradients after every micro-batch of the "
                     "pipeline"
                   : "ZeRO-3 would gather each stage's parameters for every micro-batch's "
                     "forward and backward",
        ", instead of once per step; DeepSpeed refuses both ZeRO-2 and ZeRO-3 with a pipeline. "
        "Set zero_optimization.stage to 0 or 1, or pipeline.stages to 1");
  }

  static void read_fp16(config::JsonReader f, Config& c) {
    c.fp16.enabled = f.boolean_or_auto("enabled", false);
    c.fp16.loss_scale = f.number("loss_scale").value_or(0);
    // Range-checked before they narrow to int (4294967312 is not 16).
    c.fp16.initial_scale_power = f.int32("initial_scale_power").value_or(16);
    c.fp16.loss_scale_window = f.integer("loss_scale_window").value_or(1000);
    c.fp16.hysteresis = f.int32("hysteresis").value_or(2);
    c.fp16.consecutive_hysteresis = f.boolean("consecutive_hysteresis").value_or(false);
    c.fp16.min_loss_scale = f.number("min_loss_scale").value_or(1);
    expect<ConfigError>(c.fp16.loss_scale >= 0, f.where("loss_scale"), ": ", c.fp16.loss_scale,
                        " must be >= 0 (0 = dynamic)");
    expect<ConfigError>(c.fp16.initial_scale_power >= 0 && c.fp16.initial_scale_power <= 63,
                        f.where("initial_scale_power"), ": ", c.fp16.initial_scale_power,
                        " must be in [0, 63]");
    expect<ConfigError>(c.fp16.loss_scale_window > 0, f.where("loss_scale_window"), ": ",
                        c.fp16.loss_scale_window, " must be positive");
    expect<ConfigError>(c.fp16.hysteresis > 0, f.where("hysteresis"), ": ", c.fp16.hysteresis,
                        " must be positive");
    expect<ConfigError>(c.fp16.min_loss_scale > 0, f.where("min_loss_scale"), ": ",
                        c.fp16.min_loss_scale, " must be positive");
    config::read_inert(f);
    collect(f, c.warnings);
  }

  // words: the parameters whose values are strings (checked by the one who reads them).
  static NamedParams read_named(config::JsonReader r, std::vector<std::string>& warnings,
                                const std::vector<std::string>& known,
                                const std::vector<std::string>& words) {
    NamedParams n;
    auto type = r.string("type");
    expect<ConfigError>(type.has_value(), r.where("type"), ": required");
    n.type = *type;
    bool ok = false;
    std::string list;
    for (const auto& k : known) {
      list += (list.empty() ? "" : ", ") + k;
      if (config::lowercase(k) == config::lowercase(n.type)) {
        n.type = k;  // DeepSpeed matches type names case-insensitively
        ok = true;
      }
    }
    expect<ConfigError>(ok, r.where("type"), ": '", *type, "' is not supported; expected one of ",
                        list);
    const nlohmann::json params = r.raw("params");
    if (!params.is_null()) {
      expect<ConfigError>(params.is_object(), r.where("params"), ": expected an object");
      for (const auto& [key, value] : params.items()) {
        const std::string path = r.where("params") + "." + key;
        if (value.is_string() && value.get<std::string>() == "auto") {
          n.auto_params.push_back(key);
        } else if (value.is_boolean()) {
          // DeepSpeed's boolean params (amsgrad, torch_adam, adam_w_mode) as 0/1; nlohmann
          // does not convert a boolean to a number itself (found by fuzz_config).
          n.params[key] = {value.get<bool>() ? 1.0 : 0.0};
        } else if (value.is_number()) {
          n.params[key] = {value.get<double>()};
        } else if (value.is_array()) {
          std::vector<double> v;
          for (const auto& e : value) {
            expect<ConfigError>(e.is_number(), path, ": expected numbers, got ", value.dump());
            v.push_back(e.get<double>());
          }
          n.params[key] = v;
          n.lists.insert(key);
        } else if (value.is_string() && std::find(words.begin(), words.end(), key) != words.end()) {
          n.words[key] = value.get<std::string>();
        } else {  // "lr": "fast" included: never a warning and a default
          raise<ConfigError>(path, ": expected a number, a list of numbers or \"auto\", got ",
                             value.dump());
        }
      }
    }
    collect(r, warnings);
    return n;
  }

  static void read_zero(config::JsonReader z, Config& c) {
    auto& o = c.zero_optimization;
    const auto stage = z.integer("stage").value_or(0);
    expect<ConfigError>(stage >= 0 && stage <= 3, z.where("stage"), ": ", stage,
                        " is not a ZeRO stage; expected 0, 1, 2 or 3");
    o.stage = static_cast<int>(stage);
    o.contiguous_gradients = z.boolean("contiguous_gradients").value_or(true);
    o.reduce_scatter = z.boolean("reduce_scatter").value_or(true);
    o.overlap_comm = z.boolean("overlap_comm").value_or(o.stage == 3);
    o.allgather_partitions = z.boolean("allgather_partitions").value_or(true);
    // Sizes in elements: a bucket or group of 0 elements cannot hold anything (positive);
    // a prefetch window, persistence threshold or reuse distance of 0 turns the feature off.
    auto sized = [&](const char* key, std::int64_t fallback, bool zero_ok = false) {
      const auto v = z.integer_or_auto(key, fallback);
      expect<ConfigError>(!v || *v > 0 || (zero_ok && *v == 0), z.where(key), ": ", v.value_or(0),
                          zero_ok ? " must be >= 0" : " must be positive (elements)");
      return v;
    };
    o.reduce_bucket_size = sized("reduce_bucket_size", 500'000'000);
    o.allgather_bucket_size = sized("allgather_bucket_size", 500'000'000).value_or(500'000'000);
    o.sub_group_size_given = z.has("sub_group_size") && !z.is_auto("sub_group_size");
    o.sub_group_size = sized("sub_group_size", 1'000'000'000).value_or(1'000'000'000);
    o.stage3_prefetch_bucket_size = sized("stage3_prefetch_bucket_size", 50'000'000, true);
    o.stage3_param_persistence_threshold =
        sized("stage3_param_persistence_threshold", 100'000, true);
    o.stage3_max_live_parameters =
        sized("stage3_max_live_parameters", 1'000'000'000).value_or(1'000'000'000);
    o.stage3_max_reuse_distance =
        sized("stage3_max_reuse_distance", 1'000'000'000, true).value_or(1'000'000'000);
    // DeepSpeed's -1 (and 0) turn it off; a size that does not divide the data-parallel group is
    // the engine's to refuse (the config does not know the world).
    o.mics_shard_size = z.integer("mics_shard_size").value_or(-1);
    expect<ConfigError>(o.mics_shard_size >= -1, z.where("mics_shard_size"), ": ",
                        o.mics_shard_size, " must be positive, or -1 (off)");
    if (o.mics_shard_size == 0) o.mics_shard_size = -1;
    o.zero_hpz_partition_size = z.integer("zero_hpz_partition_size").value_or(1);
    expect<ConfigError>(o.zero_hpz_partition_size >= 1, z.where("zero_hpz_partition_size"), ": ",
                        o.zero_hpz_partition_size, " must be positive (1: off)");
    o.zero_quantized_weights = z.boolean("zero_quantized_weights").value_or(false);
    o.zero_quantized_gradients = z.boolean("zero_quantized_gradients").value_or(false);
    o.zero_quantized_gradient_bits = z.integer("zero_quantized_gradient_bits");
    expect<ConfigError>(!o.zero_quantized_gradient_bits || *o.zero_quantized_gradient_bits == 8 ||
                            *o.zero_quantized_gradient_bits == 4,
                        z.where("zero_quantized_gradient_bits"), ": ",
                        o.zero_quantized_gradient_bits.value_or(0),
                        " is not 8 or 4 (the bits of a quantized gradient's code)");
    config::JsonReader l = z.object("zeropp_loco_param");
    if (z.has("zeropp_loco_param") && !z.is_null("zeropp_loco_param")) {  // None: off
      config::LocoConfig loco;
      loco.err_beta = l.number("err_beta").value_or(loco.err_beta);
      loco.reset_T = l.integer("reset_T").value_or(loco.reset_T);
      expect<ConfigError>(loco.err_beta >= 0 && loco.err_beta < 1, l.where("err_beta"), ": ",
                          loco.err_beta,
                          " must be in [0, 1) (the share of the old error LoCo keeps)");
      expect<ConfigError>(loco.reset_T >= 1, l.where("reset_T"), ": ", loco.reset_T,
                          " must be at least 1 (reductions between resets of LoCo's errors)");
      for (const auto& k : l.unknown_keys()) c.warnings.push_back(unknown_key_warning(k));
      o.zeropp_loco_param = loco;
    }
    o.stage3_gather_16bit_weights_on_model_save =
        z.boolean("stage3_gather_16bit_weights_on_model_save").value_or(false) ||
        z.boolean("stage3_gather_fp16_weights_on_model_save").value_or(false);
    std::vector<std::string> unknown;
    o.offload_optimizer = config::OffloadConfig::read(z.object("offload_optimizer"), 4, unknown);
    o.offload_param = config::OffloadConfig::read(z.object("offload_param"), 5, unknown);
    for (const auto& k : unknown) c.warnings.push_back(unknown_key_warning(k));
    // DeepSpeed refuses the deprecated spelling beside the section that replaced it.
    expect<ConfigError>(!(z.has("cpu_offload") && z.has("offload_optimizer")),
                        z.where("cpu_offload"), " is the deprecated spelling of ",
                        z.where("offload_optimizer"), "; give only one of them");
    if (z.boolean("cpu_offload").value_or(false)) {  // deprecated spelling
      o.offload_optimizer.device = OffloadDevice::cpu;
      c.warnings.push_back(z.where("cpu_offload") +
                           " is deprecated: use offload_optimizer.device = cpu");
    }
    expect<ConfigError>(!(z.has("cpu_offload_param") && z.has("offload_param")),
                        z.where("cpu_offload_param"), " is the deprecated spelling of ",
                        z.where("offload_param"), "; give only one of them");
    if (z.boolean("cpu_offload_param").value_or(false)) {  // deprecated spelling
      o.offload_param.device = OffloadDevice::cpu;
      c.warnings.push_back(z.where("cpu_offload_param") +
                           " is deprecated: use offload_param.device = cpu");
    }
    expect<ConfigError>(o.offload_param.device == OffloadDevice::none || o.stage == 3,
                        z.where("offload_param"),
                        ": parameter offload needs stage 3, the config has stage ", o.stage);
    expect<ConfigError>(o.offload_optimizer.device == OffloadDevice::none || o.stage >= 1,
                        z.where("offload_optimizer"),
                        ": optimizer offload needs stage 1, 2 or 3, the config has stage ",
                        o.stage);
    config::read_inert(z);
    collect(z, c.warnings);
  }
};

}  // namespace zero
