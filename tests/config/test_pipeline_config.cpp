// The "pipeline" section: stages ("auto"), virtual_stages, schedule and partition_method,
// Megatron's pipeline_model_parallel_size and virtual_pipeline_model_parallel_size, DeepSpeed's
// keys without effect, and the refusal of ZeRO-2/3 with a pipeline; bad values name their keys.
#include <algorithm>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/config.hpp>

using zero::Config;
using zero::ConfigError;

namespace {

bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

}  // namespace

TEST_CASE("pipeline: defaults without the section", "[unit][config][pipeline]") {
  const Config c = Config::from_json_string("{}");
  CHECK(c.pipeline.stages == 1);
  CHECK(c.pipeline.virtual_stages == 1);
  CHECK(c.pipeline.schedule == "1f1b");
  CHECK(c.pipeline.partition_method == "parameters");
  const Config empty = Config::from_json_string(R"({"pipeline": {}})");
  CHECK(empty.pipeline.stages == 1);
  CHECK(empty.warnings.empty());
  CHECK(empty.notices.empty());
}

TEST_CASE("pipeline: each key of the section is read", "[unit][config][pipeline]") {
  const Config c = Config::from_json_string(
      R"({"pipeline": {"stages": 4, "virtual_stages": 2, "schedule": "interleaved",
                       "partition_method": "type:Block"}})");
  CHECK(c.pipeline.stages == 4);
  CHECK(c.pipeline.virtual_stages == 2);
  CHECK(c.pipeline.schedule == "interleaved");
  CHECK(c.pipeline.partition_method == "type:Block");
  CHECK(c.warnings.empty());
  CHECK(c.notices.empty());

  for (const char* s : {"gpipe", "1f1b", "zb"}) {
    INFO(s);
    const Config k =
        Config::from_json_string(std::string(R"({"pipeline": {"schedule": ")") + s + "\"}}");
    CHECK(k.pipeline.schedule == s);
  }
  CHECK(Config::from_json_string(R"({"pipeline": {"schedule": "zb-h1"}})").pipeline.schedule ==
        "zb");
  for (const char* m : {"uniform", "parameters", "type:^(Block|Embedding)$"}) {
    INFO(m);
    const Config k = Config::from_json_string(
        std::string(R"({"pipeline": {"partition_method": ")") + m + "\"}}");
    CHECK(k.pipeline.partition_method == m);
  }
  // Chunks per stage without a schedule: the interleaved one.
  const Config v = Config::from_json_string(R"({"pipeline": {"stages": 2, "virtual_stages": 3}})");
  CHECK(v.pipeline.virtual_stages == 3);
  CHECK(v.pipeline.schedule == "interleaved");
  // A misspelt key of the section is a warning naming it.
  const Config typo = Config::from_json_string(R"({"pipeline": {"stagez": 2}})");
  REQUIRE(typo.warnings.size() == 1);
  CHECK_THAT(typo.warnings[0], Catch::Contains("pipeline.stagez") &&
                                   Catch::Contains("did you mean pipeline.stages?"));
  CHECK(typo.pipeline.stages == 1);
}

TEST_CASE("pipeline: stages \"auto\" is 1, left for the program", "[unit][config][pipeline]") {
  const Config c = Config::from_json_string(R"({"pipeline": {"stages": "auto"}})");
  CHECK(c.pipeline.stages == 1);
  CHECK(std::find(c.auto_keys.begin(), c.auto_keys.end(), "pipeline.stages") != c.auto_keys.end());
  // "auto" is not a value of the other keys.
  CHECK_THROWS_WITH(Config::from_json_string(R"({"pipeline": {"virtual_stages": "auto"}})"),
                    Catch::Contains("pipeline.virtual_stages: \"auto\" is not filled in"));
  // Megatron's size fills an "auto" section.
  CHECK(Config::from_json_string(
            R"({"pipeline": {"stages": "auto"}, "pipeline_model_parallel_size": 4})")
            .pipeline.stages == 4);
}

TEST_CASE("pipeline: Megatron's sizes alone and with the section", "[unit][config][pipeline]") {
  const Config alone = Config::from_json_string(R"({"pipeline_model_parallel_size": 4})");
  CHECK(alone.pipeline.stages == 4);
  CHECK(alone.pipeline.schedule == "1f1b");
  CHECK(alone.warnings.empty());
  CHECK(alone.notices.empty());

  const Config agree = Config::from_json_string(
      R"({"pipeline": {"stages": 2, "virtual_stages": 2}, "pipeline_model_parallel_size": 2,
          "virtual_pipeline_model_parallel_size": 2})");
  CHECK(agree.pipeline.stages == 2);
  CHECK(agree.pipeline.virtual_stages == 2);
  CHECK(agree.pipeline.schedule == "interleaved");

  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"pipeline": {"stages": 2}, "pipeline_model_parallel_size": 4})"),
      Catch::Contains("pipeline_model_parallel_size = 4") &&
          Catch::Contains("pipeline.stages = 2") && Catch::Contains("disagree"));
  // An explicit 1 is a size too: it disagrees with Megatron's 4.
  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"pipeline": {"stages": 1}, "pipeline_model_parallel_size": 4})"),
      Catch::Contains("pipeline_model_parallel_size") && Catch::Contains("pipeline.stages"));
  CHECK_THROWS_WITH(Config::from_json_string(R"({"pipeline": {"stages": 2, "virtual_stages": 3},
                                   "virtual_pipeline_model_parallel_size": 2})"),
                    Catch::Contains("virtual_pipeline_model_parallel_size = 2") &&
                        Catch::Contains("pipeline.virtual_stages = 3") &&
                        Catch::Contains("disagree"));
}

