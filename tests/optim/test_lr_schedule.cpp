// LR schedules at their boundary steps, with the expected values computed by hand from
// DeepSpeed's formulas (lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle
// (with stairs and decay), LRRangeTest; the JSON block, and save/restore.
#include <cmath>
#include <numbers>
#include <string>

#include <catch2/catch.hpp>

#include <optim/lr_schedule.hpp>

using namespace zero::optim;

TEST_CASE("WarmupLR", "[unit][optim]") {
  WarmupLR s{0.0, 1e-3, 100, WarmupType::log};
  CHECK(s.lr(-1) == 0.0);
  CHECK(s.lr(0) == 0.0);  // log(1) = 0
  CHECK(s.lr(9) == Approx(1e-3 * std::log(10.0) / std::log(100.0)));
  CHECK(s.lr(99) == Approx(1e-3));
  CHECK(s.lr(100) == 1e-3);
  CHECK(s.lr(1000000) == 1e-3);
  s.warmup_type = WarmupType::linear;
  CHECK(s.lr(50) == Approx(0.5e-3));
  CHECK(s.lr(99) == Approx(0.99e-3));
  s.warmup_num_steps = 1;            // DeepSpeed raises it to 2
  CHECK(s.lr(1) == Approx(0.5e-3));  // linear: 1 / 2
  CHECK(s.lr(2) == 1e-3);
  CHECK(s.lr(0) == 0.0);
}

TEST_CASE("WarmupLR from a config warms up to the optimizer's lr unless warmup_max_lr is given",
          "[unit][optim]") {
  // DeepSpeed's WarmupLR defaults warmup_max_lr to the optimizer's lr (WarmupDecayLR keeps
  // 1e-3); this one warmed up to 1e-3, 100x an optimizer lr of 1e-5.
  const auto lr_after = [](const char* block, double optimizer_lr) {
    LrScheduler s = LrScheduler::from_json(nlohmann::json::parse(block), optimizer_lr);
    s.step(10);
    return s.lr();
  };
  CHECK(lr_after(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 10}})", 1e-5) == 1e-5);
  CHECK(lr_after(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 10}})", 3e-4) == 3e-4);
  CHECK(lr_after(R"({"type": "WarmupLR",
                     "params": {"warmup_num_steps": 10, "warmup_max_lr": 2e-3}})",
                 1e-5) == 2e-3);
  CHECK(lr_after(R"({"type": "WarmupDecayLR",
                     "params": {"warmup_num_steps": 10, "total_num_steps": 1000}})",
                 1e-5) == Approx(1e-3));
}

TEST_CASE(
    "a warmup of 0 steps from a config ramps over 2, as DeepSpeed's max(2, n), a negative one "
    "is refused",
    "[unit][optim]") {
  // The Hugging Face Trainer fills "auto" with 0 for a run without warmup; this refused it.
  for (const char* type : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}) {
    CAPTURE(type);
    const auto block = [&](int n) {
      nlohmann::json b = {{"type", type},
                          {"params", {{"warmup_num_steps", n}, {"total_num_steps", 100}}}};
      if (std::string(type) == "WarmupLR") b["params"].erase("total_num_steps");
      return b;
    };
    LrScheduler zero_steps = LrScheduler::from_json(block(0), 1e-3);
    LrScheduler two_steps = LrScheduler::from_json(block(2), 1e-3);
    for (int it = 0; it < 4; ++it) {
      zero_steps.step(it);
      two_steps.step(it);
      CHECK(zero_steps.lr() == two_steps.lr());
    }
    CHECK(zero_steps.lr() > 0.0);
    CHECK_THROWS_WITH(LrScheduler::from_json(block(-1), 1e-3),
                      Catch::Contains("warmup_num_steps: must not be negative"));
  }
}

