#pragma once
// nn::LayerGPT: GPT-2 assembled from the layer library (nn/layers) instead of hand-written
// units: unit 0 = TokenEmbedding + PositionEmbedding (+ Dropout), units 1..L = two Residuals
// each (attention and MLP branches, with GPT's dropout sites), unit L+1 = LayerNorm + a
// TiedLinear reading unit 0's token table + SoftmaxCrossEntropy on the targets. Parameter names,
// shapes, initialisers and flags equal nn::GPT's, and forward and backward give the same bits
// (f64, f32, bf16, with dropout and activation checkpointing; tested), so it is a drop-in for
// nn::GPT and a template for users' own transformer variants.

#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/dropout.hpp>
#include <zero/nn/layers/layer_norm.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/position_embedding.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/sequential.hpp>
#include <zero/nn/layers/tied_linear.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/model.hpp>
#include <zero/nn/param.hpp>

namespace zero::nn {

/// Appends GPT-2's block `layer` of a model shaped by cfg to unit, as two residual branches
/// with GPT's parameter names, initialisers and dropout sites.
template <class T>
void add_gpt_block(Sequential<T>& unit, const GPTConfig& cfg, std::int64_t layer) {
  const std::int64_t C = cfg.channels;
  const std::string p = "transformer.h." + std::to_string(layer) + ".";
  const std::string site = "h." + std::to_string(layer);  // GPT's dropout key per block
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  auto& attn = unit.template add<Residual<T>>(p + "attn");
  attn.template add<LayerNorm<T>>(p + "ln_1", C);
  attn.template add<Linear<T>>(p + "attn.c_attn", C, 3 * C, true, 0.02);
  attn.template add<CausalSelfAttention<T>>(cfg.num_heads, cfg.attn_dropout, site, 2);
  attn.template add<Linear<T>>(p + "attn.c_proj", C, C, true, residual_std);
  if (cfg.dropout > 0) attn.template add<Dropout<T>>(cfg.dropout, site, 0);
  auto& mlp = unit.template add<Residual<T>>(p + "mlp");
  mlp.template add<LayerNorm<T>>(p + "ln_2", C);
  mlp.template add<Linear<T>>(p + "mlp.c_fc", C, 4 * C, true, 0.02);
  mlp.template add<GELU<T>>();
  mlp.template add<Linear<T>>(p + "mlp.c_proj", 4 * C, C, true, residual_std);
  if (cfg.dropout > 0) mlp.template add<Dropout<T>>(cfg.dropout, site, 1);
}

/// GPT-2 built from layers (see the file comment); an nn::Model.
template <class T>
class LayerGPT {
 public:
  using value_type = T;

  /// The model cfg describes (checkpoint_activations checkpoints every block unit).
  explicit LayerGPT(GPTConfig cfg) : cfg_((cfg.validate(), cfg)) {
    const std::int64_t C = cfg_.channels, V = cfg_.vocab_size;
    units_.reserve(static_cast<std::size_t>(cfg_.num_layers + 2));
    auto& embedding = units_.emplace_back();
    wte_ = &embedding.template add<TokenEmbedding<T>>("transformer.wte", V, C, "tokens", 0.02);
    embedding.template add<PositionEmbedding<T>>("transformer.wpe", cfg_.max_seq_len, C, 0.02);
    if (cfg_.dropout > 0) embedding.template add<Dropout<T>>(cfg_.dropout, "embedding", 0);
    for (std::int64_t l = 0; l < cfg_.num_layers; ++l) {
      Sequential<T>& block = units_.emplace_back();
      add_gpt_block(block, cfg_, l);
      block.set_checkpoint(cfg_.checkpoint_activations);  // as nn::GPT: the blocks only
    }
    auto& head = units_.emplace_back();
    head.template add<LayerNorm<T>>("transformer.ln_f", C);
    head.template add<TiedLinear<T>>(
        "lm_head", [wte = wte_] { return wte->table(); }, C, V);
    loss_ = &head.template add<SoftmaxCrossEntropy<T>>(V, "targets");
  }
  LayerGPT(const LayerGPT&) = delete;
  LayerGPT& operator=(const LayerGPT&) = delete;

  /// The configuration.
  const GPTConfig& config() const { return cfg_; }
  /// L + 2 units.
  int num_units() const { return static_cast<int>(units_.size()); }
  /// The head's index.
  int head_unit() const { return num_units() - 1; }
  /// Unit u's parameters, in binding order (nn::GPT's).
  std::vector<ParamSpec> unit_params(int u) const { return unit(u).params(); }
  /// The head reads unit 0's token table (tied LM head).
  std::vector<int> unit_uses(int u) const {
    return u == head_unit() ? std::vector<int>{0} : std::vector<int>{};
  }
  /// Binds unit u's parameters (views in unit_params order).
  void bind_unit(int u, std::span<const ParamView<T>> views) { unit(u).bind(views); }
  /// Runs unit u forward.
  void forward_unit(int u, StepContext<T>& ctx) { unit(u).forward(ctx); }
  /// Runs unit u backward (ctx.dy in, ctx.dx and ctx.dy out).
  void backward_unit(int u, StepContext<T>& ctx) { unit(u).backward(ctx); }
  /// MACs and FLOPs of unit u's last forward (nn/flops.hpp), for the flops profiler.
  std::optional<FlopCount> unit_forward_flops(int u) const { return unit(u).forward_flops(); }
  /// Forward through every unit; returns the loss (0 without targets).
  T forward(StepContext<T>& ctx) {
    for (int u = 0; u < num_units(); ++u) forward_unit(u, ctx);
    return ctx.loss;
  }
  /// Backward through every unit, accumulating into the bound gradients.
  void backward(StepContext<T>& ctx) {
    for (int u = num_units() - 1; u >= 0; --u) backward_unit(u, ctx);
  }
  /// Logits of the last forward, [B*T, V] (valid until the next micro-step).
  Tensor<const T> logits() const {
    const Tensor<const T> l = loss_->logits();
    return l.reshape(Shape{l.numel() / cfg_.vocab_size, cfg_.vocab_size});
  }

 private:
  Sequential<T>& unit(int u) {
    check_unit(u);
    return units_[static_cast<std::size_t>(u)];
  }
  const Sequential<T>& unit(int u) const {
    check_unit(u);
    return units_[static_cast<std::size_t>(u)];
  }
  void check_unit(int u) const {
    expect<Error>(u >= 0 && u < num_units(), "LayerGPT: unit ", u, " out of range [0, ",
                  num_units(), ")");
  }

  GPTConfig cfg_;
  std::vector<Sequential<T>> units_;
  TokenEmbedding<T>* wte_ = nullptr;
  SoftmaxCrossEntropy<T>* loss_ = nullptr;
};

static_assert(Model<LayerGPT<double>> && Model<LayerGPT<float>> && Model<LayerGPT<bf16>>);

}  // namespace zero::nn
