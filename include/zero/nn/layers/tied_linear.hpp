#pragma once
// TiedLinear: y = x W^T with W another layer's parameter (GPT-2's LM head reads the token
// embedding's table). It owns nothing: it reads the owner's bound view at every call (the
// engine rebinds the owner whenever it gathers it) and accumulates into the owner's gradient.
// The unit that holds it must list the owner's unit in unit_uses, so the engine keeps the
// owner gathered and reduces its gradient only after this use (docs/custom-models.md).

#include <any>
#include <cstdint>
#include <functional>
#include <string>

#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// [..., in] -> [..., out] through a weight [out, in] bound elsewhere.
template <class T>
class TiedLinear final : public Layer<T> {
 public:
  /// weight returns the owner's current view (e.g. [&] { return embedding.table(); }).
  TiedLinear(std::string name, std::function<ParamView<T>()> weight, std::int64_t in,
             std::int64_t out)
      : name_(std::move(name)), weight_(std::move(weight)), in_(in), out_(out) {
    expect_positive_size(describe(), "in", in);
    expect_positive_size(describe(), "out", out);
  }

  std::string describe() const override { return "TiedLinear '" + name_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    const ParamView<T> w = weight_();
    expect<ShapeError>(w.value.numel() == in_ * out_, describe(), ": the tied weight has ",
                       w.value.numel(), " elements, expected ", out_, " x ", in_);
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, out_));
    kernels_of(ctx).linear_forward(y.data(), input_.data(), w.value.data(), nullptr, N, in_, out_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const ParamView<T> w = weight_();
    nn::linear_backward<T>(ctx, ctx.dx.data(), w.grad.data(), nullptr, ctx.dy.data(), input_.data(),
                           w.value.data(), input_.numel() / in_, in_, out_, ctx.overwrite_dx);
  }
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return matmul_flops(in.input.numel() / in_, in_, out_);
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_); }

 private:
  std::string name_;
  std::function<ParamView<T>()> weight_;
  std::int64_t in_, out_;
  Tensor<T> input_;
};

}  // namespace zero::nn
