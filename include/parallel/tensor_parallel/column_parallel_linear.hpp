#pragma once
// ColumnParallelLinear: a Linear whose weight [out, in] is split on the output dimension, rank i
// holding rows [i*out/tp, (i+1)*out/tp) (with a stride, the same part of each of `stride` blocks:
// GPT-2's fused q|k|v, so every rank gets whole heads). Its output is the rank's out/tp columns
// (the tensor-parallel region); the input enters that region by
//   - copy_to_tp (forward identity, backward all-reduce of dx) when the input is replicated, or
//   - gather_from_sp (forward all-gather of the rows, backward reduce-scatter of dx) when the
//     input is a sequence-parallel shard. The gathered input is not kept: backward gathers it
//     again for the weight gradient (Megatron's choice: activation memory stays 1/tp).
// The input-gradient collective runs while the weight gradient is computed.
// With a tied weight (the LM head reading the vocab-parallel embedding table) the layer owns no
// parameters and uses the owner's part.

#include <any>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::parallel {

/// [N, in] (replicated, or [N/tp, in] with sequence parallelism) -> [N, out/tp].
template <class T>
class ColumnParallelLinear final : public nn::Layer<T> {
 public:
  /// Parameters name.weight [out/tp, in] and name.bias [out/tp], parts of the logical [out, in]
  /// and [out] split `stride`-wise; stddev <= 0 means 1/sqrt(in).
  ColumnParallelLinear(TensorParallel tp, std::string name, std::int64_t in, std::int64_t out,
                       bool bias = true, double stddev = 0.0, int stride = 1)
      : tp_(std::move(tp)),
        name_(std::move(name)),
        in_(in),
        out_(out),
        bias_(bias),
        stddev_(stddev > 0 ? stddev : 1.0 / std::sqrt(static_cast<double>(in))),
        stride_(stride) {
    check_sizes();
  }
  /// The LM-head form: weight() returns the owner's current view of the part [out/tp, in].
  ColumnParallelLinear(TensorParallel tp, std::string name,
                       std::function<nn::ParamView<T>()> weight, std::int64_t in, std::int64_t out)
      : tp_(std::move(tp)),
        name_(std::move(name)),
        in_(in),
        out_(out),
        bias_(false),
        stddev_(0),
        stride_(1),
        tied_(std::move(weight)) {
    check_sizes();
  }