TEST_CASE("WarmupDecayLR", "[unit][optim]") {
  WarmupDecayLR s{1000, WarmupLR{0.0, 1.0, 100, WarmupType::linear}};
  CHECK(s.lr(99) == Approx(0.99));
  CHECK(s.lr(100) == Approx(1.0));  // (1000 - 100) / 900
  CHECK(s.lr(550) == Approx(0.5));
  CHECK(s.lr(999) == Approx(1.0 / 900.0));
  CHECK(s.lr(1000) == 0.0);
  CHECK(s.lr(1100) == 0.0);  // clamped, not negative
}

TEST_CASE("WarmupCosineLR", "[unit][optim]") {
  WarmupCosineLR s{1100, 0.1, 100, 0.01, WarmupType::linear, 2.0};
  CHECK(s.lr(-1) == 0.0);
  CHECK(s.lr(0) == Approx(0.2));
  CHECK(s.lr(50) == Approx(2.0 * 0.55));
  CHECK(s.ratio(100) == Approx(0.01 + 0.99 * (1 + std::cos(std::numbers::pi * 0.001)) / 2));
  CHECK(s.ratio(599) == Approx(0.505));
  CHECK(s.lr(1099) == Approx(0.02));
  CHECK(s.lr(5000) == Approx(0.02));  // progress clamped at 1
}

TEST_CASE("OneCycle", "[unit][optim]") {
  OneCycle s;
  s.cycle_min_lr = 0.1;
  s.cycle_max_lr = 1.1;
  s.cycle_first_step_size = 10;
  CHECK(s.lr(-1) == Approx(0.1));
  CHECK(s.lr(4) == Approx(0.6));
  CHECK(*s.momentum(4) == Approx(0.85));
  CHECK(s.lr(9) == Approx(1.1));  // the peak
  CHECK(*s.momentum(9) == Approx(0.8));
  CHECK(s.lr(14) == Approx(0.6));
  CHECK(s.lr(19) == Approx(0.1));
  CHECK(s.lr(20) == Approx(0.1));  // no decay configured
  CHECK(*s.momentum(25) == Approx(0.9));
  SECTION("decay after the cycle") {
    s.decay_lr_rate = 0.5;
    s.decay_step_size = 2;
    s.decay_mom_rate = 0.1;
    CHECK(s.lr(20) == Approx(0.1 / 1.25));
    CHECK(s.lr(23) == Approx(0.05));
    CHECK(*s.momentum(23) == Approx(0.9 * 1.2));
  }
  SECTION("stairs") {
    s.cycle_first_stair_count = 2;
    CHECK(s.lr(3) == Approx(0.1));
    CHECK(s.lr(4) == Approx(0.6));
    CHECK(s.lr(9) == Approx(1.1));
    CHECK(s.lr(14) == Approx(0.6));
    CHECK(s.lr(15) == Approx(0.1));
  }
  SECTION("asymmetric cycle") {
    s.cycle_second_step_size = 30;
    CHECK(s.lr(9) == Approx(1.1));
    CHECK(s.lr(24) == Approx(0.6));  // halfway down the 30-step half
    CHECK(s.lr(39) == Approx(0.1));
  }
  SECTION("no momentum cycling") {
    s.cycle_momentum = false;
    CHECK_FALSE(s.momentum(4).has_value());
  }
}

TEST_CASE("LRRangeTest", "[unit][optim]") {
  LRRangeTest s{1e-3, 10, 1.0, false};
  CHECK(s.lr(-1) == Approx(1e-3));
  CHECK(s.lr(9) == Approx(2e-3));
  CHECK(s.lr(14) == Approx(2.5e-3));
  s.lr_range_test_staircase = true;
  CHECK(s.lr(14) == Approx(2e-3));
  CHECK(s.lr(8) == Approx(1e-3));
}

