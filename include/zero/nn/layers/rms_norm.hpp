#pragma once
// RMSNorm over the last dimension (eps 1e-5 unless given; weight starts at 1 and is not
// weight-decayed). The per-row rstd goes to the arena in the compute type. Runs on the pass's
// kernel set (host or device).

#include <any>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/kernels.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// Scales rows of C features to unit root mean square.
template <class T>
class RMSNorm final : public Layer<T> {
 public:
  /// Parameter name.weight [C].
  RMSNorm(std::string name, std::int64_t channels, double eps = 1e-5)
      : name_(std::move(name)), channels_(channels), eps_(eps) {
    expect_positive_size(describe(), "channels", channels);
  }

  std::string describe() const override { return "RMSNorm '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    return {{name_ + ".weight", {channels_}, Init::ones, 0, false}};
  }
  void bind(std::span<const ParamView<T>> views) override { weight_ = views[0]; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, channels_, describe());
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    rstd_ = ctx.arena->template allocate<Stat>({N});
    kernels_of(ctx).rms_norm_forward(y.data(), rstd_.data(), input_.data(), weight_.value.data(), N,
                                     channels_, static_cast<Stat>(eps_));
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    kernels_of(ctx).rms_norm_backward(ctx.dx.data(), weight_.grad.data(), ctx.dy.data(),
                                      input_.data(), weight_.value.data(), rstd_.data(),
                                      input_.numel() / channels_, channels_);
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel(), 4);
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_, rstd_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_, rstd_); }

 private:
  using Stat = compute_type_t<T>;

  std::string name_;
  std::int64_t channels_;
  double eps_;
  ParamView<T> weight_;
  Tensor<T> input_;
  Tensor<Stat> rstd_;
};

}  // namespace zero::nn
