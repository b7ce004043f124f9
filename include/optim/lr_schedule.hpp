#pragma once
// Learning-rate schedules with DeepSpeed's names, parameters and formulas
// (deepspeed/runtime/lr_schedules.py, current master): WarmupLR, WarmupDecayLR, WarmupCosineLR,
// OneCycle (with its momentum cycle and stairs) and LRRangeTest.
//
// Each schedule is a pure function of last_batch_iteration, DeepSpeed's counter: it starts at -1
// (the lr before the first step) unless the config's last_batch_iteration says otherwise. The
// engine reads lr() for an optimizer step and calls step() after it, so the k-th optimizer step
// (k = 1, 2, ...) runs with the lr at iteration start + k - 1: from -1, the first runs at -1 (lr 0
// for the warmup schedules, as DeepSpeed's get_lr before the first step), the second at 0.
// LrScheduler holds the counter, saves and restores it, and reads DeepSpeed's `scheduler` JSON
// block.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <nlohmann/json.hpp>

#include <optim/state_dict.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Shape of the warmup ramp.
enum class WarmupType { log, linear };

namespace detail {
/// DeepSpeed's warmup gamma in [0, 1): log(it + 1) / log(n) or it / n, for it < n.
inline double warmup_gamma(std::int64_t it, std::int64_t n, WarmupType type) {
  return type == WarmupType::log ? std::log(static_cast<double>(it + 1)) / std::log(double(n))
                                 : static_cast<double>(it) / static_cast<double>(n);
}
}  // namespace detail

/// Ramps from warmup_min_lr to warmup_max_lr over warmup_num_steps, then holds.
struct WarmupLR {
  double warmup_min_lr = 0.0;                ///< lr at iteration 0
  double warmup_max_lr = 1e-3;               ///< lr after warmup
  std::int64_t warmup_num_steps = 1000;      ///< ramp length (at least 2, as DeepSpeed)
  WarmupType warmup_type = WarmupType::log;  ///< ramp shape

  /// The lr at last_batch_iteration it.
  double lr(std::int64_t it) const {
    if (it < 0) return warmup_min_lr;
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(it);
  }
  /// The ramp fraction at it (1 after warmup).
  double gamma(std::int64_t it) const {
    const std::int64_t n = std::max<std::int64_t>(2, warmup_num_steps);
    return it < n ? detail::warmup_gamma(it, n, warmup_type) : 1.0;
  }
};

/// WarmupLR, then a linear decay to 0 at total_num_steps.
struct WarmupDecayLR {
  std::int64_t total_num_steps = 0;  ///< end of the decay
  WarmupLR warmup;                   ///< the warmup part

  /// The lr at last_batch_iteration it.
  double lr(std::int64_t it) const {
    if (it < 0) return warmup.warmup_min_lr;
    const std::int64_t n = std::max<std::int64_t>(2, warmup.warmup_num_steps);
    double gamma;
    if (it < n) {
      gamma = detail::warmup_gamma(it, n, warmup.warmup_type);
    } else {
      gamma = std::max(0.0, static_cast<double>(total_num_steps - it) /
                                std::max(1.0, static_cast<double>(total_num_steps - n)));
    }
    return warmup.warmup_min_lr + (warmup.warmup_max_lr - warmup.warmup_min_lr) * gamma;
  }
};

/// Warmup of the ratio from warmup_min_ratio to 1, then a cosine to cos_min_ratio; the lr is
/// base_lr (the optimizer's configured lr) times the ratio.
struct WarmupCosineLR {
  std::int64_t total_num_steps = 0;          ///< end of the cosine
  double warmup_min_ratio = 0.0;             ///< ratio at iteration 0
  std::int64_t warmup_num_steps = 1000;      ///< ramp length (at least 2)
  double cos_min_ratio = 1e-4;               ///< ratio at and after total_num_steps
  WarmupType warmup_type = WarmupType::log;  ///< ramp shape
  double base_lr = 1e-3;                     ///< the optimizer's lr

