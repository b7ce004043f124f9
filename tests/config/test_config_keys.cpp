// The key table (config/key_table.hpp): every key zero knows is either applied or reported once
// as without effect, unknown keys name their nearest known key, "auto" is filled from the
// program's values (config/auto_values.hpp), and a set of bad configs a user might write is
// refused with the key path named.
#include <algorithm>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/config.hpp>
#include <zero/config/auto_values.hpp>
#include <zero/config/key_table.hpp>

using zero::Config;
using zero::ConfigError;
using zero::config::KeyEffect;

namespace {

// Sets the dotted path of root to value, creating the objects on the way.
void set_path(nlohmann::json& root, std::string_view path, const nlohmann::json& value) {
  nlohmann::json* node = &root;
  while (true) {
    const std::size_t dot = path.find('.');
    const std::string key(path.substr(0, dot));
    if (dot == std::string_view::npos) {
      (*node)[key] = value;
      return;
    }
    node = &(*node)[key];
    path = path.substr(dot + 1);
  }
}

bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

// The notice of key (its path followed by the reason's parenthesis).
bool noticed(const Config& c, std::string_view key) {
  return mentions(c.notices, "no effect in zero: " + std::string(key) + " (");
}

}  // namespace

TEST_CASE("every known key is read by the parser and is either applied or reported once",
          "[unit][config]") {
  // A base that lets every sample parse: stage 3 (stage-3 keys apply), an optimizer and a
  // schedule to hold params.
  const nlohmann::json base = {{"zero_optimization", {{"stage", 3}}},
                               {"optimizer", {{"type", "AdamW"}}},
                               {"scheduler", {{"type", "WarmupLR"}}}};
  REQUIRE(Config::from_json(base).notices.empty());
  int applied = 0, inert = 0;
  for (const auto& key : zero::config::known_keys()) {
    INFO(key.path);
    nlohmann::json j = base;
    set_path(j, key.path, nlohmann::json::parse(key.sample));
    if (key.path.ends_with(".nvme_path")) {
      set_path(j, std::string(key.path.substr(0, key.path.rfind('.'))) + ".device", "nvme");
    }
    if (key.path.ends_with("offload_optimizer.device") ||
        key.path.ends_with("offload_param.device")) {
      set_path(j, std::string(key.path.substr(0, key.path.rfind('.'))) + ".nvme_path", "/tmp");
    }
    if (key.path.starts_with("moe.") && key.path != "moe.num_experts") {
      // The MoE settings need MoE layers: ep_size > 1 without them is refused.
      set_path(j, "moe.num_experts", 4);
      if (key.path == "moe.top2_2nd_expert_sampling") set_path(j, "moe.k", 2);  // top-2's
    }
    if (key.path.find("virtual") != std::string_view::npos) {
      // Chunks per stage need stages; "auto" leaves them to the program (stage 3 refuses more
      // than one).
      set_path(j, "pipeline.stages", "auto");
    }
    const Config c = Config::from_json(j);
    // Read by the parser: no "unknown key" warning for it.
    CHECK_FALSE(mentions(c.warnings, "unknown key " + std::string(key.path)));
    CHECK(!key.why.empty());
    if (!key.default_value.empty()) {  // the sample must ask for something
      CHECK(nlohmann::json::parse(key.sample) != nlohmann::json::parse(key.default_value));
    }
    if (key.effect == KeyEffect::no_effect) {
      // Every sample differs from DeepSpeed's default, so the key is reported, exactly once.
      CHECK(std::count_if(c.notices.begin(), c.notices.end(), [&](const std::string& n) {
              return n.find(": " + std::string(key.path) + " (") != std::string::npos;
            }) == 1);
      CHECK(noticed(c, key.path));
      ++inert;
    } else {
      // Applied keys are silent where they take effect: at stage 3 with fp16 and NVMe where
      // they need them.
      nlohmann::json live = j;
      set_path(live, "fp16.enabled",
               key.path == "bf16.enabled" || key.path == "bfloat16.enabled" ? false : true);
      if (key.path == "communication_data_type") set_path(live, "fp16.enabled", false);
      // (cpu_offload and cpu_offload_param are deprecated spellings of the offload sections:
      // not given beside them.)
      if (key.path == "zero_optimization.offload_optimizer.ratio") {
        // Twin-Flow keeps part of CPU offload's states on the device.
        set_path(live, "zero_optimization.offload_optimizer.device", "cpu");
      } else if (!key.path.ends_with(".device") && key.path != "zero_optimization.cpu_offload" &&
                 key.path != "zero_optimization.cpu_offload_param") {
        // offload_param's swap keys act when it is the section on nvme (alone: with
        // offload_optimizer on nvme too, that section's buffers are used).
        const std::string section = key.path.starts_with("zero_optimization.offload_param.")
                                        ? "zero_optimization.offload_param"
                                        : "zero_optimization.offload_optimizer";
        set_path(live, section + ".device", "nvme");
        set_path(live, section + ".nvme_path", "/tmp");
      }
      if (key.path == "zero_optimization.overlap_comm") set_path(live, key.path, true);
      if (key.path == "zero_optimization.zero_quantized_gradient_bits" ||
          key.path.starts_with("zero_optimization.zeropp_loco_param.")) {
        set_path(live, "zero_optimization.zero_quantized_gradients", true);
      }
      CHECK_FALSE(noticed(Config::from_json(live), key.path));
      ++applied;
    }
  }
  CHECK(applied > 30);
  CHECK(inert > 30);
}