TEST_CASE("pipeline: Megatron's virtual size above 1 means the interleaved schedule",
          "[unit][config][pipeline]") {
  const Config c = Config::from_json_string(
      R"({"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2})");
  CHECK(c.pipeline.stages == 4);
  CHECK(c.pipeline.virtual_stages == 2);
  CHECK(c.pipeline.schedule == "interleaved");
  // A size of 1 keeps the default schedule.
  CHECK(Config::from_json_string(R"({"virtual_pipeline_model_parallel_size": 1})")
            .pipeline.schedule == "1f1b");
  // The section's interleaved schedule takes its chunk count from Megatron's key.
  const Config s = Config::from_json_string(
      R"({"pipeline": {"stages": 2, "schedule": "interleaved"},
          "virtual_pipeline_model_parallel_size": 3})");
  CHECK(s.pipeline.virtual_stages == 3);
  CHECK(s.pipeline.schedule == "interleaved");
  // A schedule the config gives is not overridden: a non-interleaved one is refused.
  CHECK_THROWS_WITH(Config::from_json_string(R"({"pipeline": {"schedule": "1f1b"},
                                   "virtual_pipeline_model_parallel_size": 2})"),
                    Catch::Contains("virtual_pipeline_model_parallel_size = 2") &&
                        Catch::Contains("pipeline.schedule") && Catch::Contains("\"1f1b\""));
}

TEST_CASE("pipeline: bad values are refused naming the key", "[unit][config][pipeline]") {
  struct Bad {
    const char* json;
    const char* names;
  };
  const Bad bad[] = {
      {R"({"pipeline": {"stages": 0}})", "pipeline.stages: 0 must be at least 1"},
      {R"({"pipeline": {"stages": -2}})", "pipeline.stages: -2"},
      {R"({"pipeline": {"stages": "two"}})", "pipeline.stages: expected an integer, got \"two\""},
      {R"({"pipeline": {"stages": 1.5}})", "pipeline.stages: expected an integer"},
      {R"({"pipeline": {"virtual_stages": 0}})", "pipeline.virtual_stages: 0 must be at least 1"},
      {R"({"pipeline": {"virtual_stages": true}})", "pipeline.virtual_stages: expected an integer"},
      {R"({"pipeline": {"schedule": "1F1B"}})",
       "pipeline.schedule: '1F1B' is not a schedule; expected gpipe, 1f1b, interleaved or zb"},
      {R"({"pipeline": {"schedule": "zb-v"}})", "pipeline.schedule: 'zb-v'"},
      {R"({"pipeline": {"schedule": 1}})", "pipeline.schedule: expected a string"},
      {R"({"pipeline": {"partition_method": "best"}})",
       "pipeline.partition_method: 'best' is not a partition method; expected uniform, "
       "parameters or type:<regex>"},
      {R"({"pipeline": {"partition_method": "type:"}})",
       "pipeline.partition_method: 'type:' is not a partition method"},
      {R"({"pipeline": {"partition_method": "type:[Block"}})",
       "pipeline.partition_method: 'type:[Block': the regex after type: is invalid"},
      {R"({"pipeline": {"partition_method": 3}})", "pipeline.partition_method: expected a string"},
      {R"({"pipeline": true})", "pipeline: expected an object"},
      {R"({"pipeline_model_parallel_size": 0})",
       "pipeline_model_parallel_size: 0 must be at least 1"},
      {R"({"pipeline_model_parallel_size": "4"})",
       "pipeline_model_parallel_size: expected an integer"},
      {R"({"virtual_pipeline_model_parallel_size": 0})",
       "virtual_pipeline_model_parallel_size: 0 must be at least 1"},
      // across the keys
      {R"({"pipeline": {"virtual_stages": 2, "schedule": "1f1b"}})",
       "pipeline.virtual_stages = 2 needs pipeline.schedule \"interleaved\""},
      {R"({"pipeline": {"virtual_stages": 4, "schedule": "zb"}})",
       "pipeline.virtual_stages = 4 needs pipeline.schedule"},
      {R"({"pipeline": {"schedule": "interleaved"}})",
       "pipeline.schedule \"interleaved\" needs pipeline.virtual_stages of at least 2"},
      {R"({"pipeline": {"schedule": "interleaved", "virtual_stages": 1}})",
       "pipeline.schedule \"interleaved\" needs pipeline.virtual_stages"},
      {R"({"pipeline": {"virtual_stages": 2, "schedule": "interleaved"}})",
       "pipeline.virtual_stages = 2 needs a pipeline of at least 2 stages"},
      {R"({"pipeline": {"stages": 1}, "virtual_pipeline_model_parallel_size": 2})",
       "virtual_pipeline_model_parallel_size = 2 needs a pipeline of at least 2 stages"},
      // DeepSpeed's keys without effect are type-checked
      {R"({"pipeline": {"seed_layers": "yes"}})", "pipeline.seed_layers: expected true or false"},
      {R"({"pipeline": {"activation_checkpoint_interval": true}})",
       "pipeline.activation_checkpoint_interval: expected a number"},
      {R"({"pipeline": {"partition": 2}})", "pipeline.partition: expected a string"},
      {R"({"pipeline": {"pipe_partitioned": "true"}})", "pipeline.pipe_partitioned"},
      {R"({"pipeline": {"grad_partitioned": 1}})", "pipeline.grad_partitioned"},
      {R"({"pipeline": {"seed_layers": "auto"}})", "pipeline.seed_layers: \"auto\""},
  };
  for (const Bad& b : bad) {
    INFO(b.json);
    CHECK_THROWS_AS(Config::from_json_string(b.json), ConfigError);
    CHECK_THROWS_WITH(Config::from_json_string(b.json), Catch::Contains(b.names));
  }
}

TEST_CASE("pipeline: ZeRO-2 and ZeRO-3 are refused with more than one stage",
          "[unit][config][pipeline]") {
  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}})"),
      Catch::Contains("pipeline.stages = 2 with zero_optimization.stage = 2") &&
          Catch::Contains("reduce-scatter the gradients after every micro-batch") &&
          Catch::Contains("DeepSpeed refuses"));
  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"pipeline": {"stages": 4}, "zero_optimization": {"stage": 3}})"),
      Catch::Contains("pipeline.stages = 4 with zero_optimization.stage = 3") &&
          Catch::Contains("gather each stage's parameters for every micro-batch"));
  // Megatron's size is named when it set the stages.
  CHECK_THROWS_WITH(
      Config::from_json_string(
          R"({"pipeline_model_parallel_size": 2, "zero_optimization": {"stage": 3}})"),
      Catch::Contains("pipeline_model_parallel_size = 2 with zero_optimization.stage"));
  CHECK_THROWS_AS(
      Config::from_json_string(R"({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}})"),
      ConfigError);
  // Negative controls: stages 0-1 of ZeRO with a pipeline, and ZeRO-3 with one stage or "auto".
  CHECK(
      Config::from_json_string(R"({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}})")
          .pipeline.stages == 2);
  CHECK_NOTHROW(Config::from_json_string(
      R"({"pipeline": {"stages": 8}, "zero_optimization": {"stage": 0}})"));
  CHECK_NOTHROW(Config::from_json_string(
      R"({"pipeline": {"stages": 1}, "zero_optimization": {"stage": 3}})"));
  CHECK_NOTHROW(Config::from_json_string(
      R"({"pipeline": {"stages": "auto"}, "zero_optimization": {"stage": 3}})"));
}

