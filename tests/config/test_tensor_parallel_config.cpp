// The "tensor_parallel" section: DeepSpeed's autotp_size, tp_size, Megatron's
// tensor_model_parallel_size and sequence_parallel; disagreeing or bad sizes name their keys.
#include <string>

#include <catch2/catch.hpp>

#include <zero/config.hpp>

using zero::Config;
using zero::ConfigError;

TEST_CASE("tensor_parallel: the size from autotp_size, tp_size or Megatron's key",
          "[unit][config][tp]") {
  CHECK(Config::from_json_string("{}").tensor_parallel.tp_size == 1);
  CHECK_FALSE(Config::from_json_string("{}").tensor_parallel.sequence_parallel);
  const Config a = Config::from_json_string(R"({"tensor_parallel": {"autotp_size": 4}})");
  CHECK(a.tensor_parallel.tp_size == 4);
  const Config b =
      Config::from_json_string(R"({"tensor_parallel": {"tp_size": 2, "sequence_parallel": true}})");
  CHECK(b.tensor_parallel.tp_size == 2);
  CHECK(b.tensor_parallel.sequence_parallel);
  CHECK(Config::from_json_string(R"({"tensor_model_parallel_size": 8})").tensor_parallel.tp_size ==
        8);
  CHECK(Config::from_json_string(
            R"({"tensor_parallel": {"tp_size": 2}, "tensor_model_parallel_size": 2})")
            .tensor_parallel.tp_size == 2);
  const Config c = Config::from_json_string(R"({"tensor_parallel": {"tp_sise": 2}})");
  REQUIRE(c.warnings.size() == 1);
  CHECK_THAT(c.warnings[0], Catch::Contains("tensor_parallel.tp_sise"));
}

TEST_CASE("tensor_parallel: bad or disagreeing sizes are refused naming the keys",
          "[unit][config][tp]") {
  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"tensor_parallel": {"autotp_size": 2, "tp_size": 4}})"),
      Catch::Contains("tensor_parallel.autotp_size") && Catch::Contains("tensor_parallel.tp_size"));
  CHECK_THROWS_WITH(Config::from_json_string(R"({"tensor_parallel": {"tp_size": 0}})"),
                    Catch::Contains("tensor_parallel.tp_size") && Catch::Contains("at least 1"));
  CHECK_THROWS_WITH(Config::from_json_string(R"({"tensor_parallel": {"autotp_size": "two"}})"),
                    Catch::Contains("tensor_parallel.autotp_size"));
  CHECK_THROWS_WITH(Config::from_json_string(
                        R"({"tensor_parallel": {"tp_size": 2}, "tensor_model_parallel_size": 4})"),
                    Catch::Contains("tensor_model_parallel_size") && Catch::Contains("disagrees"));
  // A size of 1 written out disagrees too (it was taken for "no size given").
  CHECK_THROWS_WITH(
      Config::from_json_string(
          R"({"tensor_parallel": {"autotp_size": 1}, "tensor_model_parallel_size": 4})"),
      Catch::Contains("tensor_model_parallel_size = 4 disagrees with tensor_parallel's size 1"));
  CHECK_THROWS_WITH(
      Config::from_json_string(R"({"tensor_parallel": {"sequence_parallel": "yes"}})"),
      Catch::Contains("tensor_parallel.sequence_parallel"));
}
