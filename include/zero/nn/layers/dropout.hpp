#pragma once
// Dropout as a layer: inverted dropout with the counter-based mask of ops/cpu/dropout.hpp,
// keyed by the layer's site name, the run's ctx.seed and ctx.step, so backward redraws the
// forward's mask without storing it. Inactive when not training or p = 0 (x passes through).
// When the micro-batch says where its rows sit in the step's global batch (ctx.first_row), each
// row is decided at its global row's indices (StepContext::dropout_mask), so several ranks
// and micro-batches equal one process on the whole batch; otherwise the mask follows the local
// row index. A layer that holds a rank's part of the rows (a DropoutShard: Megatron sequence
// parallelism's block of rows, a Ulysses rank's positions) draws its part of the whole mask.

#include <any>
#include <cstdint>
#include <string>

#include <zero/core/rng.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// Drops elements with probability p during training.
template <class T>
class Dropout final : public Layer<T> {
 public:
  /// p in [0, 1); (seed, site) key the mask (two Dropout layers with one key share masks;
  /// GPT's blocks use site "h.<layer>" with seeds 0 and 1 for their two residual branches);
  /// shard: the part of the micro-batch's tensor this rank holds.
  Dropout(double p, std::string site, std::uint64_t seed = 0, DropoutShard shard = {})
      : p_(p), site_(std::move(site)), seed_(seed), shard_(shard) {
    expect<ConfigError>(p >= 0.0 && p < 1.0, "Dropout '", site_, "': p = ", p,
                        "; expected 0 <= p < 1");
  }

  std::string describe() const override { return "Dropout '" + site_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    expect_input_activation(ctx.x, describe());
    active_ = ctx.training && p_ > 0.0;
    if (!active_) return;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    kernels_of(ctx).dropout_forward(y.data(), ctx.x.data(), y.numel(), mask(ctx, y.numel()));
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t n = ctx.dx.numel();
    if (active_) {
      kernels_of(ctx).dropout_backward(ctx.dx.data(), ctx.dy.data(), n, mask(ctx, n));
    } else {
      kernels_of(ctx).accumulate(ctx.dx.data(), ctx.dy.data(), n);
    }
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel());
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(active_); }
  void resume(std::any saved) override { nn::resume_members(saved, active_); }

 private:
  // The mask of this site for the n elements of the step's tensor (their rows' indices).
  ops::cpu::DropoutMask mask(const StepContext<T>& ctx, std::int64_t n) const {
    return ctx.dropout_mask(p_, CounterRng::dropout_site(ctx.seed, seed_, "dropout." + site_), n,
                            shard_);
  }

  double p_;
  std::string site_;
  std::uint64_t seed_;
  DropoutShard shard_;
  bool active_ = false;
};

}  // namespace zero::nn
