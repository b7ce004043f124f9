// The dynamic loss scaler against DeepSpeed's update_scale, with the expected sequences written
// by hand from its semantics (see loss_scaler.hpp): hysteresis, window, consecutive hysteresis,
// the minimum, the error there; the static scaler; counters; save and restore.
#include <cmath>
#include <vector>

#include <catch2/catch.hpp>

#include <optim/loss_scaler.hpp>

using namespace zero::optim;

namespace {
// One expected row: the overflow input, whether the step is applied, the scale afterwards.
struct Row {
  bool overflow;
  bool applied;
  double scale_after;
};

void play(LossScaler& s, const std::vector<Row>& rows) {
  int k = 0;
  for (const Row& r : rows) {
    INFO("update " << k++ << " overflow " << r.overflow);
    CHECK(s.update(r.overflow) == r.applied);
    CHECK(s.scale() == r.scale_after);
  }
}
}  // namespace

TEST_CASE("Loss scaler: DeepSpeed defaults", "[unit][optim]") {
  LossScaler s;
  CHECK(s.dynamic());
  CHECK(s.scale() == 65536.0);
  CHECK(s.hysteresis() == 2);
  // With no overflow, the scale doubles on update 1001 (iteration 1000): stable = 1000.
  for (int i = 0; i < 1000; ++i) s.update(false);
  CHECK(s.scale() == 65536.0);
  s.update(false);
  CHECK(s.scale() == 131072.0);
}

TEST_CASE("Loss scaler: hysteresis and window, sequence by hand", "[unit][optim]") {
  LossScalerConfig c;
  c.initial_scale_power = 4;  // 16
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  SECTION("consecutive_hysteresis = false") {
    LossScaler s(c);
    play(s, {
                {false, true, 16},  // it 0: stable 0
                {false, true, 16},  // it 1: stable 1
                {false, true, 16},  // it 2: stable 2
                {false, true, 32},  // it 3: stable 3 -> double, hysteresis refilled
                {true, false, 32},  // it 4: hysteresis 2 -> 1, skip
                {true, false, 16},  // it 5: hysteresis exhausted -> halve
                {false, true, 16},  // it 6: stable 0
                {false, true, 16},  // it 7
                {false, true, 16},  // it 8
                {false, true, 32},  // it 9: stable 3 -> double, hysteresis back to 2
                {true, false, 32},  // it 10: hysteresis 2 -> 1
                {false, true, 32},  // it 11: clean, hysteresis stays 1
                {true, false, 16},  // it 12: hysteresis 1 -> halve immediately
            });
    CHECK(s.steps() == 13);
    CHECK(s.skipped() == 4);
    CHECK(s.overflows() == 4);
  }
  SECTION("consecutive_hysteresis = true refills on every clean step") {
    c.consecutive_hysteresis = true;
    LossScaler s(c);
    play(s, {
                {false, true, 16},
                {false, true, 16},
                {false, true, 16},
                {false, true, 32},
                {true, false, 32},  // hysteresis 2 -> 1
                {false, true, 32},  // refilled to 2
                {true, false, 32},  // 2 -> 1 again: no halving
                {true, false, 16},  // exhausted -> halve
            });
    CHECK(s.hysteresis() == 1);
  }
}

TEST_CASE("Loss scaler: the minimum and the error there", "[unit][optim]") {
  LossScalerConfig c;
  c.initial_scale_power = 1;  // 2
  c.hysteresis = 1;
  c.min_loss_scale = 1;
  SECTION("DeepSpeed's behaviour: error at the first overflow at the minimum") {
    LossScaler s(c);
    play(s, {{true, false, 1}});
    CHECK_THROWS_AS(s.update(true), LossScaleError);
  }
  SECTION("a configurable number of consecutive overflows at the minimum") {
    c.max_overflows_at_min_scale = 3;
    LossScaler s(c);
    play(s, {{true, false, 1},
             {true, false, 1},
             {true, false, 1},
             {false, true, 1},
             {true, false, 1},
             {true, false, 1}});  // the clean step reset the count
    CHECK_THROWS_WITH(s.update(true),
                      Catch::Contains("min_loss_scale") && Catch::Contains("3 consecutive"));
  }
  SECTION("0 disables the error") {
    c.max_overflows_at_min_scale = 0;
    LossScaler s(c);
    for (int i = 0; i < 50; ++i) CHECK_FALSE(s.update(true));
    CHECK(s.scale() == 1.0);
    CHECK(s.skipped() == 50);
  }
  SECTION("the scale never goes below the minimum") {
    c.initial_scale_power = 3;  // 8
    c.min_loss_scale = 3;
    LossScaler s(c);
    play(s, {{true, false, 4}, {true, false, 3}});
  }
}

TEST_CASE("Loss scaler: static scale skips overflowing steps and never changes", "[unit][optim]") {
  LossScaler s = LossScaler::fixed(128);
  CHECK_FALSE(s.dynamic());
  play(s, {{false, true, 128}, {true, false, 128}, {false, true, 128}});
  for (int i = 0; i < 2000; ++i) s.update(false);
  CHECK(s.scale() == 128);
  CHECK(s.skipped() == 1);
  CHECK(s.inverse_scale() == 1.0 / 128);
}

TEST_CASE("Loss scaler: configuration errors name the key", "[unit][optim]") {
  LossScalerConfig c;
  c.loss_scale_window = 0;
  CHECK_THROWS_WITH(LossScaler(c), Catch::Contains("fp16.loss_scale_window"));
  c = {};
  c.hysteresis = 0;
  CHECK_THROWS_WITH(LossScaler(c), Catch::Contains("fp16.hysteresis"));
  c = {};
  c.min_loss_scale = 0;
  CHECK_THROWS_WITH(LossScaler(c), Catch::Contains("fp16.min_loss_scale"));
}

TEST_CASE("Loss scaler: save and restore mid-sequence", "[unit][optim]") {
  LossScalerConfig c;
  c.initial_scale_power = 10;
  c.loss_scale_window = 4;
  const std::vector<bool> pattern{false, true,  false, false, true,  true,  false, false,
                                  false, false, false, true,  false, false, false, false};
  LossScaler straight(c), first(c);
  for (std::size_t i = 0; i < 7; ++i) {
    straight.update(pattern[i]);
    first.update(pattern[i]);
  }
  LossScaler resumed(c);
  resumed.load_state_dict(first.state_dict());
  for (std::size_t i = 7; i < pattern.size(); ++i) {
    straight.update(pattern[i]);
    resumed.update(pattern[i]);
    CHECK(resumed.scale() == straight.scale());
    CHECK(resumed.hysteresis() == straight.hysteresis());
  }
  CHECK(resumed.skipped() == straight.skipped());
  CHECK(resumed.steps() == straight.steps());
}
