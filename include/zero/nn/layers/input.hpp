#pragma once
// FromInput: the layer that starts a unit-0 pipeline on named features. It converts the
// micro-batch's input (any floating or integer dtype, e.g. f32 features for an f64 reference
// model) into the model's element type in the arena, so the units after it see one type.

#include <string>

#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// ctx.x <- the micro-batch input name, converted to T (shape kept).
template <class T>
class FromInput final : public Layer<T> {
 public:
  /// Reads the input called name.
  explicit FromInput(std::string name) : name_(std::move(name)) {}

  std::string describe() const override { return "FromInput '" + name_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    const InputTensor& in = ctx.inputs.entry(name_);
    Tensor<T> x = ctx.arena->template allocate<T>(in.shape);
    ctx.inputs.copy_as(name_, x);
    ctx.x = x;
  }
  void backward(StepContext<T>&) override {}  // inputs are data: no gradient flows into them

 private:
  std::string name_;
};

}  // namespace zero::nn
