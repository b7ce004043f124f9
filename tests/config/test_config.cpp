// DeepSpeed JSON configs: the documented examples parse with "auto" left for the program, the
// batch-size rule, and every kind of bad value rejected with its key path.
#include <algorithm>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/config.hpp>

using zero::Config;
using zero::ConfigError;

namespace {

// Hugging Face Trainer's ZeRO-2 example (DeepSpeed integration docs).
const char* hf_zero2 = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                        "allgather_partitions": true, "allgather_bucket_size": 2e8,
                        "overlap_comm": true, "reduce_scatter": true, "reduce_bucket_size": 2e8,
                        "contiguous_gradients": true},
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
  "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

// Hugging Face Trainer's ZeRO-3 example.
const char* hf_zero3 = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                        "offload_param": {"device": "cpu", "pin_memory": true},
                        "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
                        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto",
                        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                        "stage3_gather_16bit_weights_on_model_save": true},
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
  "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

// DeepSpeed's own ZeRO-3 offload example (docs/_pages/config-json.md style).
const char* ds_zero3 = R"({
  "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                           "weight_decay": 3e-7}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
  "gradient_clipping": 1.0,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 3, "contiguous_gradients": true,
                        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                        "stage3_prefetch_bucket_size": 1e7,
                        "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
                        "sub_group_size": 1e9,
                        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
})";

void expect_error(const std::string& json, const std::string& fragment) {
  INFO(json);
  CHECK_THROWS_AS(Config::from_json_string(json), ConfigError);
  CHECK_THROWS_WITH(Config::from_json_string(json), Catch::Contains(fragment));
}

}  // namespace

TEST_CASE("Hugging Face's ZeRO-2 and ZeRO-3 examples parse with auto left open", "[unit][config]") {
  Config z2 = Config::from_json_string(hf_zero2);
  CHECK(z2.zero_optimization.stage == 2);
  CHECK(z2.zero_optimization.offload_optimizer.device == zero::OffloadDevice::cpu);
  CHECK(z2.zero_optimization.offload_optimizer.pin_memory);
  CHECK(z2.zero_optimization.reduce_bucket_size == 200'000'000);
  CHECK_FALSE(z2.fp16.enabled.has_value());  // "auto"
  CHECK_FALSE(z2.gradient_clipping.has_value());
  CHECK_FALSE(z2.train_batch_size.has_value());
  REQUIRE(z2.optimizer.has_value());
  CHECK(z2.optimizer->type == "AdamW");
  CHECK(z2.optimizer->auto_params.size() == 4);
  CHECK(z2.steps_per_print == 2000);
  CHECK(z2.warnings.empty());

  Config z3 = Config::from_json_string(hf_zero3);
  CHECK(z3.zero_optimization.stage == 3);
  CHECK(z3.zero_optimization.offload_param.device == zero::OffloadDevice::cpu);
  CHECK_FALSE(z3.zero_optimization.reduce_bucket_size.has_value());
  z3.resolve_auto_buckets(768);
  CHECK(z3.zero_optimization.reduce_bucket_size == 768 * 768);
  CHECK(z3.zero_optimization.stage3_prefetch_bucket_size == 768 * 768 * 9 / 10);
  CHECK(z3.zero_optimization.stage3_param_persistence_threshold == 7680);
  CHECK(z3.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  CHECK(z3.warnings.empty());
}

TEST_CASE("DeepSpeed's ZeRO-3 offload example parses with its values", "[unit][config]") {
  Config c = Config::from_json_string(ds_zero3);
  CHECK(c.bf16_enabled == true);
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.optimizer->get("lr", 0) == 0.001);
  CHECK(c.optimizer->params.at("betas") == std::vector<double>{0.8, 0.999});
  CHECK(c.scheduler->type == "WarmupLR");
  CHECK(c.zero_optimization.stage3_prefetch_bucket_size == 10'000'000);
  CHECK(c.zero_optimization.overlap_comm);  // stage 3 default
  const auto b = c.resolve_batch(4);
  CHECK(b.train == 64);
  CHECK(b.micro == 8);
  CHECK(b.accumulation == 2);
}