  /// The ratio at last_batch_iteration it (0 before the first step, as DeepSpeed).
  double ratio(std::int64_t it) const {
    if (it < 0) return 0.0;
    const std::int64_t n = std::max<std::int64_t>(2, warmup_num_steps);
    if (it < n) {
      return warmup_min_ratio + detail::warmup_gamma(it, n, warmup_type) * (1.0 - warmup_min_ratio);
    }
    const double real_last = static_cast<double>(it - n + 1);
    const double real_total = static_cast<double>(std::max<std::int64_t>(1, total_num_steps - n));
    const double progress = std::min(1.0, real_last / real_total);
    const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
    return std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine);
  }
  /// The lr at last_batch_iteration it.
  double lr(std::int64_t it) const { return base_lr * ratio(it); }
};

/// The 1cycle policy (Smith 2018): lr up from cycle_min_lr to cycle_max_lr and back over the
/// cycle, momentum (Adam's beta1) the other way, then an optional decay.
struct OneCycle {
  double cycle_min_lr = 0.0;                             ///< lr at the cycle's ends
  double cycle_max_lr = 0.0;                             ///< lr at the peak
  double decay_lr_rate = 0.0;                            ///< lr / (1 + rate * interval) after
  std::int64_t cycle_first_step_size = 2000;             ///< rising half
  std::optional<std::int64_t> cycle_second_step_size;    ///< falling half (default: first)
  std::int64_t cycle_first_stair_count = 0;              ///< stairs in the rising half (0: smooth)
  std::optional<std::int64_t> cycle_second_stair_count;  ///< stairs falling (default: first)
  std::int64_t decay_step_size = 0;                      ///< decay interval (0: no decay)
  bool cycle_momentum = true;                            ///< also cycle momentum
  double cycle_min_mom = 0.8;                            ///< momentum at the peak lr
  double cycle_max_mom = 0.9;                            ///< momentum at the ends
  double decay_mom_rate = 0.0;                           ///< momentum * (1 + rate * interval) after

  /// The lr at last_batch_iteration it.
  double lr(std::int64_t it) const {
    if (static_cast<double>(it) < total_size()) {
      return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale_factor(it);
    }
    if (decay_step_size == 0 || decay_lr_rate == 0.0) return cycle_min_lr;
    const double interval = static_cast<double>(it - static_cast<std::int64_t>(total_size()) + 1) /
                            static_cast<double>(decay_step_size);
    return cycle_min_lr / (1.0 + decay_lr_rate * interval);
  }
  /// The momentum (beta1) at it, or nothing when momentum is not cycled.
  std::optional<double> momentum(std::int64_t it) const {
    if (!cycle_momentum) return std::nullopt;
    if (static_cast<double>(it) < total_size()) {
      return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale_factor(it);
    }
    if (decay_step_size == 0 || decay_mom_rate == 0.0) return cycle_max_mom;
    const double interval = static_cast<double>(it - static_cast<std::int64_t>(total_size()) + 1) /
                            static_cast<double>(decay_step_size);
    return cycle_max_mom * (1.0 + decay_mom_rate * interval);
  }

 private:
  double first() const { return static_cast<double>(cycle_first_step_size); }
  double second() const {
    return static_cast<double>(cycle_second_step_size.value_or(cycle_first_step_size));
  }
  double total_size() const { return first() + second(); }
  double scale_factor(std::int64_t it) const {
    const double batch = static_cast<double>(it + 1);
    const double total = total_size();
    const double step_ratio = first() / total;
    const double cycle = std::floor(1.0 + batch / total);
    const double x = 1.0 + batch / total - cycle;
    double scale;
    std::int64_t stairs;
    if (x <= step_ratio) {
      scale = x / step_ratio;
      stairs = cycle_first_stair_count;
    } else {
      scale = (x - 1.0) / (step_ratio - 1.0);
      stairs = cycle_second_stair_count.value_or(cycle_first_stair_count);
    }
    // Stairs as DeepSpeed's docs describe them, quantised from the integer offset; DeepSpeed's
    // own OneCycle reads the counts but does not apply them (a smooth cycle).
    if (stairs > 0) {
      const double in_cycle = std::fmod(batch, total);
      const double position = in_cycle <= first()
                                  ? in_cycle * static_cast<double>(stairs) / first()
                                  : (total - in_cycle) * static_cast<double>(stairs) / second();
      scale = std::floor(position) / static_cast<double>(stairs);
    }
    return scale;
  }
};

