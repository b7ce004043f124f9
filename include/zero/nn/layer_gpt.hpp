#pragma once
// nn::LayerGPT: GPT-2 assembled from the layer library (nn/layers) instead of hand-written
// units: unit 0 = TokenEmbedding + PositionEmbedding (+ Dropout), units 1..L = two Residuals
// each (attention and MLP branches, with GPT's dropout sites), unit L+1 = LayerNorm + a
// TiedLinear reading unit 0's token table + SoftmaxCrossEntropy on the targets. Parameter names,
// shapes, initialisers and flags equal nn::GPT's, and forward and backward give the same bits
// (f64, f32, bf16, with dropout and activation checkpointing; tested), so it is a drop-in for
// nn::GPT and a template for users' own transformer variants.

#include <any>
#include <cmath>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <parallel/tensor_parallel/column_parallel_linear.hpp>
#include <parallel/tensor_parallel/region_layer.hpp>
#include <parallel/tensor_parallel/row_parallel_linear.hpp>
#include <parallel/tensor_parallel/sequence_parallel_params.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <parallel/tensor_parallel/vocab_parallel_cross_entropy.hpp>
#include <parallel/tensor_parallel/vocab_parallel_embedding.hpp>
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
/// with GPT's parameter names, initialisers and dropout sites; split over tp when it has more
/// than one rank (see the file comment).
template <class T>
void add_gpt_block(Sequential<T>& unit, const GPTConfig& cfg, std::int64_t layer,
                   const parallel::TensorParallel& tp = {}) {
  const std::int64_t C = cfg.channels;
  const std::string p = "transformer.h." + std::to_string(layer) + ".";
  const std::string site = "h." + std::to_string(layer);  // GPT's dropout key per block
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  if (!tp.active()) {
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
    return;
  }
  using namespace parallel;
  const int t = tp.size();
  const std::string rank_site = site + (tp.sequence_parallel() ? "/sp" : "/tp") +
                                std::to_string(tp.rank());  // masks drawn per rank
  const std::string& residual_site = tp.sequence_parallel() ? rank_site : site;
  auto norm = [&](Residual<T>& branch, const std::string& name) {
    if (tp.sequence_parallel()) {
      branch.template add<SequenceParallelParams<T>>(tp, std::make_unique<LayerNorm<T>>(name, C));
    } else {
      branch.template add<LayerNorm<T>>(name, C);
    }
  };
  auto& attn = unit.template add<Residual<T>>(p + "attn");
  norm(attn, p + "ln_1");
  attn.template add<ColumnParallelLinear<T>>(tp, p + "attn.c_attn", C, 3 * C, true, 0.02, 3);
  attn.template add<CausalSelfAttention<T>>(cfg.num_heads / t, cfg.attn_dropout,
                                            site + "/tp" + std::to_string(tp.rank()), 2);
  attn.template add<RowParallelLinear<T>>(tp, p + "attn.c_proj", C, C, true, residual_std);
  if (cfg.dropout > 0) attn.template add<Dropout<T>>(cfg.dropout, residual_site, 0);
  auto& mlp = unit.template add<Residual<T>>(p + "mlp");
  norm(mlp, p + "ln_2");
  mlp.template add<ColumnParallelLinear<T>>(tp, p + "mlp.c_fc", C, 4 * C, true, 0.02);
  mlp.template add<GELU<T>>();
  mlp.template add<RowParallelLinear<T>>(tp, p + "mlp.c_proj", 4 * C, C, true, residual_std);
  if (cfg.dropout > 0) mlp.template add<Dropout<T>>(cfg.dropout, residual_site, 1);
}

/// Throws ConfigError naming the key when cfg's heads, hidden size or vocabulary do not divide by
/// the tensor-parallel size tp.
inline void check_tensor_parallel(const GPTConfig& cfg, int tp) {
  if (tp <= 1) return;
  auto divides = [&](std::int64_t n, const char* what) {
    expect<ConfigError>(n % tp == 0, "tensor_parallel.tp_size = ", tp, ": the model's ", what, " (",
                        n, ") must be a multiple of it");
  };
  divides(cfg.num_heads, "n_head (num_heads)");
  divides(cfg.channels, "n_embd (channels)");
  divides(cfg.vocab_size, "vocab_size");
}

/// GPT-2 built from layers (see the file comment); an nn::Model.
template <class T>
class LayerGPT {
 public:
  using value_type = T;