TEST_CASE("the batch-size rule: train = micro x accumulation x dp", "[unit][config]") {
  auto batch = [](const std::string& json, std::int64_t dp) {
    return Config::from_json_string(json).resolve_batch(dp);
  };
  CHECK(batch(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})", 2)
            .train == 24);
  CHECK(batch(R"({"train_batch_size": 24, "gradient_accumulation_steps": 3})", 2).micro == 4);
  CHECK(batch(R"({"train_batch_size": 32})", 4).micro == 8);
  CHECK(batch(R"({"train_micro_batch_size_per_gpu": 2})", 8).train == 16);
  CHECK(batch(R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
                  "gradient_accumulation_steps": 3})",
              2)
            .accumulation == 3);
  CHECK_THROWS_WITH(batch(R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 3})",
                          4),
                    Catch::Contains("24") && Catch::Contains("data-parallel size 4"));
  CHECK_THROWS_WITH(batch(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})", 1),
                    Catch::Contains("not divisible"));
  CHECK_THROWS_WITH(batch(R"({"gradient_accumulation_steps": 4})", 1),
                    Catch::Contains("train_micro_batch_size_per_gpu must be given"));
}

TEST_CASE("bad values are rejected with their key path", "[unit][config]") {
  expect_error(R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage: 4");
  expect_error(R"({"zero_optimization": {"stage": "two"}})",
               "zero_optimization.stage: expected an integer");
  expect_error(R"({"zero_optimization": {"stage": 2.5}})", "zero_optimization.stage");
  expect_error(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "choose one precision");
  expect_error(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
               "zero_optimization.offload_param: parameter offload needs stage 3");
  expect_error(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})",
               "zero_optimization.offload_optimizer.nvme_path: required");
  expect_error(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}})",
               "'gpu' is not an offload device");
  expect_error(R"({"optimizer": {"type": "Adamax"}})", "optimizer.type: 'Adamax' is not supported");
  expect_error(R"({"optimizer": {"params": {"lr": 1}}})", "optimizer.type: required");
  expect_error(R"({"optimizer": {"type": "Adam", "params": {"lr": {"x": 1}}}})",
               "optimizer.params.lr");
  expect_error(R"({"gradient_clipping": -1})", "gradient_clipping: -1");
  expect_error(R"({"train_batch_size": 0})", "train_batch_size: 0 must be in [1, 2147483647]");
  // Batch keys whose product wrapped to 0 (a division by zero) or to a wrong batch.
  expect_error(R"({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 4294967296,
                   "gradient_accumulation_steps": 4294967296})",
               "train_micro_batch_size_per_gpu: 4294967296 must be in [1, 2147483647]");
  CHECK_THROWS_WITH(Config::from_json_string(R"({"train_micro_batch_size_per_gpu": 2147483647,
                                                  "gradient_accumulation_steps": 2147483647})")
                        .resolve_batch(2147483647),
                    Catch::Contains("overflows a 64-bit batch size"));
  // Integers that narrow to int are range-checked first: 4294967312 is not 16.
  expect_error(R"({"fp16": {"enabled": true, "initial_scale_power": 4294967312}})",
               "fp16.initial_scale_power: 4294967312 is out of range");
  expect_error(R"({"fp16": {"enabled": true, "hysteresis": 4294967298}})",
               "fp16.hysteresis: 4294967298 is out of range");
  // So are the sizes and counts of the parallel layouts, which become ranks and loop counts:
  // an expert_interval of 2^32 + 1 was 1 (every block an MoE block), and num_experts and
  // ep_size of 2^32 passed the checks as 0 experts on 0 ranks (a division by zero later).
  expect_error(R"({"moe": {"num_experts": 4, "expert_interval": 4294967297}})",
               "moe.expert_interval: 4294967297 is out of range");
  expect_error(R"({"moe": {"num_experts": 4294967296, "ep_size": 4294967296}})",
               "moe.num_experts: 4294967296 is out of range");
  expect_error(R"({"moe": {"num_experts": 4, "min_capacity": 4294967300}})",
               "moe.min_capacity: 4294967300 is out of range");
  expect_error(R"({"pipeline": {"stages": 4294967298}})",
               "pipeline.stages: 4294967298 is out of range");
  expect_error(R"({"pipeline": {"virtual_stages": 4294967298, "schedule": "interleaved"}})",
               "pipeline.virtual_stages: 4294967298 is out of range");
  expect_error(R"({"pipeline_model_parallel_size": 4294967298})",
               "pipeline_model_parallel_size: 4294967298 is out of range");
  expect_error(R"({"tensor_parallel": {"autotp_size": 4294967298}})",
               "tensor_parallel.autotp_size: 4294967298 is out of range");
  expect_error(R"({"tensor_model_parallel_size": 4294967298})",
               "tensor_model_parallel_size: 4294967298 is out of range");
  expect_error(R"({"sequence_parallel_size": 4294967298})",
               "sequence_parallel_size: 4294967298 is out of range");
  // Experts that do not split over the expert-parallel ranks, and ranks meant for experts of a
  // model without MoE layers (which trained a dense model without a word).
  expect_error(R"({"moe": {"num_experts": 6, "ep_size": 4}})",
               "moe.num_experts = 6 must be a multiple of moe.ep_size = 4");
  expect_error(R"({"moe": {"ep_size": 2}})",
               "moe.num_experts = 1 must be a multiple of moe.ep_size = 2 (each expert-parallel "
               "rank holds num_experts / ep_size; 1 expert is no MoE layer)");
  // Random token selection is DeepSpeed's top-1 gate's; asked for with top-2 it is refused.
  expect_error(R"({"moe": {"num_experts": 4, "k": 2, "use_rts": true}})",
               "moe.use_rts applies to top-1 routing, but moe.k = 2");
  // So is RSample; the second choice's sampling is top-2's; the policy names DeepSpeed's.
  expect_error(R"({"moe": {"num_experts": 4, "k": 2, "noisy_gate_policy": "RSample"}})",
               "moe.noisy_gate_policy RSample applies to top-1 routing, but moe.k = 2");
  expect_error(R"({"moe": {"num_experts": 4, "top2_2nd_expert_sampling": true}})",
               "moe.top2_2nd_expert_sampling applies to top-2 routing, but moe.k = 1");
  expect_error(R"({"moe": {"num_experts": 4, "noisy_gate_policy": "Gaussian"}})",
               "moe.noisy_gate_policy = \"gaussian\"; expected null, \"None\", \"Jitter\" or "
               "\"RSample\"");
  expect_error(R"({"moe": {"num_experts": 4, "eval_capacity_factor": 0}})",
               "moe.eval_capacity_factor = 0; expected > 0");
  expect_error(R"({"fp16": {"enabled": true, "hysteresis": 0}})", "fp16.hysteresis");
  expect_error(R"({"fp16": {"loss_scale_window": "often"}})",
               "fp16.loss_scale_window: expected an integer");
  expect_error(R"({"communication_data_type": "int8"})", "communication_data_type");
  expect_error(R"([1, 2])", "expected a JSON object");
  expect_error(R"({"train_batch_size": )", "invalid JSON");
}