/// Grows the lr from lr_range_test_min_lr, linearly or in stairs, to find a good lr range.
struct LRRangeTest {
  double lr_range_test_min_lr = 1e-3;           ///< start
  std::int64_t lr_range_test_step_size = 2000;  ///< iterations per unit of increase
  double lr_range_test_step_rate = 1.0;         ///< increase per unit
  bool lr_range_test_staircase = false;         ///< whole units only

  /// The lr at last_batch_iteration it.
  double lr(std::int64_t it) const {
    double interval = static_cast<double>(it + 1) / static_cast<double>(lr_range_test_step_size);
    if (lr_range_test_staircase) interval = std::floor(interval);
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval);
  }
};

/// Any of the schedules.
using Schedule = std::variant<WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest>;

/// A schedule with DeepSpeed's iteration counter.
class LrScheduler {
 public:
  /// Starts schedule at last_batch_iteration = -1.
  explicit LrScheduler(Schedule schedule) : schedule_(std::move(schedule)) {}

  /// Reads DeepSpeed's `scheduler` block ({"type": ..., "params": {...}}); optimizer_lr is the
  /// optimizer's lr (WarmupCosineLR's base, WarmupLR's warmup_max_lr when not given). Unknown
  /// types and keys are ConfigErrors that name the key path.
  static LrScheduler from_json(const nlohmann::json& block, double optimizer_lr);

  /// The lr for the next optimizer step.
  double lr() const {
    return std::visit([&](const auto& s) { return s.lr(last_batch_iteration_); }, schedule_);
  }
  /// OneCycle's momentum formula at the current iteration, when it cycles momentum (what an
  /// optimizer gets is betas(): before the first step that is cycle_min_mom, not this).
  std::optional<double> momentum() const {
    if (const auto* one = std::get_if<OneCycle>(&schedule_)) {
      return one->momentum(last_batch_iteration_);
    }
    return std::nullopt;
  }
  /// The (beta1, beta2) DeepSpeed's OneCycle gives an optimizer with betas for the next step,
  /// when it cycles momentum: (cycle_min_mom, 0.99) before the first step (what its constructor
  /// sets), then (momentum(), 0.99): DeepSpeed replaces beta2 with 0.99 too.
  std::optional<std::pair<double, double>> betas() const {
    const auto* one = std::get_if<OneCycle>(&schedule_);
    if (one == nullptr || !one->cycle_momentum) return std::nullopt;
    constexpr double one_cycle_beta2 = 0.99;
    return std::pair{last_batch_iteration_ < 0 ? one->cycle_min_mom : *momentum(), one_cycle_beta2};
  }
  /// Advances one iteration (call after each optimizer step).
  void step() { ++last_batch_iteration_; }
  /// Jumps to iteration it (DeepSpeed's step(batch_iteration)).
  void step(std::int64_t it) { last_batch_iteration_ = it; }
  /// DeepSpeed's counter: -1 before the first step.
  std::int64_t last_batch_iteration() const { return last_batch_iteration_; }
  /// The schedule.
  const Schedule& schedule() const { return schedule_; }

  /// The counter, as DeepSpeed's state_dict ({"last_batch_iteration": ...}).
  StateDict state_dict() const {
    StateDict s;
    s.counters["last_batch_iteration"] = last_batch_iteration_;
    return s;
  }
  /// Restores the counter.
  void load_state_dict(const StateDict& s) {
    last_batch_iteration_ = s.counter("last_batch_iteration", "LrScheduler");
  }

 private:
  Schedule schedule_;
  std::int64_t last_batch_iteration_ = -1;
};

