#pragma once
// SwiGLU: Llama's gated activation on rows of [gate | up] (the output of one Linear(C, 2F), or of
// a ColumnParallelLinear with stride 2, so each tensor-parallel rank holds its part of both):
// silu(gate) * up, rows of F. Keeps a view of its input; runs on the pass's kernel set.

#include <any>
#include <cstdint>
#include <string>

#include <zero/nn/kernels.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// [N, 2F] = [gate | up] -> [N, F] = silu(gate) * up.
template <class T>
class SwiGLU final : public Layer<T> {
 public:
  std::string describe() const override { return "SwiGLU"; }
  void forward(StepContext<T>& ctx) override {
    expect_input_activation(ctx.x, describe());
    expect<ShapeError>(ctx.x.rank() >= 1 && ctx.x.dim(-1) > 0 && ctx.x.dim(-1) % 2 == 0, describe(),
                       ": the input's last dimension (", ctx.x.rank() >= 1 ? ctx.x.dim(-1) : 0,
                       ") must be [gate | up], an even number of features");
    input_ = ctx.x;
    const std::int64_t f = ctx.x.dim(-1) / 2;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, f));
    kernels_of(ctx).swiglu_forward(y.data(), input_.data(), y.numel() / f, f);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t f = input_.dim(-1) / 2;
    kernels_of(ctx).swiglu_backward(ctx.dx.data(), input_.data(), ctx.dy.data(),
                                    input_.numel() / (2 * f), f, ctx.overwrite_dx);
  }
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel() / 2, 5);  // silu (4) and the product, per output
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_); }

 private:
  Tensor<T> input_;
};

}  // namespace zero::nn
