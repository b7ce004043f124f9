#pragma once
// nn::HandWrittenGPT: GPT-2 as three hand-written units (Embedding, TransformerBlock, LMHead),
// the model zero trained before the layer library existed. nn::GPT (gpt.hpp) is now GPT-2 built
// from layers (nn::LayerGPT); this twin stays as the independent reference it is tested against
// bit for bit (f64, f32, bf16, dropout and checkpointing on and off: tests/nn/test_layers.cpp).
// Units: 0 = embedding, 1..L = transformer blocks, L+1 = head tied to the token embedding.

#include <span>
#include <vector>

#include <zero/core/buffer.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/embedding.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/lm_head.hpp>
#include <zero/nn/model.hpp>
#include <zero/nn/param.hpp>
#include <zero/nn/transformer_block.hpp>

namespace zero::nn {

/// GPT-2 over element type T: f64 for reference tests, f32 for training on the host, bf16 for
/// bf16 storage of weights, activations and gradients with float arithmetic (the loss is
/// computed in float and returned rounded to T).
template <class T>
class HandWrittenGPT {
 public:
  using value_type = T;

  explicit HandWrittenGPT(GPTConfig cfg)
      : cfg_((cfg.validate(), cfg)), embedding_(cfg_), head_(cfg_) {
    for (std::int64_t l = 0; l < cfg_.num_layers; ++l) blocks_.emplace_back(cfg_, l);
  }

  const GPTConfig& config() const { return cfg_; }
  int num_units() const { return static_cast<int>(cfg_.num_layers) + 2; }
  int head_unit() const { return num_units() - 1; }

  /// Parameters owned by unit, in binding order.
  std::vector<ParamSpec> unit_params(int unit) const {
    check_unit(unit);
    if (unit == 0) return embedding_.params();
    if (unit == head_unit()) return head_.params();
    return blocks_[static_cast<std::size_t>(unit - 1)].params();
  }
  /// The head reads the embedding's wte (tied LM head).
  std::vector<int> unit_uses(int unit) const {
    check_unit(unit);
    return unit == head_unit() ? std::vector<int>{0} : std::vector<int>{};
  }
  /// Binds unit's parameters (views in unit_params order).
  void bind_unit(int unit, std::span<const ParamView<T>> views) {
    check_unit(unit);
    expect<ShapeError>(views.size() == unit_params(unit).size(), "GPT::bind_unit(", unit, "): got ",
                       views.size(), " views, expected ", unit_params(unit).size());
    if (unit == 0) {
      embedding_.bind(views);
    } else if (unit == head_unit()) {
      head_.bind(views);
    } else {
      blocks_[static_cast<std::size_t>(unit - 1)].bind(views);
    }
  }

  /// Runs unit forward: ctx.x in, ctx.x out (unit 0 reads ctx.tokens; the head sets ctx.loss).
  void forward_unit(int unit, StepContext<T>& ctx) {
    check_unit(unit);
    if (unit == 0) {
      embedding_.forward(ctx);
    } else if (unit == head_unit()) {
      head_.forward(ctx, embedding_.wte());
    } else {
      blocks_[static_cast<std::size_t>(unit - 1)].forward(ctx);
    }
  }
  /// Runs unit backward: ctx.dy in (ignored by the head, which seeds dloss = ctx.loss_scale),
  /// ctx.dx out; afterwards ctx.dy = ctx.dx for the unit below.
  void backward_unit(int unit, StepContext<T>& ctx) {
    check_unit(unit);
    const std::size_t n = static_cast<std::size_t>(ctx.tokens_count() * cfg_.channels);
    Buffer<T>& out = grad_stream_[static_cast<std::size_t>(unit % 2)];
    if (out.size() < n) out = Buffer<T>(n);
    ctx.dx = out.view({ctx.tokens_count(), cfg_.channels});
    if (unit == 0) {
      embedding_.backward(ctx);
    } else if (unit == head_unit()) {
      head_.backward(ctx, embedding_.wte());
    } else {
      blocks_[static_cast<std::size_t>(unit - 1)].backward(ctx);
    }
    ctx.dy = ctx.dx;
  }

  /// Forward through every unit; returns the loss (0 in an evaluation without targets).
  T forward(StepContext<T>& ctx) {
    for (int u = 0; u < num_units(); ++u) forward_unit(u, ctx);
    return ctx.loss;
  }
  /// Backward through every unit, accumulating into the bound gradients.
  void backward(StepContext<T>& ctx) {
    for (int u = num_units() - 1; u >= 0; --u) backward_unit(u, ctx);
  }
  /// Logits of the last forward, [B*T, V].
  Tensor<const T> logits() const { return head_.logits(); }

 private:
  void check_unit(int unit) const {
    expect<Error>(unit >= 0 && unit < num_units(), "GPT: unit ", unit, " out of range [0, ",
                  num_units(), ")");
  }

  GPTConfig cfg_;
  Embedding<T> embedding_;
  std::vector<TransformerBlock<T>> blocks_;
  LMHead<T> head_;
  Buffer<T> grad_stream_[2];
};

static_assert(Model<HandWrittenGPT<double>> && Model<HandWrittenGPT<float>> &&
              Model<HandWrittenGPT<bf16>>);

}  // namespace zero::nn
