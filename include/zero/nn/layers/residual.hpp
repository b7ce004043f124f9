#pragma once
// Residual: y = x + f(x) with f a list of layers (a Sequential inside the unit). Pre-LN
// transformer blocks are two of them: Residual{LayerNorm, Linear, CausalSelfAttention, Linear}
// and Residual{LayerNorm, Linear, GELU, Linear}. The backward starts the branch's input
// gradient from dy (the skip path) and lets f's first layer add into it (a LayerNorm reads dy
// where it would read that gradient: Layer::starts_input_grad, no copy), the same order of
// operations and roundings as GPT's blocks, so a block built this way gives the same bits as
// nn::TransformerBlock (f64, f32 and bf16). A branch that ends in a Linear (no dropout after it)
// has that layer write x + f(x) itself (Kernels::linear_forward_add): the same bits on the host,
// one GEMM with the skip path as its addend on the device (one rounding instead of two), and no
// buffer for f(x) in either.

#include <algorithm>
#include <any>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <zero/nn/layers/sequential.hpp>

namespace zero::nn {

/// x + f(x) for the layers f added to it.
template <class T>
class Residual final : public Layer<T> {
 public:
  /// name labels the block in messages.
  explicit Residual(std::string name = "residual") : name_(std::move(name)) {}

  /// Appends a layer to f; returns it.
  template <class L, class... Args>
  L& add(Args&&... args) {
    return inner_.template add<L>(std::forward<Args>(args)...);
  }

  std::string describe() const override { return "Residual '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override { return inner_.params(); }
  void bind(std::span<const ParamView<T>> views) override { inner_.bind(views); }
  /// y = x + f(x). When f's last layer adds a skip path itself (Layer::adds_skip: a Linear), it
  /// writes y directly, with no pass of the sum's own and no buffer for f(x); otherwise f(x)
  /// then the sum.
  void forward(StepContext<T>& ctx) override {
    expect<ShapeError>(ctx.x.data() != nullptr, describe(), ": no input activation");
    input_ = ctx.x;
    if (inner_.last_adds_skip()) {
      inner_.forward(ctx, input_);
      return;
    }
    inner_.forward(ctx);
    expect<ShapeError>(ctx.x.shape() == input_.shape(), describe(),
                       ": the branch changes the shape; a residual needs f(x) shaped like x");
    Tensor<T> y = ctx.arena->template allocate<T>(input_.shape());
    kernels_of(ctx).add(y.data(), input_.data(), ctx.x.data(), y.numel());
    ctx.x = y;
  }
  /// dx += dy + df: the branch's input gradient starts from dy (the skip path), so each
  /// element is rounded once, as in GPT's blocks (bf16 included); with ctx.overwrite_dx,
  /// dx = dy + df, the branch starting from dy in dx itself (no buffer of its own, no copy).
  void backward(StepContext<T>& ctx) override {
    const Tensor<T> dx = ctx.dx;              // ours
    const bool overwrite = ctx.overwrite_dx;  // the branch's layers set their own
    if (overwrite && dx.data() != ctx.dy.data()) {
      inner_.backward(ctx, ctx.dy, dx);
    } else {  // the branch leaves its own in ctx.dx
      inner_.backward(ctx, ctx.dy);
      if (overwrite) {
        kernels_of(ctx).copy(dx.data(), ctx.dx.data(), dx.numel());
      } else {
        kernels_of(ctx).accumulate(dx.data(), ctx.dx.data(), dx.numel());
      }
    }
    ctx.dx = dx;
  }
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    std::optional<FlopCount> branch = inner_.forward_flops();
    if (branch) *branch += elementwise_flops(in.input.numel());
    return branch;
  }

  bool parks() const override { return inner_.parks(); }
  std::any park() override { return std::pair{std::exchange(input_, {}), inner_.park()}; }
  void resume(std::any saved) override {
    auto* kept = std::any_cast<std::pair<Tensor<T>, std::any>>(&saved);
    expect<Error>(kept != nullptr, describe(), ": resume: the saved state is not this layer's");
    input_ = kept->first;
    inner_.resume(std::move(kept->second));
  }

 private:
  std::string name_;
  Sequential<T> inner_;
  Tensor<T> input_;
};

}  // namespace zero::nn