TEST_CASE("unknown keys are warned about, not fatal, type names match case-insensitively",
          "[unit][config]") {
  Config c = Config::from_json_string(
      R"({"zero_optimization": {"stage": 1, "stage_3_prefetch": 5}, "train_batchsize": 8,
          "optimizer": {"type": "adamw", "params": {"lr": 3e-4}}})");
  REQUIRE(c.warnings.size() == 2);
  auto warned = [&](const std::string& key) {
    for (const auto& w : c.warnings) {
      if (w.find("unknown key " + key + " ") != std::string::npos) return true;
    }
    return false;
  };
  CHECK(warned("train_batchsize"));
  CHECK(warned("zero_optimization.stage_3_prefetch"));
  CHECK_FALSE(warned("zero_optimization.stage"));
  CHECK(c.optimizer->type == "AdamW");
  CHECK_THROWS_WITH(Config::from_json_file("/nonexistent/ds_config.json"),
                    Catch::Contains("/nonexistent/ds_config.json"));
}

TEST_CASE("a decay that ends before its warmup is warned about, as DeepSpeed does",
          "[unit][config]") {
  const auto warnings = [](const char* scheduler) {
    return Config::from_json_string(std::string(R"({"scheduler": )") + scheduler + "}").warnings;
  };
  const auto short_decay = [](const std::vector<std::string>& w) {
    return std::count_if(w.begin(), w.end(), [](const std::string& s) {
      return s.find("total_num_steps: 100 is less than warmup_num_steps") != std::string::npos;
    });
  };
  CHECK(short_decay(warnings(R"({"type": "WarmupDecayLR",
      "params": {"total_num_steps": 100, "warmup_num_steps": 1000}})")) == 1);
  CHECK(short_decay(warnings(R"({"type": "WarmupCosineLR",
      "params": {"total_num_steps": 100, "warmup_num_steps": 500}})")) == 1);
  // warmup_num_steps' default is 1000.
  CHECK(short_decay(warnings(R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 100}})")) ==
        1);
  // Negative controls: a decay longer than its warmup, an "auto" warmup, WarmupLR.
  CHECK(warnings(R"({"type": "WarmupDecayLR",
      "params": {"total_num_steps": 2000, "warmup_num_steps": 1000}})")
            .empty());
  CHECK(warnings(R"({"type": "WarmupDecayLR",
      "params": {"total_num_steps": 100, "warmup_num_steps": "auto"}})")
            .empty());
  CHECK(warnings(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 1000}})").empty());
}