TEST_CASE("every key the offload sections read is in the key table, in both sections",
          "[unit][config]") {
  // OffloadConfig::read serves both sections; a key it reads that the table lacks for one of
  // them would be an internal error at parse time.
  const nlohmann::json section = {{"device", "nvme"},      {"nvme_path", "/tmp"},
                                  {"buffer_count", 2},     {"buffer_size", 1000000},
                                  {"max_in_cpu", 1000000}, {"pin_memory", true},
                                  {"pipeline_read", true}, {"pipeline_write", true},
                                  {"ratio", 0.5},          {"fast_init", true}};
  const nlohmann::json j = {
      {"zero_optimization",
       {{"stage", 3}, {"offload_optimizer", section}, {"offload_param", section}}}};
  const Config c = Config::from_json(j);
  CHECK(c.warnings.empty());
  CHECK(noticed(c, "zero_optimization.offload_optimizer.max_in_cpu"));
  CHECK(noticed(c, "zero_optimization.offload_param.ratio"));
  // With both sections on nvme one swapper holds both, with offload_optimizer's buffers.
  CHECK(noticed(c, "zero_optimization.offload_param.pin_memory"));
  CHECK(noticed(c, "zero_optimization.offload_param.buffer_count"));
  CHECK_FALSE(noticed(c, "zero_optimization.offload_optimizer.pin_memory"));
  // offload_param alone on nvme: its swap buffers are the ones used.
  nlohmann::json cpu = section;
  cpu["device"] = "cpu";
  const Config params_only =
      Config::from_json({{"zero_optimization",
                          {{"stage", 3}, {"offload_optimizer", cpu}, {"offload_param", section}}}});
  CHECK_FALSE(noticed(params_only, "zero_optimization.offload_param.pin_memory"));
  CHECK_FALSE(noticed(params_only, "zero_optimization.offload_param.buffer_count"));
}

