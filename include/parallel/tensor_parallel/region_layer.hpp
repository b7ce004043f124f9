#pragma once
// RegionLayer: a region operator (regions.hpp) as a layer, for users composing their own
// tensor-parallel units: forward applies the operator to ctx.x [rows, cols], backward adds its
// adjoint of ctx.dy into ctx.dx. The GPT uses scatter_to_sp to enter the sequence-parallel
// region after its embeddings.

#include <any>
#include <string>

#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::parallel {

/// One region operator over the last dimension's rows.
template <class T>
class RegionLayer final : public nn::Layer<T> {
 public:
  /// region applied over tp.
  RegionLayer(TensorParallel tp, Region region) : tp_(std::move(tp)), region_(region) {}

  std::string describe() const override { return "Region '" + std::string(name_of(region_)) + "'"; }
  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    expect<ShapeError>(ctx.x.data() != nullptr && ctx.x.rank() >= 1, describe(),
                       ": no input activation");
    cols_ = ctx.x.dim(-1);
    rows_ = ctx.x.numel() / cols_;
    const RegionShape o = region_output_shape(region_, tp_.size(), rows_, cols_);
    const bool same = o.rows == rows_ && o.cols == cols_;
    Tensor<T> y = ctx.arena->template allocate<T>(same ? ctx.x.shape() : Shape{o.rows, o.cols});
    region_forward(region_, tp_, ctx.x.data(), y.data(), rows_, cols_);
    ctx.x = y;
  }
  void backward(nn::StepContext<T>& ctx) override {
    region_backward(region_, tp_, ctx.dy.data(), ctx.dx.data(), rows_, cols_);
  }

  /// Data movement only.
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput&) const override {
    return nn::FlopCount{};
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(rows_, cols_); }
  void resume(std::any saved) override { nn::resume_members(saved, rows_, cols_); }

 private:
  TensorParallel tp_;
  Region region_;
  std::int64_t rows_ = 0, cols_ = 0;
};

}  // namespace zero::parallel
