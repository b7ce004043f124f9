// Error types: hierarchy and messages built only on failure.
#include <algorithm>
#include <cmath>
#include <ostream>

#include <catch2/catch.hpp>

#include <zero/core/error.hpp>

#include "../support/worse.hpp"

namespace {
// Counts how often it is written to a stream.
struct StreamCounter {
  mutable int streamed = 0;
  friend std::ostream& operator<<(std::ostream& out, const StreamCounter& c) {
    ++c.streamed;
    return out << "<part>";
  }
};
}  // namespace

TEST_CASE("errors derive from zero::Error and carry the message parts", "[unit][error]") {
  using namespace zero;
  CHECK_THROWS_AS(raise<ConfigError>("key ", "zero_optimization.stage", " = ", 7), Error);
  CHECK_THROWS_WITH(raise<ConfigError>("zero_optimization.stage = ", 7, ": expected 0..3"),
                    "zero_optimization.stage = 7: expected 0..3");
  CHECK_THROWS_AS(raise<CommError>("all_reduce"), CommError);
  CHECK_NOTHROW(expect<CheckpointError>(true, "unused"));
  CHECK_THROWS_AS(expect<CheckpointError>(false, "file ", "a.bin"), CheckpointError);
  // The parts are only streamed when the check fails.
  StreamCounter part;
  expect<Error>(true, "never shown: ", part);
  CHECK(part.streamed == 0);
  CHECK_THROWS_WITH(expect<Error>(false, "shown: ", part), "shown: <part>");
  CHECK(part.streamed == 1);
}

TEST_CASE("the tests' error maxima let a NaN win, where std::max drops it", "[unit][error]") {
  using zero::testing::worse;
  const double nan = std::nan("");
  CHECK(std::max(0.5, nan) == 0.5);  // what the comparisons used to do
  CHECK(std::isnan(worse(0.5, nan)));
  CHECK(std::isnan(worse(nan, 2.0)));  // and it stays NaN
  CHECK(worse(0.5, 2.0) == 2.0);
  CHECK(worse(2.0, 0.5) == 2.0);
  CHECK_FALSE(worse(0.0, nan) <= 1e-10);  // a bound check on a NaN element fails
}
