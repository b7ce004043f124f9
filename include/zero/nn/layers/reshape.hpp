#pragma once
// Reshape: [N, ...] -> [N, sample_shape...], keeping dimension 0 (the samples) and the element
// count. Turns flat features into patches ([N, P*D] -> [N, P, D]) so a Linear applies per
// patch. Forward is a view (no copy); backward passes the gradient through.

#include <string>

#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/elementwise.hpp>

namespace zero::nn {

/// Views each sample as sample_shape.
template <class T>
class Reshape final : public Layer<T> {
 public:
  /// The shape of one sample (rank at most Shape::max_rank - 1).
  explicit Reshape(Shape sample_shape) : sample_(sample_shape) {
    expect<ShapeError>(sample_.rank() < Shape::max_rank, "Reshape: sample shape of rank ",
                       sample_.rank(), " leaves no room for the sample dimension");
  }

  std::string describe() const override { return "Reshape"; }
  void forward(StepContext<T>& ctx) override {
    expect<ShapeError>(ctx.x.data() != nullptr && ctx.x.rank() >= 1, describe(),
                       ": needs an input activation with a sample dimension");
    const std::int64_t n = ctx.x.dim(0);
    expect<ShapeError>(n * sample_.numel() == ctx.x.numel(), describe(), ": ", ctx.x.numel(),
                       " elements in ", n, " samples do not fill samples of ", sample_.numel());
    std::int64_t extents[Shape::max_rank] = {n};
    for (int i = 0; i < sample_.rank(); ++i) extents[i + 1] = sample_[i];
    ctx.x = ctx.x.reshape(make_shape(extents, sample_.rank() + 1));
  }
  void backward(StepContext<T>& ctx) override {
    kernels_of(ctx).accumulate(ctx.dx.data(), ctx.dy.data(), ctx.dx.numel());
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    (void)in;
    return FlopCount{};  // a look-up or a view: no arithmetic
  }

  bool parks() const override { return true; }  // keeps nothing between forward and backward

 private:
  static Shape make_shape(const std::int64_t* e, int rank) {
    switch (rank) {
      case 1:
        return Shape{e[0]};
      case 2:
        return Shape{e[0], e[1]};
      case 3:
        return Shape{e[0], e[1], e[2]};
      case 4:
        return Shape{e[0], e[1], e[2], e[3]};
      case 5:
        return Shape{e[0], e[1], e[2], e[3], e[4]};
      default:
        return Shape{e[0], e[1], e[2], e[3], e[4], e[5]};
    }
  }

  Shape sample_;
};

}  // namespace zero::nn
