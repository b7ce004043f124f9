#pragma once
// A pre-LN GPT-2 transformer block (unit 1..L):
//   h   = x + dropout(c_proj(attention(c_attn(ln_1(x)))))     (attention with attn_dropout)
//   out = h + dropout(mlp.c_proj(gelu(mlp.c_fc(ln_2(h)))))
// Linear weights are [out, in] (PyTorch layout); the safetensors import transposes GPT-2's
// Conv1D [in, out]. Residual projections start with stddev 0.02 / sqrt(2 L) as in GPT-2.
// With activation checkpointing the block keeps only its input and output, and recomputes the
// rest just before its backward pass. Every dropout mask is counter-based (site, layer, step),
// so the recomputation and the backward pass redraw the forward's masks without storing them.
// With T = bf16 activations are stored in bf16, LayerNorm statistics in float (kernels compute
// in float and round once per stored value).

#include <array>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/context.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/param.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::nn {

/// One transformer block; x [B*T, C] -> x [B*T, C].
template <class T>
class TransformerBlock {
 public:
  /// The block at index layer (0-based) of a model shaped by cfg.
  TransformerBlock(const GPTConfig& cfg, std::int64_t layer) : cfg_(cfg), layer_(layer) {}

  /// ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weight then bias each).
  std::vector<ParamSpec> params() const {
    const std::int64_t C = cfg_.channels;
    const std::string p = "transformer.h." + std::to_string(layer_) + ".";
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg_.num_layers));
    return {
        {p + "ln_1.weight", {C}, Init::ones, 0, false},
        {p + "ln_1.bias", {C}, Init::zeros, 0, false},
        {p + "attn.c_attn.weight", {3 * C, C}, Init::normal, 0.02, true},
        {p + "attn.c_attn.bias", {3 * C}, Init::zeros, 0, false},
        {p + "attn.c_proj.weight", {C, C}, Init::normal, residual_std, true},
        {p + "attn.c_proj.bias", {C}, Init::zeros, 0, false},
        {p + "ln_2.weight", {C}, Init::ones, 0, false},
        {p + "ln_2.bias", {C}, Init::zeros, 0, false},
        {p + "mlp.c_fc.weight", {4 * C, C}, Init::normal, 0.02, true},
        {p + "mlp.c_fc.bias", {4 * C}, Init::zeros, 0, false},
        {p + "mlp.c_proj.weight", {C, 4 * C}, Init::normal, residual_std, true},
        {p + "mlp.c_proj.bias", {C}, Init::zeros, 0, false},
    };
  }
  /// Binds views in params() order.
  void bind(std::span<const ParamView<T>> views) {
    for (std::size_t i = 0; i < p_.size(); ++i) p_[i] = views[i];
  }

  /// ctx.x <- block(ctx.x).
  void forward(StepContext<T>& ctx) {
    expect_host_kernels(ctx, "nn::TransformerBlock");
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels;
    mark_ = ctx.arena->mark();
    input_ = ctx.x;
    Tensor<T> out = ctx.arena->template allocate<T>({N, C});
    compute(ctx, out);
    if (cfg_.checkpoint_activations && ctx.training) {
      ctx.arena->release(after_output_);  // keep input and output only
    }
    ctx.x = out;
  }

  /// Accumulates parameter gradients and writes ctx.dx (zeroed here) from ctx.dy; frees this
  /// block's activations.
  void backward(StepContext<T>& ctx) {
    using namespace ops::cpu;
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels;
    const std::int64_t B = ctx.batch, Tn = ctx.seq_len, NH = cfg_.num_heads;
    if (cfg_.checkpoint_activations) {  // recompute the internals this block dropped
      Tensor<T> scratch_out = ctx.arena->template allocate<T>({N, C});
      compute(ctx, scratch_out);
    }
    BumpArena& a = *ctx.arena;
    auto zeros = [&](Shape s) {
      Tensor<T> t = a.template allocate<T>(s);
      for (T& v : t) v = T(0);
      return t;
    };
    const T* dy = ctx.dy.data();
    T* dx = ctx.dx.data();
    for (std::int64_t i = 0; i < N * C; ++i) dx[i] = T(0);

    // MLP branch: out = h + drop(fcproj)
    Tensor<T> dh = zeros({N, C});
    accumulate(dh.data(), dy, N * C);
    const T* dfcproj = dropout_grad(ctx, dy, N * C, 1);
    Tensor<T> dgelu = zeros({N, 4 * C}), dfc = zeros({N, 4 * C}), dln2 = zeros({N, C});
    nn::linear_backward<T>(ctx, dgelu.data(), g(10), g(11), dfcproj, s_.gelu.data(), w(10), N,
                           4 * C, C);
    gelu_backward(dfc.data(), s_.fc.data(), dgelu.data(), N * 4 * C);
    nn::linear_backward<T>(ctx, dln2.data(), g(8), g(9), dfc.data(), s_.ln2.data(), w(8), N, C,
                           4 * C);
    layer_norm_backward(dh.data(), g(6), g(7), dln2.data(), s_.h.data(), w(6), s_.mean2.data(),
                        s_.rstd2.data(), N, C);
    // Attention branch: h = x + drop(attproj)
    accumulate(dx, dh.data(), N * C);
    const T* dattproj = dropout_grad(ctx, dh.data(), N * C, 0);
    Tensor<T> datty = zeros({N, C}), dqkv = zeros({N, 3 * C}), dln1 = zeros({N, C});
    nn::linear_backward<T>(ctx, datty.data(), g(4), g(5), dattproj, s_.atty.data(), w(4), N, C, C);
    attention_backward(dqkv.data(), datty.data(), s_.qkv.data(), s_.att.data(), B, Tn, C, NH,
                       attention_dropout(ctx));
    nn::linear_backward<T>(ctx, dln1.data(), g(2), g(3), dqkv.data(), s_.ln1.data(), w(2), N, C,
                           3 * C);
    layer_norm_backward(dx, g(0), g(1), dln1.data(), input_.data(), w(0), s_.mean1.data(),
                        s_.rstd1.data(), N, C);
    a.release(mark_);
  }

 private:
  using Stat = compute_type_t<T>;  // LayerNorm statistics stay in the compute type
  struct Saved {
    Tensor<T> ln1, qkv, att, atty, h, ln2, fc, gelu;
    Tensor<Stat> mean1, rstd1, mean2, rstd2;
  };

  const T* w(int i) const { return p_[static_cast<std::size_t>(i)].value.data(); }
  T* g(int i) const { return p_[static_cast<std::size_t>(i)].grad.data(); }
  CounterRng rng(const StepContext<T>& ctx, int site) const {
    return CounterRng::dropout_site(ctx.seed, static_cast<std::uint64_t>(site),
                                    "dropout.h." + std::to_string(layer_));
  }

  // Runs the block on input_ into out, saving the internals above the arena mark after out.
  void compute(StepContext<T>& ctx, Tensor<T> out) {
    using namespace ops::cpu;
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels;
    const std::int64_t B = ctx.batch, Tn = ctx.seq_len, NH = cfg_.num_heads;
    BumpArena& a = *ctx.arena;
    after_output_ = a.mark();
    s_.ln1 = a.template allocate<T>({N, C});
    s_.mean1 = a.template allocate<Stat>({N});
    s_.rstd1 = a.template allocate<Stat>({N});
    s_.qkv = a.template allocate<T>({N, 3 * C});
    s_.att = a.template allocate<T>({B, NH, Tn, Tn});
    s_.atty = a.template allocate<T>({N, C});
    s_.h = a.template allocate<T>({N, C});
    s_.ln2 = a.template allocate<T>({N, C});
    s_.mean2 = a.template allocate<Stat>({N});
    s_.rstd2 = a.template allocate<Stat>({N});
    s_.fc = a.template allocate<T>({N, 4 * C});
    s_.gelu = a.template allocate<T>({N, 4 * C});
    Tensor<T> proj = a.template allocate<T>({N, C});  // scratch for both projections

    layer_norm_forward(s_.ln1.data(), s_.mean1.data(), s_.rstd1.data(), input_.data(), w(0), w(1),
                       N, C);
    linear_forward(s_.qkv.data(), s_.ln1.data(), w(2), w(3), N, C, 3 * C);
    attention_forward(s_.atty.data(), s_.att.data(), s_.qkv.data(), B, Tn, C, NH,
                      attention_dropout(ctx));
    linear_forward(proj.data(), s_.atty.data(), w(4), w(5), N, C, C);
    dropout(ctx, proj, 0);
    add(s_.h.data(), input_.data(), proj.data(), N * C);
    layer_norm_forward(s_.ln2.data(), s_.mean2.data(), s_.rstd2.data(), s_.h.data(), w(6), w(7), N,
                       C);
    linear_forward(s_.fc.data(), s_.ln2.data(), w(8), w(9), N, C, 4 * C);
    gelu_forward(s_.gelu.data(), s_.fc.data(), N * 4 * C);
    linear_forward(proj.data(), s_.gelu.data(), w(10), w(11), N, 4 * C, C);
    dropout(ctx, proj, 1);
    add(out.data(), s_.h.data(), proj.data(), N * C);
  }

  // Site 2: the attention probabilities (sites 0 and 1 are the residual branches).
  ops::cpu::DropoutMask attention_dropout(const StepContext<T>& ctx) const {
    if (!ctx.training || cfg_.attn_dropout <= 0) return {};
    const std::int64_t Tn = ctx.seq_len;
    return {cfg_.attn_dropout, rng(ctx, 2), static_cast<std::uint32_t>(ctx.step),
            ctx.dropout_first(ctx.batch * cfg_.num_heads * Tn * Tn)};
  }
  // A residual branch's mask (site 0 or 1) over its n elements.
  ops::cpu::DropoutMask residual_dropout(const StepContext<T>& ctx, int site,
                                         std::int64_t n) const {
    return {cfg_.dropout, rng(ctx, site), static_cast<std::uint32_t>(ctx.step),
            ctx.dropout_first(n)};
  }
  void dropout(StepContext<T>& ctx, Tensor<T> x, int site) {
    if (!ctx.training || cfg_.dropout <= 0) return;
    ops::cpu::dropout_forward(x.data(), x.data(), x.numel(),
                              residual_dropout(ctx, site, x.numel()));
  }
  // The gradient through a residual-branch dropout: dy itself when dropout is off or the pass is
  // not a training one, as in the forward (no copy).
  const T* dropout_grad(StepContext<T>& ctx, const T* dy, std::int64_t n, int site) {
    if (!ctx.training || cfg_.dropout <= 0) return dy;
    Tensor<T> d = ctx.arena->template allocate<T>({n});
    for (T& v : d) v = T(0);
    ops::cpu::dropout_backward(d.data(), dy, n, residual_dropout(ctx, site, n));
    return d.data();
  }

  GPTConfig cfg_;
  std::int64_t layer_;
  std::array<ParamView<T>, 12> p_{};
  Saved s_{};
  Tensor<T> input_;
  BumpArena::Mark mark_ = 0, after_output_ = 0;
};

}  // namespace zero::nn
