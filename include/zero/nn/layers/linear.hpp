#pragma once
// Linear: y = x W^T + b over the last dimension, W [out, in] (PyTorch layout), b [out]. The
// weight starts normal with stddev 1/sqrt(in) unless given, so activations keep their scale
// through a stack of layers; the bias starts at zero and is not weight-decayed.

#include <any>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// A fully connected layer: [..., in] -> [..., out].
template <class T>
class Linear final : public Layer<T> {
 public:
  /// Parameters name.weight [out, in] (and name.bias [out] when bias); stddev <= 0 means
  /// 1/sqrt(in).
  Linear(std::string name, std::int64_t in, std::int64_t out, bool bias = true, double stddev = 0.0)
      : name_(std::move(name)),
        in_(in),
        out_(out),
        bias_(bias),
        stddev_(stddev > 0 ? stddev : 1.0 / std::sqrt(static_cast<double>(in))) {
    expect<ShapeError>(in > 0 && out > 0, "Linear '", name_, "': in = ", in, ", out = ", out,
                       "; both must be positive");
  }

  std::string describe() const override { return "Linear '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    std::vector<ParamSpec> p{{name_ + ".weight", {out_, in_}, Init::normal, stddev_, true}};
    if (bias_) p.push_back({name_ + ".bias", {out_}, Init::zeros, 0, false});
    return p;
  }
  void bind(std::span<const ParamView<T>> views) override {
    weight_ = views[0];
    if (bias_) bias_view_ = views[1];
  }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, out_));
    kernels_of(ctx).linear_forward(y.data(), input_.data(), weight_.value.data(),
                                   bias_ ? bias_view_.value.data() : nullptr, N, in_, out_);
    ctx.x = y;
  }
  /// y = skip + (x W^T + b) in one kernel call (Kernels::linear_forward_add).
  bool adds_skip() const override { return true; }
  void forward_adding(StepContext<T>& ctx, Tensor<const T> skip) override {
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    const Shape out_shape = ctx.x.shape().with_extent(-1, out_);
    expect<ShapeError>(skip.shape() == out_shape, describe(),
                       ": the skip path added to its output is ", skip.shape(), ", the output ",
                       out_shape);
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(out_shape);
    kernels_of(ctx).linear_forward_add(y.data(), skip.data(), input_.data(), weight_.value.data(),
                                       bias_ ? bias_view_.value.data() : nullptr, N, in_, out_);
    ctx.x = y;
  }
  /// y = gelu(x W^T + b) with x W^T + b kept for GELU (Kernels::linear_gelu_forward).
  bool applies(FusedActivation a) const override { return a == FusedActivation::gelu; }
  Tensor<T> forward_activating(StepContext<T>& ctx, FusedActivation a) override {
    expect<Error>(applies(a), describe(), ": no fused form for activation ", static_cast<int>(a));
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    input_ = ctx.x;
    const Shape out_shape = ctx.x.shape().with_extent(-1, out_);
    Tensor<T> pre = ctx.arena->template allocate<T>(out_shape);
    Tensor<T> y = ctx.arena->template allocate<T>(out_shape);
    kernels_of(ctx).linear_gelu_forward(pre.data(), y.data(), input_.data(), weight_.value.data(),
                                        bias_ ? bias_view_.value.data() : nullptr, N, in_, out_);
    ctx.x = y;
    return pre;
  }
  /// The input gradient through the GELU before it (Kernels::linear_backward_gelu); not in a
  /// split backward (ctx.weight_grads), which the kernel sets that fuse it do not run.
  bool backward_applies(FusedActivation a) const override { return a == FusedActivation::gelu; }
  void backward_activating(StepContext<T>& ctx, FusedActivation a,
                           Tensor<const T> activation_input) override {
    expect<Error>(backward_applies(a) && ctx.weight_grads == nullptr, describe(),
                  ": no fused backward through activation ", static_cast<int>(a),
                  ctx.weight_grads != nullptr ? " in a split backward" : "");
    const std::int64_t N = input_.numel() / in_;
    expect<ShapeError>(activation_input.numel() == input_.numel(), describe(),
                       ": the activation's input has ", activation_input.numel(),
                       " elements, this layer's ", input_.numel());
    kernels_of(ctx).linear_backward_gelu(
        ctx.dx.data(), weight_.grad.data(), bias_ ? bias_view_.grad.data() : nullptr, ctx.dy.data(),
        input_.data(), weight_.value.data(), activation_input.data(), N, in_, out_);
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t N = input_.numel() / in_;
    nn::linear_backward<T>(ctx, ctx.dx.data(), weight_.grad.data(),
                           bias_ ? bias_view_.grad.data() : nullptr, ctx.dy.data(), input_.data(),
                           weight_.value.data(), N, in_, out_, ctx.overwrite_dx);
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
  std::int64_t in_, out_;
  bool bias_;
  double stddev_;
  ParamView<T> weight_, bias_view_;
  Tensor<T> input_;
};

}  // namespace zero::nn
