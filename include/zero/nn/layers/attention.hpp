#pragma once
// CausalSelfAttention: multi-head causal attention on a packed qkv activation [B*T, 3C] (the
// output of a Linear(C, 3C), GPT-2's c_attn layout: q, k, v each C channels, head h in channels
// [h*hs, (h+1)*hs)), giving [B*T, C]. Rows are (batch, position) with B = ctx.batch and
// T = ctx.seq_len, so it belongs to models fed tokens or [B, T, ...] inputs. The layer has no
// parameters (the projections are Linear layers around it); it saves in the arena what its
// kernels ask for: the probabilities [B, NH, T, T] on the host, each row's log-sum-exp on a GPU.
// Attention dropout redraws its counter-based mask from (site, ctx.step, the rows'
// StepContext::dropout_mask, with the heads' part of the model's when split) in backward
// instead of storing it.

#include <any>
#include <cstdint>
#include <string>

#include <zero/core/rng.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// Causal self-attention: qkv [B*T, 3C] -> [B*T, C].
template <class T>
class CausalSelfAttention final : public Layer<T> {
 public:
  /// heads must divide C; attn_dropout applies to the probabilities while training, its mask
  /// keyed by (seed, site) (GPT's blocks: site "h.<layer>", seed 2). shard: these heads' part of
  /// the model's (within_rows; a tensor-parallel or Ulysses rank's heads), so the ranks draw the
  /// probabilities' mask of one rank holding every head.
  explicit CausalSelfAttention(std::int64_t heads, double attn_dropout = 0.0,
                               std::string site = "attention", std::uint64_t seed = 0,
                               DropoutShard shard = {})
      : heads_(heads), p_(attn_dropout), site_(std::move(site)), seed_(seed), shard_(shard) {
    expect<ConfigError>(heads > 0, "CausalSelfAttention: heads = ", heads, "; expected > 0");
    expect<ConfigError>(p_ >= 0.0 && p_ < 1.0, "CausalSelfAttention '", site_,
                        "': attn_dropout = ", p_, "; expected 0 <= p < 1");
  }

  std::string describe() const override { return "CausalSelfAttention '" + site_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    expect<ShapeError>(ctx.x.data() != nullptr && ctx.x.dim(-1) > 0 && ctx.x.dim(-1) % 3 == 0,
                       describe(), ": input must be packed qkv [B*T, 3C]");
    C_ = ctx.x.dim(-1) / 3;
    expect<ShapeError>(C_ % heads_ == 0, describe(), ": C = ", C_, " is not divisible by ", heads_,
                       " heads");
    B_ = ctx.batch;
    T_ = ctx.seq_len;
    expect<ShapeError>(B_ * T_ * 3 * C_ == ctx.x.numel(), describe(), ": ",
                       ctx.x.numel() / (3 * C_),
                       " rows of qkv, but the micro-batch has batch * seq_len = ", B_ * T_);
    qkv_ = ctx.x;
    Kernels<T>& kernels = kernels_of(ctx);
    saved_ = ctx.arena->template allocate<std::byte>(
        {static_cast<std::int64_t>(kernels.attention_saved_bytes(B_, T_, heads_))});
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, C_));
    mask_ = mask(ctx);
    kernels.attention_forward(y.data(), saved_.data(), qkv_.data(), B_, T_, C_, heads_, mask_);
    y_ = y;
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    kernels_of(ctx).attention_backward(ctx.dx.data(), ctx.dy.data(), qkv_.data(), y_.data(),
                                       saved_.data(), B_, T_, C_, heads_, mask_, ctx.overwrite_dx);
  }
  /// The device's kernels write dqkv themselves; the host's zero it first (kernels.hpp).
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    // Per sequence and head, T(T+1)/2 unmasked scores, each a head_dim dot product for QK^T and
    // one for the probabilities times V; plus the softmax over the scores.
    const std::int64_t channels = in.input[-1] / 3, seq = in.seq_len;
    const std::int64_t scores = in.batch * heads_ * seq * (seq + 1) / 2;
    const std::int64_t macs = 2 * scores * (channels / heads_);
    return FlopCount{macs, 2 * macs + scores};
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(B_, T_, C_, qkv_, y_, saved_, mask_); }
  void resume(std::any saved) override {
    nn::resume_members(saved, B_, T_, C_, qkv_, y_, saved_, mask_);
  }

 private:
  // The mask over the probabilities [B, heads, T, T] of the step's rows.
  ops::cpu::DropoutMask mask(const StepContext<T>& ctx) const {
    if (!ctx.training || p_ <= 0) return {};
    return ctx.dropout_mask(p_, CounterRng::dropout_site(ctx.seed, seed_, "dropout." + site_),
                            ctx.batch * heads_ * ctx.seq_len * ctx.seq_len, shard_);
  }

  std::int64_t heads_;
  double p_;
  std::string site_;
  std::uint64_t seed_;
  DropoutShard shard_;
  std::int64_t B_ = 0, T_ = 0, C_ = 0;
  Tensor<T> qkv_, y_;        // the forward's input and output (the layers after it only read y)
  Tensor<std::byte> saved_;  // what the kernels keep for backward
  ops::cpu::DropoutMask mask_;
};

}  // namespace zero::nn
