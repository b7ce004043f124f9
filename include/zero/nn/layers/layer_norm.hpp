#pragma once
// LayerNorm over the last dimension (eps 1e-5, biased variance; weight starts at 1, bias at 0,
// neither weight-decayed). The per-row mean and rstd go to the arena in the compute type, as
// GPT's blocks keep them, so backward never recomputes the statistics.

#include <any>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// Normalises rows of C features.
template <class T>
class LayerNorm final : public Layer<T> {
 public:
  /// Parameters name.weight [C] and name.bias [C].
  LayerNorm(std::string name, std::int64_t channels) : name_(std::move(name)), channels_(channels) {
    expect_positive_size(describe(), "channels", channels);
  }

  std::string describe() const override { return "LayerNorm '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    return {{name_ + ".weight", {channels_}, Init::ones, 0, false},
            {name_ + ".bias", {channels_}, Init::zeros, 0, false}};
  }
  void bind(std::span<const ParamView<T>> views) override {
    weight_ = views[0];
    bias_ = views[1];
  }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, channels_, describe());
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    mean_ = ctx.arena->template allocate<Stat>({N});
    rstd_ = ctx.arena->template allocate<Stat>({N});
    kernels_of(ctx).layer_norm_forward(y.data(), mean_.data(), rstd_.data(), input_.data(),
                                       weight_.value.data(), bias_.value.data(), N, channels_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t N = input_.numel() / channels_;
    if (ctx.dx_start != nullptr) {
      kernels_of(ctx).layer_norm_backward_from(
          ctx.dx.data(), ctx.dx_start, weight_.grad.data(), bias_.grad.data(), ctx.dy.data(),
          input_.data(), weight_.value.data(), mean_.data(), rstd_.data(), N, channels_);
      return;
    }
    kernels_of(ctx).layer_norm_backward(ctx.dx.data(), weight_.grad.data(), bias_.grad.data(),
                                        ctx.dy.data(), input_.data(), weight_.value.data(),
                                        mean_.data(), rstd_.data(), N, channels_, ctx.overwrite_dx);
  }
  bool writes_input_grad() const override { return true; }
  bool starts_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel(), 5);
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_, mean_, rstd_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_, mean_, rstd_); }

 private:
  using Stat = compute_type_t<T>;

  std::string name_;
  std::int64_t channels_;
  ParamView<T> weight_, bias_;
  Tensor<T> input_;
  Tensor<Stat> mean_, rstd_;
};

}  // namespace zero::nn
