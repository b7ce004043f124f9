#pragma once
// MSELoss: the regression loss layer. ctx.x holds predictions; the target (any numeric dtype,
// the same element count) comes from the micro-batch input `target` and is converted to the
// compute type in the arena. Forward sets ctx.loss to the mean of (pred - target)^2 over all
// elements and leaves the predictions in ctx.x; without the target it only passes them on (an
// evaluation: a training forward without it is an InputError).
// Backward ignores ctx.dy and seeds dloss = ctx.loss_scale.

#include <any>
#include <cstdint>
#include <string>

#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/mse_loss.hpp>

namespace zero::nn {

/// Mean squared error against a named target.
template <class T>
class MSELoss final : public Layer<T> {
 public:
  /// target names the input.
  explicit MSELoss(std::string target = "target") : target_(std::move(target)) {}

  std::string describe() const override { return "MSELoss '" + target_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    expect_host_kernels(ctx, describe());
    expect<ShapeError>(ctx.x.data() != nullptr, describe(), ": no input activation");
    pred_ = ctx.x;
    has_target_ = ctx.inputs.contains(target_);
    expect_labels_when_training(ctx, has_target_, describe(), target_);
    if (!has_target_) return;
    const InputTensor& t = ctx.inputs.entry(target_);
    expect<InputError>(t.shape.numel() == pred_.numel(), describe(), ": the target has ",
                       t.shape.numel(), " elements, the predictions ", pred_.numel());
    target_values_ = ctx.arena->template allocate<Stat>({pred_.numel()});
    ctx.inputs.copy_as(target_, target_values_);
    ctx.loss =
        convert<T>(ops::cpu::mse_forward(pred_.data(), target_values_.data(), pred_.numel()) +
                   static_cast<Stat>(ctx.aux_loss));
  }
  void backward(StepContext<T>& ctx) override {
    expect<InputError>(has_target_, describe(),
                       ": backward needs the target; the micro-batch had no input '", target_, "'");
    ops::cpu::mse_backward(ctx.dx.data(), pred_.data(), target_values_.data(), pred_.numel(),
                           convert<Stat>(ctx.loss_scale));
  }
  /// Predictions of the last forward (valid until the next micro-step).
  Tensor<const T> predictions() const { return pred_; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel(), 3);  // difference, square, sum
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(pred_, target_values_, has_target_); }
  void resume(std::any saved) override {
    nn::resume_members(saved, pred_, target_values_, has_target_);
  }

 private:
  using Stat = compute_type_t<T>;

  std::string target_;
  Tensor<T> pred_;
  Tensor<Stat> target_values_;
  bool has_target_ = false;
};

}  // namespace zero::nn