TEST_CASE("applied keys say so when this configuration gives them nothing to do",
          "[unit][config]") {
  const Config stage1 = Config::from_json_string(
      R"({"zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 1000,
                                "stage3_max_live_parameters": 5000, "sub_group_size": 1000,
                                "zero_hpz_partition_size": 8, "zero_quantized_weights": true,
                                "zero_quantized_gradients": true},
          "fp16": {"loss_scale_window": 100}, "aio": {"queue_depth": 4}})");
  CHECK(noticed(stage1, "zero_optimization.stage3_prefetch_bucket_size"));
  CHECK(noticed(stage1, "zero_optimization.stage3_max_live_parameters"));
  CHECK(noticed(stage1, "zero_optimization.sub_group_size"));
  CHECK(noticed(stage1, "fp16.loss_scale_window"));
  CHECK(noticed(stage1, "aio.queue_depth"));
  CHECK(noticed(stage1, "zero_optimization.zero_hpz_partition_size"));
  CHECK(noticed(stage1, "zero_optimization.zero_quantized_weights"));
  CHECK(noticed(stage1, "zero_optimization.zero_quantized_gradients"));
  CHECK(stage1.notices.size() == 8);

  const Config stage3 = Config::from_json_string(
      R"({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                                "stage3_max_live_parameters": 5000,
                                "zero_hpz_partition_size": 8, "zero_quantized_weights": true,
                                "zero_quantized_gradients": true,
                                "zero_quantized_gradient_bits": 4}})");
  CHECK(stage3.notices.empty());
  // qgZ's bits without qgZ.
  const Config bits = Config::from_json_string(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_gradient_bits": 4}})");
  CHECK(noticed(bits, "zero_optimization.zero_quantized_gradient_bits"));
  CHECK(mentions(bits.notices, "only qgZ packs gradients"));
  // A stage written as a whole float runs as that stage (the parser accepts 3.0), and the
  // notices agree with it: they read it as stage 0 before.
  const Config stage3_float = Config::from_json_string(
      R"({"zero_optimization": {"stage": 3.0, "stage3_max_live_parameters": 5000},
          "bf16": {"enabled": true}, "communication_data_type": "bf16"})");
  CHECK(stage3_float.zero_optimization.stage == 3);
  CHECK(stage3_float.notices.empty());

  // communication_data_type: applied when it names what zero reduces in.
  CHECK(Config::from_json_string(R"({"communication_data_type": "fp32"})").notices.empty());
  CHECK(noticed(Config::from_json_string(R"({"communication_data_type": "bf16"})"),
                "communication_data_type"));
  CHECK(Config::from_json_string(R"({"communication_data_type": "bf16", "bf16": {"enabled": true},
                                     "zero_optimization": {"stage": 2}})")
            .notices.empty());
  // As DeepSpeed: any case, and null (its default) is no type given.
  const Config upper = Config::from_json_string(R"({"communication_data_type": "BF16"})");
  CHECK(upper.communication_data_type == "bf16");
  CHECK(noticed(upper, "communication_data_type"));
  CHECK(Config::from_json_string(R"({"communication_data_type": "FP32"})").notices.empty());
  const Config null_type = Config::from_json_string(R"({"communication_data_type": null})");
  CHECK(null_type.communication_data_type.empty());
  CHECK(null_type.warnings.empty());
  CHECK(null_type.notices.empty());
  // overlap_comm: zero always overlaps, so only false is without effect.
  CHECK(
      Config::from_json_string(R"({"zero_optimization": {"overlap_comm": true}})").notices.empty());
  CHECK(noticed(Config::from_json_string(R"({"zero_optimization": {"overlap_comm": false}})"),
                "zero_optimization.overlap_comm"));
  // A no-effect key at DeepSpeed's default is honoured: no notice.
  CHECK(Config::from_json_string(R"({"dump_state": false,
                                     "zero_optimization": {"contiguous_gradients": true}})")
            .notices.empty());
  CHECK(noticed(Config::from_json_string(R"({"dump_state": true})"), "dump_state"));
}

TEST_CASE("unknown keys warn with the nearest known key", "[unit][config]") {
  const Config c = Config::from_json_string(
      R"({"train_batch_szie": 8, "gradient_clippping": 1.0,
          "zero_optimization": {"stage": 2, "reduce_bucket_sise": 100, "overlapcomm": true,
                                "offload_optimizer": {"devise": "cpu"}},
          "stage3_prefetch_bucket_size": 100, "completely_unrelated_setting": 1})");
  CHECK(mentions(c.warnings,
                 "unknown key train_batch_szie (ignored; did you mean "
                 "train_batch_size?)"));
  CHECK(mentions(c.warnings, "gradient_clippping (ignored; did you mean gradient_clipping?)"));
  CHECK(mentions(c.warnings,
                 "zero_optimization.reduce_bucket_sise (ignored; did you mean "
                 "zero_optimization.reduce_bucket_size?)"));
  CHECK(mentions(c.warnings, "did you mean zero_optimization.overlap_comm?"));
  CHECK(mentions(c.warnings,
                 "zero_optimization.offload_optimizer.devise (ignored; did you mean "
                 "zero_optimization.offload_optimizer.device?)"));
  // A key in the wrong section finds its place.
  CHECK(mentions(c.warnings,
                 "unknown key stage3_prefetch_bucket_size (ignored; did you mean "
                 "zero_optimization.stage3_prefetch_bucket_size?)"));
  // Nothing close: no suggestion.
  CHECK(mentions(c.warnings, "unknown key completely_unrelated_setting (ignored)"));
  CHECK(c.warnings.size() == 7);
  // A misspelled section is a key too (the stage in it went unread, and the run trained at 0).
  CHECK(mentions(Config::from_json_string(R"({"zero_optimisation": {"stage": 3}})").warnings,
                 "unknown key zero_optimisation (ignored; did you mean zero_optimization?)"));
  CHECK(zero::config::edit_distance("kitten", "sitting") == 3);
  CHECK(zero::config::nearest_key("zzz").empty());
}

