#pragma once
// fp16 loss scaling with DeepSpeed's semantics (deepspeed/runtime/fp16/loss_scaler.py,
// DynamicLossScaler.update_scale, as in current DeepSpeed master) and its JSON keys
// (fp16.loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis,
// min_loss_scale).
//
// Dynamic scaling, after each step's overflow check (any Inf/NaN gradient on any rank):
//   overflow:  the step is skipped. If hysteresis is exhausted (delayed_shift == 1 or the
//              current hysteresis is 1) the scale halves, not below min_loss_scale; otherwise
//              the hysteresis counts down by one and the scale stays. The overflow iteration
//              is remembered.
//   clean:     with consecutive_hysteresis the hysteresis refills on every clean step. Let
//              stable = iterations since the last overflow, not counting this one; when
//              stable > 0 and stable % loss_scale_window == 0 the scale doubles (and without
//              consecutive_hysteresis the hysteresis refills only then).
// From the start (last overflow at -1) the first doubling happens on clean iteration
// loss_scale_window + 1 (iteration index loss_scale_window). Older DeepSpeed releases doubled one
// iteration earlier ((iter - last_overflow) % window == 0); we follow the current code.
//
// At the minimum: DeepSpeed raises as soon as the scale would drop below min_loss_scale. Here
// the error comes after `max_overflows_at_min_scale` consecutive such overflows (default 1:
// DeepSpeed's behaviour; 0 disables the error and keeps skipping steps).
//
// Static scaling (fp16.loss_scale > 0): the scale never changes; an overflowing step is still
// skipped, as DeepSpeed's ZeRO optimizers do.

#include <cmath>
#include <cstdint>

#include <optim/state_dict.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// The loss scale sat at its minimum through too many overflows: training has diverged.
class LossScaleError : public Error {
 public:
  using Error::Error;
};

/// DeepSpeed's fp16 block, with its defaults.
struct LossScalerConfig {
  double loss_scale = 0.0;       ///< fp16.loss_scale: 0 = dynamic, otherwise the static scale
  int initial_scale_power = 16;  ///< fp16.initial_scale_power: start at 2^power
  std::int64_t loss_scale_window = 1000;  ///< fp16.loss_scale_window
  int hysteresis = 2;                     ///< fp16.hysteresis (DeepSpeed's delayed_shift)
  bool consecutive_hysteresis = false;    ///< fp16.consecutive_hysteresis
  double min_loss_scale = 1.0;            ///< fp16.min_loss_scale
  int max_overflows_at_min_scale = 1;  ///< overflows at the minimum before LossScaleError; 0: never
};

/// Dynamic or static loss scaler with DeepSpeed's update rule and counters.
class LossScaler {
 public:
  /// A scaler from the fp16 config block; ConfigError names a bad key.
  explicit LossScaler(const LossScalerConfig& config = {}) : config_(config) {
    expect<ConfigError>(config.loss_scale >= 0.0 && std::isfinite(config.loss_scale),
                        "fp16.loss_scale must be 0 (dynamic) or a positive finite scale, got ",
                        config.loss_scale);
    expect<ConfigError>(config.initial_scale_power >= 0 && config.initial_scale_power < 128,
                        "fp16.initial_scale_power must be in [0, 127], got ",
                        config.initial_scale_power);
    expect<ConfigError>(config.loss_scale_window >= 1, "fp16.loss_scale_window must be >= 1, got ",
                        config.loss_scale_window);
    expect<ConfigError>(config.hysteresis >= 1, "fp16.hysteresis must be >= 1, got ",
                        config.hysteresis);
    expect<ConfigError>(config.min_loss_scale > 0.0 && std::isfinite(config.min_loss_scale),
                        "fp16.min_loss_scale must be positive and finite, got ",
                        config.min_loss_scale);
    expect<ConfigError>(config.max_overflows_at_min_scale >= 0,
                        "max_overflows_at_min_scale must be >= 0, got ",
                        config.max_overflows_at_min_scale);
    dynamic_ = config.loss_scale == 0.0;
    scale_ = dynamic_ ? std::ldexp(1.0, config.initial_scale_power) : config.loss_scale;
    hysteresis_ = config.hysteresis;
  }

  /// A static scaler with the given scale.
  static LossScaler fixed(double scale) {
    LossScalerConfig c;
    c.loss_scale = scale;
    return LossScaler(c);
  }

