// Error types: hierarchy and messages built only on failure.
#include <catch2/catch.hpp>

#include <zero/core/error.hpp>

TEST_CASE("errors derive from zero::Error and carry the message parts", "[unit][error]") {
  using namespace zero;
  CHECK_THROWS_AS(raise<ConfigError>("key ", "zero_optimization.stage", " = ", 7), Error);
  CHECK_THROWS_WITH(raise<ConfigError>("zero_optimization.stage = ", 7, ": expected 0..3"),
                    "zero_optimization.stage = 7: expected 0..3");
  CHECK_THROWS_AS(raise<CommError>("all_reduce"), CommError);
  CHECK_NOTHROW(expect<CheckpointError>(true, "unused"));
  CHECK_THROWS_AS(expect<CheckpointError>(false, "file ", "a.bin"), CheckpointError);
  int formatted = 0;
  // The parts are only streamed when the check fails.
  auto count = [&](bool ok) {
    try {
      expect<Error>(ok, "x");
    } catch (const Error&) {
      ++formatted;
    }
  };
  count(true);
  count(false);
  CHECK(formatted == 1);
}