TEST_CASE("bad configs a user might write are refused with the key path named", "[unit][config]") {
  struct Bad {
    const char* json;
    const char* names;
  };
  const Bad bad[] = {
      // wrong types
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})", "optimizer.params.lr"},
      {R"({"optimizer": {"type": "AdamW", "params": {"betas": ["0.9", 0.99]}}})",
       "optimizer.params.betas"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}})",
       "scheduler.params.warmup_num_steps"},
      {R"({"train_batch_size": "32"})", "train_batch_size: expected an integer"},
      {R"({"train_micro_batch_size_per_gpu": 2.5})", "train_micro_batch_size_per_gpu"},
      {R"({"gradient_clipping": "1.0"})", "gradient_clipping: expected a number"},
      {R"({"steps_per_print": true})", "steps_per_print"},
      {R"({"wall_clock_breakdown": "yes"})", "wall_clock_breakdown: expected true or false"},
      {R"({"memory_breakdown": 1})", "memory_breakdown: expected true or false"},
      {R"({"fp16": {"enabled": "true"}})", "fp16.enabled: expected true or false"},
      {R"({"bf16": true})", "bf16: expected an object"},
      {R"({"fp16": {"auto_cast": "no"}})", "fp16.auto_cast: expected true or false"},
      {R"({"zero_optimization": {"overlap_comm": "true"}})", "zero_optimization.overlap_comm"},
      {R"({"zero_optimization": {"round_robin_gradients": 1}})",
       "zero_optimization.round_robin_gradients: expected true or false"},
      {R"({"zero_optimization": {"zero_quantized_weights": "on"}})",
       "zero_optimization.zero_quantized_weights"},
      {R"({"zero_optimization": {"zero_quantized_gradients": 1}})",
       "zero_optimization.zero_quantized_gradients: expected true or false"},
      {R"({"zero_optimization": {"offload_optimizer": {"pin_memory": "yes"}, "stage": 1}})",
       "zero_optimization.offload_optimizer.pin_memory"},
      {R"({"activation_checkpointing": true})", "activation_checkpointing: expected an object"},
      {R"({"comm_timeout_s": "5m"})", "comm_timeout_s: expected a number"},
      {R"({"communication_data_type": 16})", "communication_data_type: expected a string"},
      {R"({"aio": {"queue_depth": "deep"}})", "aio.queue_depth"},
      // out of range
      {R"({"zero_optimization": {"reduce_bucket_size": 0}})",
       "zero_optimization.reduce_bucket_size: 0 must be positive"},
      {R"({"zero_optimization": {"reduce_bucket_size": -5}})",
       "zero_optimization.reduce_bucket_size: -5"},
      {R"({"zero_optimization": {"allgather_bucket_size": 0}})",
       "zero_optimization.allgather_bucket_size"},
      {R"({"zero_optimization": {"sub_group_size": 0}})", "zero_optimization.sub_group_size"},
      {R"({"zero_optimization": {"stage3_prefetch_bucket_size": -1}})",
       "zero_optimization.stage3_prefetch_bucket_size: -1 must be >= 0"},
      {R"({"zero_optimization": {"stage3_max_live_parameters": 0}})",
       "zero_optimization.stage3_max_live_parameters"},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -100}})",
       "zero_optimization.stage3_param_persistence_threshold"},
      {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage: -1"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": 0}}})",
       "zero_optimization.offload_param.buffer_size"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"buffer_count": 0}}})",
       "zero_optimization.offload_optimizer.buffer_count"},
      {R"({"gradient_accumulation_steps": -2})", "gradient_accumulation_steps: -2"},
      {R"({"train_micro_batch_size_per_gpu": 0})", "train_micro_batch_size_per_gpu: 0"},
      {R"({"steps_per_print": 0})", "steps_per_print: 0"},
      {R"({"comm_timeout_s": 0})", "comm_timeout_s: 0 must be positive"},
      {R"({"comm_timeout_s": -3})", "comm_timeout_s: -3"},
      {R"({"gradient_predivide_factor": 0})", "gradient_predivide_factor"},
      {R"({"fp16": {"initial_scale_power": 99}})", "fp16.initial_scale_power: 99"},
      {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale"},
      {R"({"fp16": {"loss_scale": -1}})", "fp16.loss_scale: -1"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: 1000"},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: 0"},
      // contradictions
      {R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2})",
       "train_batch_size: 10 is not train_micro_batch_size_per_gpu 4 x "
       "gradient_accumulation_steps 2"},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "choose one precision"},
      {R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": false}})",
       "bfloat16.enabled: false contradicts bf16.enabled"},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       "zero_optimization.offload_param: parameter offload needs stage 3"},
      {R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimizer: optimizer offload needs stage 1"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})",
       "zero_optimization.offload_optimizer.nvme_path: required"},
      {R"({"zero_optimization": {"stage": 2, "cpu_offload": true,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})",
       "zero_optimization.cpu_offload is the deprecated spelling of "
       "zero_optimization.offload_optimizer; give only one of them"},
      // bad enums
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "GPU"}}})",
       "zero_optimization.offload_optimizer.device: 'GPU'"},
      {R"({"communication_data_type": "fp8"})", "communication_data_type: 'fp8'"},
      {R"({"nonfinite_policy": "ignore"})", "nonfinite_policy: 'ignore'"},
      {R"({"optimizer": {"type": "Adafactor"}})", "optimizer.type: 'Adafactor'"},
      {R"({"scheduler": {"type": "Cosine"}})", "scheduler.type: 'Cosine'"},
      {R"({"aio": {"use_gds": true}})", "aio.use_gds"},
      // "auto" where no program fills it in
      {R"({"zero_optimization": {"stage": "auto"}})", "zero_optimization.stage: \"auto\""},
      {R"({"steps_per_print": "auto"})", "steps_per_print: \"auto\""},
      {R"({"comm_timeout_s": "auto"})", "comm_timeout_s: \"auto\""},
      {R"({"zero_optimization": {"contiguous_gradients": "auto"}})",
       "zero_optimization.contiguous_gradients: \"auto\""},
  };
  for (const Bad& b : bad) {
    INFO(b.json);
    CHECK_THROWS_AS(Config::from_json_string(b.json), ConfigError);
    CHECK_THROWS_WITH(Config::from_json_string(b.json), Catch::Contains(b.names));
  }
  // Negative control: the same keys with good values parse.
  CHECK_NOTHROW(Config::from_json_string(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99]}},
          "zero_optimization": {"reduce_bucket_size": 5, "stage3_prefetch_bucket_size": 0},
          "comm_timeout_s": 5, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2, "scheduler": {"type": "WarmupLR",
          "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}})"));
}

