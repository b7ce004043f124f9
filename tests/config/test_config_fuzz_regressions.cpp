// Inputs the config fuzz target (tests/fuzz/fuzz_config.cpp) found to fail, kept as tests.
#include <string>

#include <catch2/catch.hpp>

#include <zero/config/config.hpp>

using zero::Config;

TEST_CASE("boolean optimizer params read as 0/1 instead of escaping as a JSON type error",
          "[unit][config]") {
  // fuzz_config: {"params": {"paled": false}} threw nlohmann's type_error 302 ("type must be
  // number, but is boolean"), not a zero::Error. DeepSpeed configs carry such params
  // (amsgrad, torch_adam, adam_w_mode).
  const Config c = Config::from_json_string(R"({"optimizer": {"type": "Adam", "params":
      {"lr": 0.001, "torch_adam": true, "adam_w_mode": false}}})");
  REQUIRE(c.optimizer.has_value());
  CHECK(c.optimizer->get("torch_adam", -1.0) == 1.0);
  CHECK(c.optimizer->get("adam_w_mode", -1.0) == 0.0);
  CHECK(c.optimizer->get("lr", -1.0) == 0.001);  // the numbers around it are unchanged
}