TEST_CASE("pipeline: DeepSpeed's keys without effect are read and reported, never unknown",
          "[unit][config][pipeline]") {
  const Config c = Config::from_json_string(
      R"({"pipeline": {"stages": 2, "partition": "uniform", "seed_layers": true,
                       "activation_checkpoint_interval": 1, "pipe_partitioned": false,
                       "grad_partitioned": false}})");
  CHECK(c.warnings.empty());
  CHECK(c.pipeline.stages == 2);
  CHECK(c.pipeline.partition_method == "parameters");  // partition is not partition_method
  for (const char* key :
       {"pipeline.partition", "pipeline.seed_layers", "pipeline.activation_checkpoint_interval",
        "pipeline.pipe_partitioned", "pipeline.grad_partitioned"}) {
    INFO(key);
    CHECK(mentions(c.notices, std::string("no effect in zero: ") + key + " ("));
  }
  CHECK(c.notices.size() == 5);
  // At DeepSpeed's defaults the keys are silent (pipe_partitioned and grad_partitioned are
  // true there, and a config copied from DeepSpeed's example sets them so).
  const Config defaults = Config::from_json_string(
      R"({"pipeline": {"stages": "auto", "partition": "best", "seed_layers": false,
                       "pipe_partitioned": true, "grad_partitioned": true}})");
  CHECK(defaults.warnings.empty());
  CHECK(defaults.notices.empty());
  // DeepSpeed's documented pipeline example loads (its stages "auto" for the program to fill).
  const Config ds = Config::from_json_string(
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "zero_optimization": {"stage": 1},
          "pipeline": {"stages": "auto", "partition": "best", "seed_layers": false,
                       "activation_checkpoint_interval": 0, "pipe_partitioned": true,
                       "grad_partitioned": true}})");
  CHECK(ds.warnings.empty());
  CHECK(ds.pipeline.stages == 1);
  CHECK(mentions(ds.notices,
                 "pipeline.activation_checkpoint_interval (the model decides checkpointing"));
  CHECK_FALSE(mentions(ds.notices, "pipeline.pipe_partitioned"));
}