namespace detail {

/// Reads params[key] into out when present, checking its JSON type; ConfigError names the path.
template <class T>
void read_param(const nlohmann::json& params, const char* key, T& out) {
  const auto it = params.find(key);
  if (it == params.end() || it->is_null()) return;
  bool ok;
  if constexpr (std::is_same_v<T, bool>) {
    // The engine's Config keeps a boolean param as the number 0 or 1 (NamedParams holds
    // numbers), and DeepSpeed's Python reads either as a truth value.
    ok = it->is_boolean() ||
         (it->is_number() && (it->get<double>() == 0.0 || it->get<double>() == 1.0));
  } else if constexpr (std::is_integral_v<T>) {
    // Whole and within 2^53 (exact in a double), so the conversion below cannot overflow.
    ok = it->is_number() && std::floor(it->get<double>()) == it->get<double>() &&
         std::fabs(it->get<double>()) <= 9007199254740992.0;
  } else {
    ok = it->is_number();
  }
  expect<ConfigError>(ok, "scheduler.params.", key, ": expected a ",
                      std::is_same_v<T, bool> ? "boolean" : "number", ", got ", it->dump());
  if constexpr (std::is_same_v<T, bool>) {
    out = it->is_boolean() ? it->get<bool>() : it->get<double>() != 0.0;
  } else if constexpr (std::is_integral_v<T>) {
    out = static_cast<T>(it->get<double>());
  } else {
    out = it->get<T>();
  }
}

/// Reads an optional integer parameter.
inline void read_param(const nlohmann::json& params, const char* key,
                       std::optional<std::int64_t>& out) {
  if (params.contains(key) && !params[key].is_null()) {
    std::int64_t v = 0;
    read_param(params, key, v);
    out = v;
  }
}

/// Reads warmup_type ("log" or "linear").
inline void read_warmup_type(const nlohmann::json& params, WarmupType& out) {
  const auto it = params.find("warmup_type");
  if (it == params.end()) return;
  expect<ConfigError>(it->is_string() && (*it == "log" || *it == "linear"),
                      "scheduler.params.warmup_type: expected \"log\" or \"linear\", got ",
                      it->dump());
  out = *it == "log" ? WarmupType::log : WarmupType::linear;
}

/// ConfigError for any key of params not in known.
inline void reject_unknown(const nlohmann::json& params, std::initializer_list<const char*> known,
                           const std::string& type) {
  for (const auto& [key, value] : params.items()) {
    const bool found =
        std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; });
    expect<ConfigError>(found, "scheduler.params.", key, ": not a parameter of ", type);
  }
}

}  // namespace detail

