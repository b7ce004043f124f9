#pragma once
// FromInput: the layer that starts a unit-0 pipeline on named features. It converts the
// micro-batch's input (any floating or integer dtype, e.g. f32 features for an f64 reference
// model) into the model's element type in the arena, so the units after it see one type.

#include <string>

#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// ctx.x <- the micro-batch input name, converted to T and multiplied by scale (shape kept).
template <class T>
class FromInput final : public Layer<T> {
 public:
  /// Reads the input called name; scale maps raw values into range (1/255 for u8 pixels).
  explicit FromInput(std::string name, double scale = 1.0)
      : name_(std::move(name)), scale_(scale) {}

  std::string describe() const override { return "FromInput '" + name_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    expect_host_kernels(ctx, describe());
    const InputTensor& in = ctx.inputs.entry(name_);
    Tensor<T> x = ctx.arena->template allocate<T>(in.shape);
    ctx.inputs.copy_as(name_, x);
    if (scale_ != 1.0) {
      for (T& v : x) v = convert<T>(convert<double>(v) * scale_);
    }
    ctx.x = x;
  }
  void backward(StepContext<T>&) override {}  // inputs are data: no gradient flows into them

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    (void)in;
    return FlopCount{};  // a look-up or a view: no arithmetic
  }

  bool parks() const override { return true; }  // keeps nothing between forward and backward

 private:
  std::string name_;
  double scale_;
};

}  // namespace zero::nn
