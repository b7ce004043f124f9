#pragma once
// RowParallelLinear: a Linear whose weight [out, in] is split on the input dimension, rank i
// holding columns [i*in/tp, (i+1)*in/tp); its input is the tensor-parallel region (the output of
// a column-parallel layer, or of per-head attention). Each rank's product is a partial sum, which
//   - reduce_from_tp all-reduces (every rank gets all rows), or
//   - reduce_scatter_to_sp reduce-scatters (each rank gets its 1/tp of the rows) with sequence
//     parallelism.
// The bias is whole on every rank and added after the reduction, once. Without sequence
// parallelism its gradient is the same on every rank; with it each rank sums its own rows, and
// the contributions are summed over the accumulation window and all-reduced over the group once,
// at the window's last backward, before they are added (window_grad_sum.hpp).

#include <any>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <parallel/tensor_parallel/window_grad_sum.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/linear.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::parallel {

/// [N, in/tp] -> [N, out] (replicated), or [N/tp, out] with sequence parallelism.
template <class T>
class RowParallelLinear final : public nn::Layer<T> {
 public:
  /// Parameters name.weight [out, in/tp] (part of [out, in], split on dimension 1) and
  /// name.bias [out] (whole); stddev <= 0 means 1/sqrt(in).
  RowParallelLinear(TensorParallel tp, std::string name, std::int64_t in, std::int64_t out,
                    bool bias = true, double stddev = 0.0)
      : tp_(std::move(tp)),
        name_(std::move(name)),
        in_(in),
        out_(out),
        bias_(bias),
        stddev_(stddev > 0 ? stddev : 1.0 / std::sqrt(static_cast<double>(in))) {
    expect<ConfigError>(in > 0 && out > 0, describe(), ": in = ", in, ", out = ", out,
                        "; both must be positive");
    expect<ConfigError>(in % tp_.size() == 0, describe(), ": ", in,
                        " input features do not split over tensor-parallel size ", tp_.size());
  }

  std::string describe() const override { return "RowParallelLinear '" + name_ + "'"; }
  std::vector<nn::ParamSpec> params() const override {
    const int t = tp_.size();
    std::vector<nn::ParamSpec> p{{name_ + ".weight",
                                  {out_, in_ / t},
                                  nn::Init::normal,
                                  stddev_,
                                  true,
                                  nn::TensorSplit::of({out_, in_}, 1, t, tp_.rank())}};
    if (bias_) p.push_back({name_ + ".bias", {out_}, nn::Init::zeros, 0, false});
    return p;
  }
  void bind(std::span<const nn::ParamView<T>> views) override {
    weight_ = views[0];
    if (bias_) bias_view_ = views[1];
  }
  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    const std::int64_t part = in_ / tp_.size();
    rows_ = nn::rows_of(ctx.x, part, describe());
    input_ = ctx.x;
    const bool sp = tp_.sequence_parallel();
    const std::int64_t out_rows =
        sp ? region_output_shape(Region::reduce_scatter_to_sp, tp_.size(), rows_, out_).rows
           : rows_;
    Tensor<T> y = ctx.arena->template allocate<T>(sp ? Shape{out_rows, out_}
                                                     : ctx.x.shape().with_extent(-1, out_));
    const auto mark = ctx.arena->mark();
    Tensor<T> partial = sp ? ctx.arena->template allocate<T>({rows_, out_}) : y;
    ops::cpu::linear_forward<T>(partial.data(), input_.data(), weight_.value.data(), nullptr, rows_,
                                part, out_);
    region_forward(sp ? Region::reduce_scatter_to_sp : Region::reduce_from_tp, tp_, partial.data(),
                   y.data(), rows_, out_);
    ctx.arena->release(mark);
    if (bias_) add_bias(y.data(), out_rows);
    ctx.x = y;
  }
  void backward(nn::StepContext<T>& ctx) override {
    const std::int64_t part = in_ / tp_.size();
    const bool sp = tp_.sequence_parallel();
    const auto mark = ctx.arena->mark();
    const T* dy = ctx.dy.data();
    if (sp) {  // the gradient of every row, for dx and the weight gradient
      Tensor<T> full = ctx.arena->template allocate<T>({rows_, out_});
      region_forward(Region::gather_from_sp, tp_, ctx.dy.data(), full.data(), rows_ / tp_.size(),
                     out_);
      dy = full.data();
    }
    nn::linear_backward<T>(ctx, ctx.dx.data(), weight_.grad.data(), nullptr, dy, input_.data(),
                           weight_.value.data(), rows_, part, out_);
    if (bias_) {
      if (sp) {  // each rank summed its own rows: add up the contributions over the group
        Tensor<T> db = ctx.arena->template allocate<T>({out_});
        for (T& v : db) v = T(0);
        ops::cpu::linear_backward<T>(nullptr, nullptr, db.data(), ctx.dy.data(), nullptr, nullptr,
                                     rows_ / tp_.size(), part, out_);
        const auto n = static_cast<std::size_t>(out_);
        bias_sums_.resize(n);
        bias_sums_.add(ctx, std::span<const T>(db.data(), n));
        if (bias_sums_.reduce(ctx, tp_)) bias_sums_.add_to(bias_view_.grad.data(), 0, n);
      } else {
        ops::cpu::linear_backward<T>(nullptr, nullptr, bias_view_.grad.data(), dy, nullptr, nullptr,
                                     rows_, part, out_);
      }
    }
    ctx.arena->release(mark);
  }

  /// This rank's share: its in/tp input columns over every row.
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput& in) const override {
    const std::int64_t part = in_ / tp_.size();
    return nn::matmul_flops(in.input.numel() / part, part, out_);
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_, rows_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_, rows_); }

 private:
  void add_bias(T* y, std::int64_t rows) const {
    const T* b = bias_view_.value.data();
    const std::int64_t C = out_;
    ops::cpu::parallel_for(rows, [&](std::int64_t n) {
      for (std::int64_t c = 0; c < C; ++c) {
        y[n * C + c] = ops::cpu::store<T>(ops::cpu::load(y[n * C + c]) + ops::cpu::load(b[c]));
      }
    });
  }

  TensorParallel tp_;
  std::string name_;
  std::int64_t in_, out_;
  bool bias_;
  double stddev_;
  nn::ParamView<T> weight_, bias_view_;
  Tensor<T> input_;
  std::int64_t rows_ = 0;
  WindowGradSum<T> bias_sums_;  // sequence parallelism: the bias gradient's window and group sum
};

}  // namespace zero::parallel