TEST_CASE("LrScheduler: DeepSpeed's counter, JSON block, save and restore", "[unit][optim]") {
  const auto block = nlohmann::json::parse(R"({
    "type": "WarmupDecayLR",
    "params": {"total_num_steps": 1000, "warmup_min_lr": 0, "warmup_max_lr": 1.0,
               "warmup_num_steps": 100, "warmup_type": "linear"}})");
  LrScheduler s = LrScheduler::from_json(block, 5e-4);
  CHECK(s.last_batch_iteration() == -1);
  CHECK(s.lr() == 0.0);
  for (int i = 0; i < 51; ++i) s.step();
  CHECK(s.lr() == Approx(0.5));
  LrScheduler resumed = LrScheduler::from_json(block, 5e-4);
  resumed.load_state_dict(s.state_dict());
  CHECK(resumed.lr() == s.lr());
  s.step(550);
  CHECK(s.lr() == Approx(0.5));

  const auto cosine = nlohmann::json::parse(
      R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
          "warmup_type": "linear"}})");
  LrScheduler c = LrScheduler::from_json(cosine, 0.25);
  c.step();
  CHECK(c.lr() == Approx(0.0));
  c.step();
  CHECK(c.lr() == Approx(0.25 * 0.5));

  const auto one = nlohmann::json::parse(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.1,
          "cycle_first_step_size": 10}})");
  LrScheduler o = LrScheduler::from_json(one, 0.0);
  o.step(4);
  CHECK(o.lr() == Approx(0.6));
  CHECK(*o.momentum() == Approx(0.85));

  CHECK_THROWS_WITH(LrScheduler::from_json(nlohmann::json::parse(R"({"type": "Cosine"})"), 1.0),
                    Catch::Contains("scheduler.type") && Catch::Contains("WarmupLR"));
  CHECK_THROWS_WITH(
      LrScheduler::from_json(
          nlohmann::json::parse(R"({"type": "WarmupLR", "params": {"warmup_steps": 5}})"), 1.0),
      Catch::Contains("scheduler.params.warmup_steps"));
  CHECK_THROWS_WITH(LrScheduler::from_json(
                        nlohmann::json::parse(R"({"type": "WarmupCosineLR", "params": {}})"), 1.0),
                    Catch::Contains("total_num_steps"));
  CHECK_THROWS_WITH(
      LrScheduler::from_json(
          nlohmann::json::parse(R"({"type": "WarmupLR", "params": {"warmup_max_lr": "x"}})"), 1.0),
      Catch::Contains("warmup_max_lr"));
}

TEST_CASE("LrScheduler: last_batch_iteration starts the counter where the config says",
          "[unit][optim]") {
  const auto block = nlohmann::json::parse(R"({
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.0, "warmup_num_steps": 100,
               "warmup_type": "linear", "last_batch_iteration": 50}})");
  LrScheduler s = LrScheduler::from_json(block, 5e-4);
  CHECK(s.last_batch_iteration() == 50);
  CHECK(s.lr() == Approx(0.5));  // the first step uses the schedule at 50, not at -1
  s.step();
  CHECK(s.lr() == Approx(0.51));

  // OneCycle at a started counter gives the cycled momentum, not cycle_min_mom.
  const auto one = nlohmann::json::parse(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.1,
          "cycle_first_step_size": 10, "last_batch_iteration": 4.0}})");
  const LrScheduler o = LrScheduler::from_json(one, 0.0);
  CHECK(o.lr() == Approx(0.6));
  CHECK(o.betas()->first == Approx(0.85));

  // A checkpoint's counter replaces the config's.
  LrScheduler resumed = LrScheduler::from_json(block, 5e-4);
  LrScheduler fresh = LrScheduler::from_json(
      nlohmann::json::parse(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 100}})"), 1.0);
  fresh.step(9);
  resumed.load_state_dict(fresh.state_dict());
  CHECK(resumed.last_batch_iteration() == 9);

  for (const char* bad : {R"(-2)", R"(1.5)", R"("3")", R"(1e300)"}) {
    CAPTURE(bad);
    auto b = block;
    b["params"]["last_batch_iteration"] = nlohmann::json::parse(bad);
    CHECK_THROWS_WITH(LrScheduler::from_json(b, 1.0), Catch::Contains("last_batch_iteration"));
  }
}