TEST_CASE("the scheduler's warmup_type reaches the schedule instead of being dropped",
          "[unit][config]") {
  const Config c = Config::from_json_string(
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}})");
  CHECK(c.scheduler->words.at("warmup_type") == "linear");
  CHECK(c.warnings.empty());
}

TEST_CASE("auto values are filled from the program's settings and reported", "[unit][config]") {
  const char* hf = R"({
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})";
  Config c = Config::from_json_string(hf);
  CHECK(c.auto_keys.size() == 18);
  zero::config::AutoValues v;
  v.train_batch_size = 16;
  v.gradient_accumulation = 2;
  v.lr = 3e-4;
  v.betas = {0.9, 0.95};
  v.weight_decay = 0.1;
  v.warmup_steps = 10;
  v.total_steps = 100;
  v.precision = "bf16";
  v.hidden_size = 64;
  const auto chosen = zero::config::fill_auto(c, v, 2);
  CHECK(c.train_batch_size == 16);
  CHECK(c.train_micro_batch_size_per_gpu == 4);
  CHECK(c.gradient_accumulation_steps == 2);
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.bf16_enabled == true);
  CHECK(c.fp16.enabled == false);
  CHECK(c.optimizer->params.at("lr") == std::vector<double>{3e-4});
  CHECK(c.optimizer->params.at("betas") == std::vector<double>{0.9, 0.95});
  CHECK(c.optimizer->params.at("weight_decay") == std::vector<double>{0.1});
  CHECK(c.optimizer->auto_params.empty());
  CHECK(c.scheduler->params.at("warmup_max_lr") == std::vector<double>{3e-4});
  CHECK(c.scheduler->params.at("total_num_steps") == std::vector<double>{100});
  CHECK(c.zero_optimization.reduce_bucket_size == 64 * 64);
  CHECK(c.zero_optimization.stage3_param_persistence_threshold == 640);
  CHECK(mentions(chosen, "train_micro_batch_size_per_gpu = 4"));
  CHECK(mentions(chosen, "optimizer.params.betas = [0.9, 0.95]"));
  CHECK(mentions(chosen, "zero_optimization.stage3_prefetch_bucket_size = 3686"));
  CHECK(mentions(chosen, "stage3_max_live_parameters = DeepSpeed's default"));
  CHECK(chosen.size() == 18);
  CHECK(c.auto_keys.empty());

  // Notices follow the filled precision: the loss-scale block counts only in fp16.
  Config scaled =
      Config::from_json_string(R"({"fp16": {"enabled": "auto", "loss_scale_window": 500}})");
  CHECK(noticed(scaled, "fp16.loss_scale_window"));
  v.precision = "fp16";
  zero::config::fill_auto(scaled, v, 1);
  CHECK(scaled.notices.empty());
  v.precision = "bf16";

  // A given batch key wins: the autos follow the batch rule from it.
  Config given = Config::from_json_string(
      R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": "auto"})");
  zero::config::fill_auto(given, v, 2);
  CHECK(given.train_batch_size == 8);  // 2 micro x 2 accumulation x 2 ranks
  // An auto the program cannot fill is an error naming it.
  Config odd =
      Config::from_json_string(R"({"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}})");
  CHECK_THROWS_WITH(zero::config::fill_auto(odd, v, 1),
                    Catch::Contains("optimizer.params.momentum: \"auto\" is not filled"));
  // Batch sizes that cannot agree with the world size are refused.
  Config uneven = Config::from_json_string(R"({"train_batch_size": "auto"})");
  v.train_batch_size = 9;
  v.gradient_accumulation = 1;
  CHECK_THROWS_AS(zero::config::fill_auto(uneven, v, 2), ConfigError);
}

