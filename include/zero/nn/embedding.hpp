#pragma once
// The embedding unit: token embedding wte [V, C] plus learned positions wpe [maxT, C] (V: the
// table's rows, GPTConfig::vocab_rows(), its padding included).
// wte is also the LM head's weight (tied); it belongs to this unit, and the head declares that
// it uses it.

#include <span>
#include <string>
#include <vector>

#include <zero/nn/context.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/param.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/embedding.hpp>

namespace zero::nn {

/// Unit 0 of GPT: tokens -> x [B*T, C].
template <class T>
class Embedding {
 public:
  explicit Embedding(const GPTConfig& cfg) : cfg_(cfg) {}

  /// wte then wpe.
  std::vector<ParamSpec> params() const {
    // The rows in use are the vocabulary's, as LayerGPT's table declares them.
    return {
        {"transformer.wte.weight",
         {cfg_.vocab_rows(), cfg_.channels},
         Init::normal,
         0.02,
         true,
         {},
         cfg_.vocab_size},
        {"transformer.wpe.weight", {cfg_.max_seq_len, cfg_.channels}, Init::normal, 0.02, true}};
  }
  /// Binds views in params() order.
  void bind(std::span<const ParamView<T>> views) {
    wte_ = views[0];
    wpe_ = views[1];
  }
  const ParamView<T>& wte() const { return wte_; }

  /// Writes ctx.x = wte[tokens] + wpe[positions] (with dropout when training and configured).
  void forward(StepContext<T>& ctx) {
    expect_host_kernels(ctx, "GPT's embedding unit (nn::HandWrittenGPT)");
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels;
    expect<ShapeError>(ctx.seq_len <= cfg_.max_seq_len, "Embedding: sequence length ", ctx.seq_len,
                       " exceeds max_seq_len ", cfg_.max_seq_len);
    mark_ = ctx.arena->mark();
    Tensor<T> out = ctx.arena->template allocate<T>({N, C});
    ops::cpu::embedding_forward(out.data(), ctx.tokens, wte_.value.data(), wpe_.value.data(),
                                ctx.batch, ctx.seq_len, C, cfg_.vocab_size);
    if (ctx.training && cfg_.dropout > 0) {
      ops::cpu::dropout_forward(out.data(), out.data(), N * C, mask(ctx, N * C));
    }
    ctx.x = out;
  }
  /// Accumulates into wte/wpe gradients from ctx.dy; frees this unit's activations.
  void backward(StepContext<T>& ctx) {
    const std::int64_t N = ctx.tokens_count(), C = cfg_.channels;
    const T* dy = ctx.dy.data();
    Tensor<T> masked;
    if (ctx.training && cfg_.dropout > 0) {  // as the forward: no mask outside training
      masked = ctx.arena->template allocate<T>({N, C});
      for (T& v : masked) v = T(0);
      ops::cpu::dropout_backward(masked.data(), dy, N * C, mask(ctx, N * C));
      dy = masked.data();
    }
    ops::cpu::embedding_backward(wte_.grad.data(), wpe_.grad.data(), dy, ctx.tokens, ctx.batch,
                                 ctx.seq_len, C);
    ctx.dx = {};
    ctx.arena->release(mark_);
  }

 private:
  ops::cpu::DropoutMask mask(const StepContext<T>& ctx, std::int64_t n) const {
    return {cfg_.dropout, CounterRng::dropout_site(ctx.seed, 0, "dropout.embedding"),
            static_cast<std::uint32_t>(ctx.step), ctx.dropout_first(n)};
  }

  GPTConfig cfg_;
  ParamView<T> wte_, wpe_;
  BumpArena::Mark mark_ = 0;
};

}  // namespace zero::nn