  /// True for dynamic scaling.
  bool dynamic() const { return dynamic_; }
  /// The scale to multiply the loss by for the next backward.
  double scale() const { return scale_; }
  /// 1 / scale, the factor that unscales gradients (folded into FusedIo::grad_scale).
  double inverse_scale() const { return 1.0 / scale_; }
  /// Remaining overflows before the next halving.
  int hysteresis() const { return hysteresis_; }
  /// Updates recorded (applied and skipped steps).
  std::int64_t steps() const { return steps_; }
  /// Steps skipped because of an overflow.
  std::int64_t skipped() const { return skipped_; }
  /// Overflows seen (equal to skipped()).
  std::int64_t overflows() const { return overflows_; }
  /// The configuration.
  const LossScalerConfig& config() const { return config_; }

  /// Records one step's overflow result (already OR-ed over all ranks) and updates the scale.
  /// Returns true when the optimizer step should be applied, false when it must be skipped.
  bool update(bool overflow) {
    ++steps_;
    if (overflow) {
      ++overflows_;
      ++skipped_;
    }
    if (!dynamic_) {
      ++iteration_;
      return !overflow;
    }
    if (overflow) {
      if (config_.hysteresis == 1 || hysteresis_ == 1) {
        if (scale_ == config_.min_loss_scale) {
          ++overflows_at_min_;
          expect<LossScaleError>(
              config_.max_overflows_at_min_scale == 0 ||
                  overflows_at_min_ < config_.max_overflows_at_min_scale,
              "loss scale is at its minimum (fp16.min_loss_scale = ", config_.min_loss_scale,
              ") and gradients overflowed ", overflows_at_min_,
              " consecutive time(s) there, at iteration ", iteration_,
              "; the fp16 run has diverged: lower the learning rate, use bf16, or lower "
              "fp16.min_loss_scale");
        }
        scale_ = std::fmax(scale_ / scale_factor, config_.min_loss_scale);
      } else {
        --hysteresis_;
      }
      last_overflow_iteration_ = iteration_;
    } else {
      overflows_at_min_ = 0;
      if (config_.consecutive_hysteresis) hysteresis_ = config_.hysteresis;
      const std::int64_t stable = iteration_ - last_overflow_iteration_ - 1;
      if (stable > 0 && stable % config_.loss_scale_window == 0) {
        if (!config_.consecutive_hysteresis) hysteresis_ = config_.hysteresis;
        scale_ *= scale_factor;
      }
    }
    ++iteration_;
    return !overflow;
  }

  /// Scale, hysteresis, iteration bookkeeping and counters.
  StateDict state_dict() const {
    StateDict s;
    s.scalars["cur_scale"] = scale_;
    s.counters["cur_hysteresis"] = hysteresis_;
    s.counters["cur_iter"] = iteration_;
    s.counters["last_overflow_iter"] = last_overflow_iteration_;
    s.counters["overflows_at_min_scale"] = overflows_at_min_;
    s.counters["steps"] = steps_;
    s.counters["skipped"] = skipped_;
    s.counters["overflows"] = overflows_;
    return s;
  }
  /// Restores what state_dict saved (the configuration stays this object's).
  void load_state_dict(const StateDict& s) {
    constexpr const char* who = "LossScaler";
    scale_ = s.scalar("cur_scale", who);
    hysteresis_ = static_cast<int>(s.counter("cur_hysteresis", who));
    iteration_ = s.counter("cur_iter", who);
    last_overflow_iteration_ = s.counter("last_overflow_iter", who);
    overflows_at_min_ = static_cast<int>(s.counter("overflows_at_min_scale", who));
    steps_ = s.counter("steps", who);
    skipped_ = s.counter("skipped", who);
    overflows_ = s.counter("overflows", who);
  }

 private:
  static constexpr double scale_factor = 2.0;  // DeepSpeed's, not configurable in JSON

  LossScalerConfig config_;
  bool dynamic_ = true;
  double scale_ = 1.0;
  int hysteresis_ = 2;
  std::int64_t iteration_ = 0;
  std::int64_t last_overflow_iteration_ = -1;
  int overflows_at_min_ = 0;
  std::int64_t steps_ = 0;
  std::int64_t skipped_ = 0;
  std::int64_t overflows_ = 0;
};

}  // namespace zero::optim
