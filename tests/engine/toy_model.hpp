#pragma once
// A two-unit linear regression that satisfies nn::Model, small enough to reason about exactly:
// unit 0 holds w [features] (decayed), unit 1 holds c [1] (not decayed); pred_b = w . x_b + c,
// loss = mean_b (pred_b - y_b)^2, with x_b and y_b derived from the tokens. A token equal to
// `poison` makes the loss and every gradient NaN (or, with overflow_instead, a huge finite loss
// whose gradients overflow fp16), which is how the engine tests inject a bad micro-batch on one
// rank.
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/param.hpp>

namespace zero::test {

template <class T>
class ToyModel {
 public:
  using value_type = T;
  static constexpr std::int32_t poison = -7;
  static constexpr std::int64_t features = 6;
  bool overflow_instead = false;

  int num_units() const { return 2; }
  std::vector<nn::ParamSpec> unit_params(int unit) const {
    if (unit == 0) return {{"w", Shape{features}, nn::Init::normal, 0.5, true}};
    return {{"c", Shape{1}, nn::Init::zeros, 0.0, false}};
  }
  std::vector<int> unit_uses(int) const { return {}; }
  void bind_unit(int unit, std::span<const nn::ParamView<T>> views) {
    (unit == 0 ? w_ : c_) = views[0];
  }
  void forward_unit(int unit, nn::StepContext<T>& ctx) {
    const std::int64_t rows = ctx.batch;
    if (unit == 0) {
      x_.assign(static_cast<std::size_t>(rows * features), 0.0f);
      y_.assign(static_cast<std::size_t>(rows), 0.0f);
      pred_.assign(static_cast<std::size_t>(rows), 0.0f);
      bad_ = false;
      for (std::int64_t b = 0; b < rows; ++b) {
        const std::int32_t* t = ctx.tokens + b * ctx.seq_len;
        float y = 0;
        for (std::int64_t f = 0; f < features; ++f) {
          const std::int32_t tok = t[f % ctx.seq_len];
          if (tok == poison) bad_ = true;
          const float x = static_cast<float>((tok * (f + 3)) % 17) / 8.0f - 1.0f;
          x_[static_cast<std::size_t>(b * features + f)] = x;
          pred_[static_cast<std::size_t>(b)] += to_float(w_.value.data()[f]) * x;
          y += x * static_cast<float>(f + 1) / 4.0f;
        }
        y_[static_cast<std::size_t>(b)] = y;
      }
      return;
    }
    double loss = 0;
    for (std::int64_t b = 0; b < rows; ++b) {
      const float p = pred_[static_cast<std::size_t>(b)] + to_float(c_.value.data()[0]);
      pred_[static_cast<std::size_t>(b)] = p;
      const double d = p - y_[static_cast<std::size_t>(b)];
      loss += d * d;
    }
    loss /= static_cast<double>(rows);
    if (bad_) loss = overflow_instead ? 1e30 : std::numeric_limits<double>::quiet_NaN();
    ctx.loss = convert<T>(loss);
  }
  void backward_unit(int unit, nn::StepContext<T>& ctx) {
    const std::int64_t rows = ctx.batch;
    if (unit == 1) {
      dpred_.assign(static_cast<std::size_t>(rows), 0.0f);
      float dc = 0;
      for (std::int64_t b = 0; b < rows; ++b) {
        float d = 2.0f * (pred_[static_cast<std::size_t>(b)] - y_[static_cast<std::size_t>(b)]) /
                  static_cast<float>(rows) * static_cast<float>(ctx.loss_scale);
        if (bad_) d = overflow_instead ? 1e30f : std::numeric_limits<float>::quiet_NaN();
        dpred_[static_cast<std::size_t>(b)] = d;
        dc += d;
      }
      add(c_.grad.data()[0], dc);
      return;
    }
    for (std::int64_t f = 0; f < features; ++f) {
      float g = 0;
      for (std::int64_t b = 0; b < rows; ++b) {
        g += dpred_[static_cast<std::size_t>(b)] * x_[static_cast<std::size_t>(b * features + f)];
      }
      add(w_.grad.data()[f], g);
    }
  }

 private:
  static float to_float(T v) { return static_cast<float>(convert<float>(v)); }
  static void add(T& acc, float g) { acc = convert<T>(to_float(acc) + g); }

  nn::ParamView<T> w_, c_;
  std::vector<float> x_, y_, pred_, dpred_;
  bool bad_ = false;
};

}  // namespace zero::test