  std::string describe() const override { return "ColumnParallelLinear '" + name_ + "'"; }
  std::vector<nn::ParamSpec> params() const override {
    if (tied_) return {};
    const int t = tp_.size(), r = tp_.rank();
    std::vector<nn::ParamSpec> p{{name_ + ".weight",
                                  {out_ / t, in_},
                                  nn::Init::normal,
                                  stddev_,
                                  true,
                                  nn::TensorSplit::of({out_, in_}, 0, t, r, stride_)}};
    if (bias_) {
      p.push_back({name_ + ".bias",
                   {out_ / t},
                   nn::Init::zeros,
                   0,
                   false,
                   nn::TensorSplit::of({out_}, 0, t, r, stride_)});
    }
    return p;
  }
  void bind(std::span<const nn::ParamView<T>> views) override {
    if (tied_) return;
    weight_ = views[0];
    if (bias_) bias_view_ = views[1];
  }
  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    const std::int64_t local_rows = nn::rows_of(ctx.x, in_, describe());
    const bool sp = tp_.sequence_parallel();
    rows_ = sp ? local_rows * tp_.size() : local_rows;
    input_ = ctx.x;
    const nn::ParamView<T> w = weight();
    const Shape out_shape =
        sp ? Shape{rows_, out_ / tp_.size()} : ctx.x.shape().with_extent(-1, out_ / tp_.size());
    Tensor<T> y = ctx.arena->template allocate<T>(out_shape);
    const auto mark = ctx.arena->mark();
    const T* x = input_.data();
    if (sp) {
      Tensor<T> full = ctx.arena->template allocate<T>({rows_, in_});
      region_forward(Region::gather_from_sp, tp_, input_.data(), full.data(), local_rows, in_);
      x = full.data();
    }
    ops::cpu::linear_forward<T>(y.data(), x, w.value.data(),
                                bias_ ? bias_view_.value.data() : nullptr, rows_, in_,
                                out_ / tp_.size());
    ctx.arena->release(mark);
    ctx.x = y;
  }
  void backward(nn::StepContext<T>& ctx) override {
    const bool sp = tp_.sequence_parallel();
    const nn::ParamView<T> w = weight();
    const std::int64_t cols = out_ / tp_.size();
    const auto mark = ctx.arena->mark();
    const T* x = input_.data();
    if (sp) {  // gather the input again instead of having kept it
      Tensor<T> full = ctx.arena->template allocate<T>({rows_, in_});
      region_forward(Region::gather_from_sp, tp_, input_.data(), full.data(), rows_ / tp_.size(),
                     in_);
      x = full.data();
    }
    if (!tp_.active()) {
      nn::linear_backward<T>(ctx, ctx.dx.data(), w.grad.data(),
                             bias_ ? bias_view_.grad.data() : nullptr, ctx.dy.data(), x,
                             w.value.data(), rows_, in_, cols);
      ctx.arena->release(mark);
      return;
    }
    // This rank's share of dx over the full rows; the collective (all-reduce, or reduce-scatter
    // to the rank's rows) runs while the weight gradient is computed.
    Tensor<T> partial = ctx.arena->template allocate<T>({rows_, in_});
    for (T& v : partial) v = T(0);
    ops::cpu::linear_backward<T>(partial.data(), nullptr, nullptr, ctx.dy.data(), x, w.value.data(),
                                 rows_, in_, cols);
    const std::int64_t local = sp ? rows_ / tp_.size() * in_ : rows_ * in_;
    Tensor<T> reduced = ctx.arena->template allocate<T>({local});
    const std::span<const T> send(partial.data(), static_cast<std::size_t>(partial.numel()));
    const std::span<T> recv(reduced.data(), static_cast<std::size_t>(local));
    Work work = sp ? tp_.comm().reduce_scatter_async(send, recv, ReduceOp::sum)
                   : tp_.comm().all_reduce_async(send, recv, ReduceOp::sum);
    nn::linear_backward<T>(ctx, nullptr, w.grad.data(), bias_ ? bias_view_.grad.data() : nullptr,
                           ctx.dy.data(), x, w.value.data(), rows_, in_, cols);
    work.wait();
    ops::cpu::accumulate(ctx.dx.data(), reduced.data(), local);
    ctx.arena->release(mark);
  }

  /// This rank's share: its out/tp columns over every row (the gathered rows with SP).
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput& in) const override {
    const std::int64_t rows = in.input.numel() / in_ * (tp_.sequence_parallel() ? tp_.size() : 1);
    return nn::matmul_flops(rows, in_, out_ / tp_.size());
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_, rows_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_, rows_); }

 private:
  void check_sizes() const {
    expect<ConfigError>(in_ > 0 && out_ > 0, describe(), ": in = ", in_, ", out = ", out_,
                        "; both must be positive");
    expect<ConfigError>(
        out_ % (static_cast<std::int64_t>(tp_.size()) * stride_) == 0, describe(), ": ", out_,
        " output features do not split over tensor-parallel size ", tp_.size(),
        stride_ > 1 ? " in each of " + std::to_string(stride_) + " blocks" : std::string());
  }
  nn::ParamView<T> weight() const { return tied_ ? tied_() : weight_; }

  TensorParallel tp_;
  std::string name_;
  std::int64_t in_, out_;
  bool bias_;
  double stddev_;
  int stride_;
  std::function<nn::ParamView<T>()> tied_;
  nn::ParamView<T> weight_, bias_view_;
  Tensor<T> input_;
  std::int64_t rows_ = 0;
};

}  // namespace zero::parallel