namespace {
Config parse_config(const char* text) {
  return Config::from_json(nlohmann::json::parse(text));
}
}  // namespace

TEST_CASE("bf16 decides over its older spelling bfloat16, as in DeepSpeed", "[unit][config]") {
  // bfloat16's enabled (false when not given) overrode bf16: an empty bfloat16 beside
  // bf16.enabled "auto" made a bf16 program train in fp32, and beside true it was refused.
  CHECK(parse_config(R"({"bf16": {"enabled": true}, "bfloat16": {}})").bf16_enabled == true);
  CHECK_FALSE(
      parse_config(R"({"bf16": {"enabled": "auto"}, "bfloat16": {}})").bf16_enabled.has_value());
  CHECK(parse_config(R"({"bfloat16": {"enabled": true}})").bf16_enabled == true);
  CHECK(parse_config(R"({"bfloat16": {}})").bf16_enabled == false);
  CHECK(
      parse_config(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})").bf16_enabled ==
      true);
}

TEST_CASE(
    "the deprecated cpu_offload_param offloads the parameters, cpu_offload_use_pin_memory is "
    "reported",
    "[unit][config]") {
  // Both were unknown keys: cpu_offload_param, which DeepSpeed maps to offload_param on the CPU,
  // was dropped with a warning, and the run kept its parameters on the device.
  const Config c = parse_config(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
                                                          "cpu_offload_use_pin_memory": true}})");
  CHECK(c.zero_optimization.offload_param.device == zero::OffloadDevice::cpu);
  CHECK(c.zero_optimization.offload_optimizer.device == zero::OffloadDevice::none);
  CHECK(mentions(c.warnings, "zero_optimization.cpu_offload_param is deprecated"));
  CHECK_FALSE(mentions(c.warnings, "unknown key"));
  CHECK(noticed(c, "zero_optimization.cpu_offload_use_pin_memory"));
  CHECK(parse_config(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": false}})")
            .zero_optimization.offload_param.device == zero::OffloadDevice::none);
  CHECK_THROWS_WITH(
      parse_config(R"({"zero_optimization": {"stage": 2, "cpu_offload_param": true}})"),
      Catch::Contains("parameter offload needs stage 3"));
  CHECK_THROWS_WITH(parse_config(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
                                     "offload_param": {"device": "cpu"}}})"),
                    Catch::Contains("cpu_offload_param is the deprecated spelling of "
                                    "zero_optimization.offload_param"));
}

TEST_CASE("bucket sizes and pipeline partitioning at DeepSpeed's defaults are silent",
          "[unit][config]") {
  // Hugging Face's configs write the defaults out; each was reported as a key without effect.
  const Config c =
      parse_config(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 500000000,
                                             "allgather_bucket_size": 5e8},
                       "pipeline": {"pipe_partitioned": true, "grad_partitioned": true}})");
  CHECK(c.notices.empty());
  CHECK(noticed(parse_config(R"({"pipeline": {"pipe_partitioned": false}})"),
                "pipeline.pipe_partitioned"));
}
