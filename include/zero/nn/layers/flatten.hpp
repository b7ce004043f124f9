#pragma once
// Flatten: [N, d1, d2, ...] -> [N, d1 * d2 * ...], keeping dimension 0 (the samples). After a
// Linear applied per patch or per position ([N, P, C]) it joins a sample's rows for a dense
// head. Forward is a view (no copy); backward passes the gradient through.

#include <string>

#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/elementwise.hpp>

namespace zero::nn {

/// Joins every dimension after the first.
template <class T>
class Flatten final : public Layer<T> {
 public:
  std::string describe() const override { return "Flatten"; }
  void forward(StepContext<T>& ctx) override {
    expect<ShapeError>(ctx.x.data() != nullptr && ctx.x.rank() >= 1, describe(),
                       ": needs an input activation with a sample dimension");
    const std::int64_t n = ctx.x.dim(0);
    ctx.x = ctx.x.reshape(Shape{n, n > 0 ? ctx.x.numel() / n : 0});
  }
  void backward(StepContext<T>& ctx) override {
    kernels_of(ctx).accumulate(ctx.dx.data(), ctx.dy.data(), ctx.dx.numel());
  }
  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    (void)in;
    return FlopCount{};  // a view: no arithmetic
  }

  bool parks() const override { return true; }  // keeps nothing between forward and backward
};

}  // namespace zero::nn