  /// The model cfg describes (checkpoint_activations checkpoints every block unit), split over
  /// tp's group when it has more than one rank; ConfigError naming the key when the heads, the
  /// hidden size or the vocabulary do not divide by tp.
  explicit LayerGPT(GPTConfig cfg, parallel::TensorParallel tp = {})
      : cfg_((cfg.validate(), check_tensor_parallel(cfg, tp.size()), cfg)), tp_(std::move(tp)) {
    const std::int64_t C = cfg_.channels, V = cfg_.vocab_size;
    units_.reserve(static_cast<std::size_t>(cfg_.num_layers + 2));
    auto& embedding = units_.emplace_back();
    if (tp_.active()) {
      vocab_table_ = &embedding.template add<parallel::VocabParallelEmbedding<T>>(
          tp_, "transformer.wte", V, C, "tokens", 0.02);
    } else {
      wte_ = &embedding.template add<TokenEmbedding<T>>("transformer.wte", V, C, "tokens", 0.02);
    }
    embedding.template add<PositionEmbedding<T>>("transformer.wpe", cfg_.max_seq_len, C, 0.02);
    if (tp_.sequence_parallel()) {
      embedding.template add<parallel::RegionLayer<T>>(tp_, parallel::Region::scatter_to_sp);
    }
    if (cfg_.dropout > 0) {
      embedding.template add<Dropout<T>>(
          cfg_.dropout,
          tp_.sequence_parallel() ? "embedding/sp" + std::to_string(tp_.rank()) : "embedding", 0);
    }
    for (std::int64_t l = 0; l < cfg_.num_layers; ++l) {
      Sequential<T>& block = units_.emplace_back();
      add_gpt_block(block, cfg_, l, tp_);
      block.set_checkpoint(cfg_.checkpoint_activations);  // as nn::GPT: the blocks only
    }
    auto& head = units_.emplace_back();
    if (!tp_.active()) {
      head.template add<LayerNorm<T>>("transformer.ln_f", C);
      head.template add<TiedLinear<T>>(
          "lm_head", [wte = wte_] { return wte->table(); }, C, V);
      loss_ = &head.template add<SoftmaxCrossEntropy<T>>(V, "targets");
      return;
    }
    if (tp_.sequence_parallel()) {
      head.template add<parallel::SequenceParallelParams<T>>(
          tp_, std::make_unique<LayerNorm<T>>("transformer.ln_f", C));
    } else {
      head.template add<LayerNorm<T>>("transformer.ln_f", C);
    }
    head.template add<parallel::ColumnParallelLinear<T>>(
        tp_, "lm_head", [table = vocab_table_] { return table->table(); }, C, V);
    parallel_loss_ = &head.template add<parallel::VocabParallelCrossEntropy<T>>(tp_, V, "targets");
  }
  LayerGPT(const LayerGPT&) = delete;
  LayerGPT& operator=(const LayerGPT&) = delete;

  /// The configuration.
  const GPTConfig& config() const { return cfg_; }
  /// L + 2 units.
  int num_units() const { return static_cast<int>(units_.size()); }
  /// The head's index.
  int head_unit() const { return num_units() - 1; }
  /// What unit u is, for a pipeline's partition_method type:<regex>: "Embedding",
  /// "TransformerBlock" or "LMHead".
  std::string_view unit_type(int u) const {
    check_unit(u);
    return u == 0 ? "Embedding" : u == head_unit() ? "LMHead" : "TransformerBlock";
  }
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
  /// True when every layer of unit u parks (nn::ParksPasses): a pipeline stage then keeps
  /// several of its micro-batches in flight instead of recomputing them.
  bool parks_unit(int u) const {
    check_unit(u);
    return unit(u).parks();
  }
  /// Moves out what unit u's last forward kept for its backward.
  std::any park_unit(int u) {
    check_unit(u);
    return unit(u).park();
  }
  /// Puts back what park_unit(u) moved out, before that forward's backward.
  void resume_unit(int u, std::any saved) {
    check_unit(u);
    unit(u).resume(std::move(saved));
  }
  /// Forward through every unit; returns the loss (0 without targets).
  T forward(StepContext<T>& ctx) {
    for (int u = 0; u < num_units(); ++u) forward_unit(u, ctx);
    return ctx.loss;
  }
  /// Backward through every unit, accumulating into the bound gradients.
  void backward(StepContext<T>& ctx) {
    for (int u = num_units() - 1; u >= 0; --u) backward_unit(u, ctx);
  }
  /// The tensor-parallel group the model is split over (size 1: whole).
  const parallel::TensorParallel& tensor_parallel() const { return tp_; }
  /// Logits of the last forward, [B*T, V] (valid until the next micro-step); with tensor
  /// parallelism this rank's vocabulary columns [B*T, V/tp], ids from rank * V/tp on.
  Tensor<const T> logits() const {
    const Tensor<const T> l = tp_.active() ? parallel_loss_->logits() : loss_->logits();
    const std::int64_t V = cfg_.vocab_size / tp_.size();
    return l.reshape(Shape{l.numel() / V, V});
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
  parallel::TensorParallel tp_;
  std::vector<Sequential<T>> units_;
  TokenEmbedding<T>* wte_ = nullptr;
  SoftmaxCrossEntropy<T>* loss_ = nullptr;
  parallel::VocabParallelEmbedding<T>* vocab_table_ = nullptr;
  parallel::VocabParallelCrossEntropy<T>* parallel_loss_ = nullptr;
};

static_assert(ParksPasses<LayerGPT<double>> && ParksPasses<LayerGPT<float>> &&
              ParksPasses<LayerGPT<bf16>>);

}  // namespace zero::nn
