#pragma once
// The head unit (unit L+1): final LayerNorm, the LM head tied to the token embedding
// (logits = ln_f(x) @ wte^T), and the fused softmax cross-entropy. It owns ln_f and uses
// the embedding unit's wte, reading it and accumulating into its gradient. With T = bf16 the
// logits are stored in bf16 while the LayerNorm statistics, logsumexp, per-token losses and their
// mean are float; ctx.loss is that float mean rounded once to T. A table padded past the
// vocabulary (GPTConfig::padded_vocab_size) gives logits [B*T, rows] whose padding columns are
// left out of the softmax (their dlogits zero).

#include <span>
#include <vector>

#include <zero/nn/context.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/nn/param.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::nn {

/// x [B*T, C] -> logits [B*T, V] (V the table's rows) and, with targets, the mean loss.
template <class T>
class LMHead {
 public:
  explicit LMHead(const GPTConfig& cfg) : cfg_(cfg) {}

  /// ln_f weight and bias (wte belongs to the embedding unit).
  std::vector<ParamSpec> params() const {
    return {{"transformer.ln_f.weight", {cfg_.channels}, Init::ones, 0, false},
            {"transformer.ln_f.bias", {cfg_.channels}, Init::zeros, 0, false}};
  }
  /// Binds ln_f in params() order.
  void bind(std::span<const ParamView<T>> views) {
    ln_w_ = views[0];
    ln_b_ = views[1];
  }

  /// Computes logits (kept until backward or the next forward) and, when ctx.targets is set,
  /// ctx.loss. wte is the embedding's bound weight.
  void forward(StepContext<T>& ctx, const ParamView<T>& wte) {
    expect_host_kernels(ctx, "GPT's head unit (nn::HandWrittenGPT)");
    expect_labels_when_training(ctx, ctx.targets != nullptr, "GPT's head unit (nn::HandWrittenGPT)",
                                "targets");
    using namespace ops::cpu;
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels, V = cfg_.vocab_rows();
    BumpArena& a = *ctx.arena;
    mark_ = a.mark();
    input_ = ctx.x;
    ln_ = a.template allocate<T>({N, C});
    mean_ = a.template allocate<Stat>({N});
    rstd_ = a.template allocate<Stat>({N});
    logits_ = a.template allocate<T>({N, V});
    layer_norm_forward(ln_.data(), mean_.data(), rstd_.data(), input_.data(), ln_w_.value.data(),
                       ln_b_.value.data(), N, C);
    linear_forward<T>(logits_.data(), ln_.data(), wte.value.data(), nullptr, N, C, V);
    if (ctx.targets != nullptr) {
      Tensor<Stat> losses = a.template allocate<Stat>({N});
      ctx.loss = convert<T>(cross_entropy_forward(losses.data(), logits_.data(), ctx.targets, N,
                                                  cfg_.vocab_size, nullptr, V) +
                            static_cast<Stat>(ctx.aux_loss));
    }
  }

  /// Seeds the backward pass with dloss = ctx.loss_scale and writes ctx.dx (zeroed here).
  void backward(StepContext<T>& ctx, const ParamView<T>& wte) {
    using namespace ops::cpu;
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels, V = cfg_.vocab_rows();
    expect<Error>(ctx.targets != nullptr, "LMHead::backward: the step has no targets");
    BumpArena& a = *ctx.arena;
    Tensor<T> dlogits = a.template allocate<T>({N, V});
    cross_entropy_backward(dlogits.data(), logits_.data(), ctx.targets, N, cfg_.vocab_size,
                           convert<Stat>(ctx.loss_scale), -1, nullptr, V);
    Tensor<T> dln = a.template allocate<T>({N, C});
    for (T& v : dln) v = T(0);
    nn::linear_backward<T>(ctx, dln.data(), wte.grad.data(), nullptr, dlogits.data(), ln_.data(),
                           wte.value.data(), N, C, V);
    T* dx = ctx.dx.data();
    for (std::int64_t i = 0; i < N * C; ++i) dx[i] = T(0);
    layer_norm_backward(dx, ln_w_.grad.data(), ln_b_.grad.data(), dln.data(), input_.data(),
                        ln_w_.value.data(), mean_.data(), rstd_.data(), N, C);
    a.release(mark_);
  }

  /// Logits of the last forward, [B*T, V].
  Tensor<const T> logits() const { return logits_; }

 private:
  using Stat = compute_type_t<T>;  // statistics and losses stay in the compute type

  GPTConfig cfg_;
  ParamView<T> ln_w_, ln_b_;
  Tensor<T> input_, ln_, logits_;
  Tensor<Stat> mean_, rstd_;
  BumpArena::Mark mark_ = 0;
};

}  // namespace zero::nn
