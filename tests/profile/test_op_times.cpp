// OpTimes: nested scopes charge their kind only their own time, kinds add up to the whole, a null
// timer times nothing, and a fence runs before every reading of the clock.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/profile/op_times.hpp>

using zero::profile::OpTimes;

namespace {
void sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}
}  // namespace

TEST_CASE("OpTimes charges nested scopes to their own kinds", "[profile]") {
  OpTimes times;
  {
    const OpTimes::Scope outer(&times, "Residual");
    sleep_ms(20);
    {
      const OpTimes::Scope inner(&times, "Linear");
      sleep_ms(200);
    }
  }
  {
    const OpTimes::Scope again(&times, "Linear");
    sleep_ms(10);
  }
  const auto& s = times.seconds();
  REQUIRE(s.size() == 2);
  // Sleeps last at least as asked; the upper bounds leave room for a loaded machine.
  CHECK(s.at("Linear") >= 0.210);
  CHECK(s.at("Residual") >= 0.020);
  CHECK(s.at("Residual") < 0.020 + 0.150);  // not charged Linear's 200 ms
  CHECK(times.total() == Approx(s.at("Linear") + s.at("Residual")));
  times.clear();
  CHECK(times.seconds().empty());
}

TEST_CASE("OpTimes runs its fence before each reading of the clock", "[profile]") {
  OpTimes times;
  std::vector<std::string> events;
  times.set_fence([&] { events.push_back("fence"); });
  {
    const OpTimes::Scope outer(&times, "Sequential");
    const OpTimes::Scope inner(&times, "GELU");
  }
  // Two opens and two closes: four fences, and both kinds recorded.
  CHECK(events.size() == 4);
  CHECK(times.seconds().size() == 2);
  times.set_fence({});
  { const OpTimes::Scope scope(&times, "GELU"); }
  CHECK(events.size() == 4);
}

TEST_CASE("A null OpTimes times nothing", "[profile]") {
  const OpTimes::Scope scope(nullptr, "Linear");  // no timer: must not crash or record
  SUCCEED();
}

TEST_CASE("OpTimes::kind_of takes the first word of a description", "[profile]") {
  CHECK(OpTimes::kind_of("Linear 'mlp.fc' 768->3072") == "Linear");
  CHECK(OpTimes::kind_of("GELU") == "GELU");
}