inline LrScheduler LrScheduler::from_json(const nlohmann::json& block, double optimizer_lr) {
  expect<ConfigError>(block.is_object() && block.contains("type") && block["type"].is_string(),
                      "scheduler.type: expected a string naming the schedule");
  const std::string type = block["type"].get<std::string>();
  const nlohmann::json params = block.value("params", nlohmann::json::object());
  expect<ConfigError>(params.is_object(), "scheduler.params: expected an object");
  using detail::read_param;
  // Every schedule takes DeepSpeed's last_batch_iteration: the counter it starts at (-1: fresh;
  // L: the first step uses the schedule at L, as a DeepSpeed run resumed by hand). A checkpoint
  // loaded later replaces it with its own counter.
  std::int64_t start = -1;
  read_param(params, "last_batch_iteration", start);
  expect<ConfigError>(start >= -1, "scheduler.params.last_batch_iteration: must be >= -1, got ",
                      start);
  const auto started = [start](Schedule schedule) {
    LrScheduler s(std::move(schedule));
    s.step(start);
    return s;
  };
  if (type == "WarmupLR" || type == "WarmupDecayLR") {
    WarmupLR w;
    // DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is not given;
    // WarmupDecayLR keeps its 1e-3.
    if (type == "WarmupLR") w.warmup_max_lr = optimizer_lr;
    read_param(params, "warmup_min_lr", w.warmup_min_lr);
    read_param(params, "warmup_max_lr", w.warmup_max_lr);
    read_param(params, "warmup_num_steps", w.warmup_num_steps);
    detail::read_warmup_type(params, w.warmup_type);
    // 0 and 1 ramp over 2 steps, as DeepSpeed's max(2, n) (HF's "auto" fills in 0 without one).
    expect<ConfigError>(w.warmup_num_steps >= 0,
                        "scheduler.params.warmup_num_steps: must not be negative, got ",
                        w.warmup_num_steps);
    if (type == "WarmupLR") {
      detail::reject_unknown(params,
                             {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                              "last_batch_iteration"},
                             type);
      return started(w);
    }
    detail::reject_unknown(params,
                           {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                            "warmup_type", "last_batch_iteration"},
                           type);
    WarmupDecayLR d;
    d.warmup = w;
    expect<ConfigError>(params.contains("total_num_steps"),
                        "scheduler.params.total_num_steps: required by WarmupDecayLR");
    read_param(params, "total_num_steps", d.total_num_steps);
    return started(d);
  }
  if (type == "WarmupCosineLR") {
    detail::reject_unknown(params,
                           {"total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                            "cos_min_ratio", "warmup_type", "last_batch_iteration"},
                           type);
    WarmupCosineLR c;
    c.base_lr = optimizer_lr;
    expect<ConfigError>(params.contains("total_num_steps"),
                        "scheduler.params.total_num_steps: required by WarmupCosineLR");
    read_param(params, "total_num_steps", c.total_num_steps);
    read_param(params, "warmup_min_ratio", c.warmup_min_ratio);
    read_param(params, "warmup_num_steps", c.warmup_num_steps);
    read_param(params, "cos_min_ratio", c.cos_min_ratio);
    detail::read_warmup_type(params, c.warmup_type);
    // 0 and 1 ramp over 2 steps, as DeepSpeed's max(2, n) (HF's "auto" fills in 0 without one).
    expect<ConfigError>(c.warmup_num_steps >= 0,
                        "scheduler.params.warmup_num_steps: must not be negative, got ",
                        c.warmup_num_steps);
    return started(c);
  }
  if (type == "OneCycle") {
    detail::reject_unknown(
        params,
        {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
         "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
         "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
         "last_batch_iteration"},
        type);
    expect<ConfigError>(params.contains("cycle_min_lr") && params.contains("cycle_max_lr"),
                        "scheduler.params.cycle_min_lr and cycle_max_lr: required by OneCycle");
    OneCycle o;
    read_param(params, "cycle_min_lr", o.cycle_min_lr);
    read_param(params, "cycle_max_lr", o.cycle_max_lr);
    read_param(params, "decay_lr_rate", o.decay_lr_rate);
    read_param(params, "cycle_first_step_size", o.cycle_first_step_size);
    read_param(params, "cycle_second_step_size", o.cycle_second_step_size);
    read_param(params, "cycle_first_stair_count", o.cycle_first_stair_count);
    read_param(params, "cycle_second_stair_count", o.cycle_second_stair_count);
    read_param(params, "decay_step_size", o.decay_step_size);
    read_param(params, "cycle_momentum", o.cycle_momentum);
    read_param(params, "cycle_min_mom", o.cycle_min_mom);
    read_param(params, "cycle_max_mom", o.cycle_max_mom);
    read_param(params, "decay_mom_rate", o.decay_mom_rate);
    expect<ConfigError>(o.cycle_first_step_size > 0,
                        "scheduler.params.cycle_first_step_size: must be positive");
    return started(o);
  }
  if (type == "LRRangeTest") {
    detail::reject_unknown(
        params,
        {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
         "lr_range_test_staircase", "last_batch_iteration"},
        type);
    LRRangeTest r;
    read_param(params, "lr_range_test_min_lr", r.lr_range_test_min_lr);
    read_param(params, "lr_range_test_step_size", r.lr_range_test_step_size);
    read_param(params, "lr_range_test_step_rate", r.lr_range_test_step_rate);
    read_param(params, "lr_range_test_staircase", r.lr_range_test_staircase);
    expect<ConfigError>(r.lr_range_test_step_size > 0,
                        "scheduler.params.lr_range_test_step_size: must be positive");
    return started(r);
  }
  raise<ConfigError>("scheduler.type: '", type,
                     "' is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, "
                     "LRRangeTest");
}

}  // namespace zero::optim
