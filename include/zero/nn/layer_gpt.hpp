#pragma once
// nn::LayerGPT: GPT-2 assembled from the layer library (nn/layers) instead of hand-written
// units: unit 0 = TokenEmbedding + PositionEmbedding (+ Dropout), units 1..L = two Residuals
// each (attention and MLP branches, with GPT's dropout sites), unit L+1 = LayerNorm + a
// LinearCrossEntropy on the targets reading unit 0's token table (the logits in row chunks of at
// most GPTConfig::logits_chunk_bytes; a token table padded past the vocabulary,
// GPTConfig::padded_vocab_size, has its padding columns masked out of the softmax). Parameter
// names, shapes, initialisers and flags equal nn::GPT's, and forward and backward give the same
// bits (f64, f32, bf16, with dropout and activation checkpointing; tested), so it is a drop-in for
// nn::GPT and a template for users' own transformer variants.
//
// The MoE variant (MoEBlocks): every k-th block's MLP is a MixtureOfExperts; its experts are an
// expert unit of their own (an ExpertStack, split over the expert-parallel group, each expert's
// hidden units over the tensor-parallel group, or whole experts over the tp ranks as more
// expert-parallel ranks: MoEBlocks::expert_tp) just before the block, which uses it (unit_uses)
// as the head uses unit 0's table. The engine shards expert units over the expert data-parallel
// group and the rest over the data-parallel group.

#include <algorithm>
#include <any>
#include <cmath>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/sequence/ulysses_attention.hpp>
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
#include <zero/nn/layers/linear_cross_entropy.hpp>
#include <zero/nn/layers/position_embedding.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/sequential.hpp>
#include <zero/nn/layers/tied_linear.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/model.hpp>
#include <zero/nn/moe/expert_stack.hpp>
#include <zero/nn/moe/moe_blocks.hpp>
#include <zero/nn/moe/moe_layer.hpp>
#include <zero/nn/param.hpp>

namespace zero::nn {

namespace detail {
// ConfigError naming the key when n (cfg's `what`) does not divide by tp.
inline void expect_divides_tp(std::int64_t n, const char* what, int tp) {
  expect<ConfigError>(n % tp == 0, "tensor_parallel.tp_size = ", tp, ": the model's ", what, " (",
                      n, ") must be a multiple of it");
}
}  // namespace detail

/// Throws ConfigError naming the key when cfg's heads or hidden size, which a block splits, do
/// not divide by the tensor-parallel size tp.
inline void check_tensor_parallel_block(const GPTConfig& cfg, int tp) {
  if (tp <= 1) return;
  detail::expect_divides_tp(cfg.num_heads, "n_head (num_heads)", tp);
  detail::expect_divides_tp(cfg.channels, "n_embd (channels)", tp);
}

/// Throws ConfigError naming the key when cfg's heads, hidden size or token-table rows (the
/// vocabulary, or padded_vocab_size when set) do not divide by the tensor-parallel size tp.
inline void check_tensor_parallel(const GPTConfig& cfg, int tp) {
  if (tp <= 1) return;
  check_tensor_parallel_block(cfg, tp);
  detail::expect_divides_tp(cfg.vocab_rows(),
                            cfg.padded_vocab_size > 0 ? "padded_vocab_size" : "vocab_size", tp);
}

/// Throws ConfigError naming the keys when Ulysses sequence parallelism over sp ranks cannot
/// split cfg: heads not divisible by sp (by tp * sp with tensor parallelism over tp ranks, whose
/// ranks each split their heads over sp), or Ulysses together with Megatron's sequence
/// parallelism (megatron_sp: both would split the residual stream's rows).
inline void check_sequence_parallel(const GPTConfig& cfg, int tp, int sp,
                                    bool megatron_sp = false) {
  if (sp <= 1) return;
  expect<ConfigError>(!megatron_sp, "Ulysses sequence parallelism (sp = ", sp,
                      ") with tensor_parallel.sequence_parallel is not supported: both split the "
                      "positions; use tensor parallelism without Megatron's sequence parallelism");
  if (tp > 1) {
    expect<ConfigError>(cfg.num_heads % (static_cast<std::int64_t>(tp) * sp) == 0,
                        "Ulysses sequence parallelism with tensor parallelism: n_head (num_heads) "
                        "= ",
                        cfg.num_heads, " is not divisible by tensor_parallel.tp_size * sp = ", tp,
                        " * ", sp, " (each tensor-parallel rank splits its heads over sp)");
  }
  parallel::check_ulysses_heads(cfg.num_heads / std::max(tp, 1), sp);
}

/// Throws ConfigError unless an MoE block split over block_tp can run experts split over
/// experts_tp: the same tensor-parallel group (expert tensor parallelism equals tp, as
/// Megatron's default) with the same sequence-parallel switch.
inline void check_moe_tensor_parallel(const parallel::TensorParallel& block_tp,
                                      const parallel::TensorParallel& experts_tp) {
  expect<ConfigError>(block_tp.size() == experts_tp.size() && block_tp.rank() == experts_tp.rank(),
                      "MoE block: the block is split over ", block_tp.size(),
                      " tensor-parallel ranks (this one rank ", block_tp.rank(),
                      ") but its experts over ", experts_tp.size(), " (rank ", experts_tp.rank(),
                      "); build the ExpertStack with the block's TensorParallel");
  expect<ConfigError>(block_tp.sequence_parallel() == experts_tp.sequence_parallel(),
                      "MoE block: the block ",
                      block_tp.sequence_parallel() ? "splits" : "does not split",
                      " its rows over tp (tensor_parallel.sequence_parallel) but its experts' "
                      "TensorParallel says otherwise; build the ExpertStack with the block's "
                      "TensorParallel");
}

/// Appends GPT-2's block `layer` of a model shaped by cfg to unit, as two residual branches
/// with GPT's parameter names, initialisers and dropout sites. Given experts (an ExpertStack of an
/// earlier unit, split over the same tp), the MLP branch is a MixtureOfExperts over them routed
/// by router, which is returned (null for a dense block). Split over tp when it has more
/// than one rank (see the file comment); with a Ulysses group sp of more than one rank, the
/// unit holds T/sp positions and its attention is parallel::UlyssesAttention (over this
/// tensor-parallel rank's heads when both are active: DeepSpeed-Ulysses with Megatron's tensor
/// parallelism). ConfigError naming the key when the heads or hidden size do not divide by tp,
/// the heads by tp * sp, or Ulysses meets Megatron's sequence parallelism; for experts split
/// over another tp than the block's.
template <class T>
MixtureOfExperts<T>* add_gpt_block(Sequential<T>& unit, const GPTConfig& cfg, std::int64_t layer,
                                   const parallel::TensorParallel& tp = {},
                                   const parallel::SequenceParallel& sp = {},
                                   const ExpertStack<T>* experts = nullptr,
                                   const RouterConfig& router = {}) {
  // A block built alone (a user's model) is checked as LayerGPT checks its blocks: heads that
  // do not divide by tp, or tp with Ulysses, computed wrong attention without a word.
  check_tensor_parallel_block(cfg, tp.size());
  check_sequence_parallel(cfg, tp.size(), sp.size(), tp.sequence_parallel());
  if (experts != nullptr) check_moe_tensor_parallel(tp, experts->tensor_parallel());
  const std::int64_t C = cfg.channels;
  const std::string p = "transformer.h." + std::to_string(layer) + ".";
  const std::string site = "h." + std::to_string(layer);  // GPT's dropout key per block
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  if (!tp.active()) {
    // Ulysses: each rank holds its part of every sequence's positions, and draws that part of
    // the residual masks.
    const DropoutShard rows =
        sp.active() ? DropoutShard{sp.size(), sp.rank(), true} : DropoutShard{};
    auto& attn = unit.template add<Residual<T>>(p + "attn");
    attn.template add<LayerNorm<T>>(p + "ln_1", C);
    attn.template add<Linear<T>>(p + "attn.c_attn", C, 3 * C, true, 0.02);
    if (sp.active()) {
      attn.template add<parallel::UlyssesAttention<T>>(sp, cfg.num_heads, cfg.attn_dropout, site,
                                                       2);
    } else {
      attn.template add<CausalSelfAttention<T>>(cfg.num_heads, cfg.attn_dropout, site, 2);
    }
    attn.template add<Linear<T>>(p + "attn.c_proj", C, C, true, residual_std);
    if (cfg.dropout > 0) attn.template add<Dropout<T>>(cfg.dropout, site, 0, rows);
    auto& mlp = unit.template add<Residual<T>>(p + "mlp");
    mlp.template add<LayerNorm<T>>(p + "ln_2", C);
    MixtureOfExperts<T>* moe = nullptr;
    if (experts != nullptr) {  // an MoE block: the experts are another unit's ExpertStack
      moe = &mlp.template add<MixtureOfExperts<T>>(p + "mlp", router, *experts);
    } else {
      mlp.template add<Linear<T>>(p + "mlp.c_fc", C, 4 * C, true, 0.02);
      mlp.template add<GELU<T>>();
      mlp.template add<Linear<T>>(p + "mlp.c_proj", 4 * C, C, true, residual_std);
    }
    if (cfg.dropout > 0) mlp.template add<Dropout<T>>(cfg.dropout, site, 1, rows);
    return moe;
  }
  using namespace parallel;
  const int t = tp.size();
  // The residual stream is whole on every rank (the same mask), or with sequence parallelism
  // split into blocks of rows (each rank its block's part of the mask), or with Ulysses into
  // each sequence's positions (each sp rank its positions' part); the attention's heads are
  // split (each rank its heads' part, under Ulysses its sp rank's part of those).
  const DropoutShard rows = tp.sequence_parallel() ? DropoutShard{t, tp.rank(), false}
                            : sp.active()          ? DropoutShard{sp.size(), sp.rank(), true}
                                                   : DropoutShard{};
  const DropoutShard heads{t, tp.rank(), true};
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
  if (sp.active()) {  // this rank's heads, all-to-all over sp (DeepSpeed-Ulysses with TP)
    attn.template add<UlyssesAttention<T>>(sp, cfg.num_heads / t, cfg.attn_dropout, site, 2, heads);
  } else {
    attn.template add<CausalSelfAttention<T>>(cfg.num_heads / t, cfg.attn_dropout, site, 2, heads);
  }
  attn.template add<RowParallelLinear<T>>(tp, p + "attn.c_proj", C, C, true, residual_std);
  if (cfg.dropout > 0) attn.template add<Dropout<T>>(cfg.dropout, site, 0, rows);
  auto& mlp = unit.template add<Residual<T>>(p + "mlp");
  norm(mlp, p + "ln_2");
  MixtureOfExperts<T>* moe = nullptr;
  if (experts != nullptr) {  // the experts' hidden units split over tp (expert_stack.hpp)
    moe = &mlp.template add<MixtureOfExperts<T>>(p + "mlp", router, *experts);
  } else {
    mlp.template add<ColumnParallelLinear<T>>(tp, p + "mlp.c_fc", C, 4 * C, true, 0.02);
    mlp.template add<GELU<T>>();
    mlp.template add<RowParallelLinear<T>>(tp, p + "mlp.c_proj", 4 * C, C, true, residual_std);
  }
  if (cfg.dropout > 0) mlp.template add<Dropout<T>>(cfg.dropout, site, 1, rows);
  return moe;
}

/// GPT-2 built from layers (see the file comment); an nn::Model.
template <class T>
class LayerGPT {
 public:
  using value_type = T;

  /// The model cfg describes (checkpoint_activations checkpoints every block unit), split over
  /// tp's group when it has more than one rank; ConfigError naming the key when the heads, the
  /// hidden size or the vocabulary do not divide by tp. With a Ulysses group sp of more than one
  /// rank, each rank is fed T/sp positions of every sequence (parallel::SequenceSlice; the
  /// positions of its rank's block), its attention is parallel::UlyssesAttention and its loss
  /// its share of the mean over the group's counted positions (parallel::SequenceParallel::
  /// token_share, so the ranks' mean is the whole sequences' token mean with targets of -1
  /// anywhere); with tensor parallelism too, each tp rank's heads are split over its sp group
  /// and the vocabulary-parallel loss takes the same share. ConfigError when the heads do not
  /// divide by tp * sp, or with Megatron's sequence parallelism too. With active MoEBlocks, every
  /// moe.every-th block's MLP is a MixtureOfExperts whose experts (split over moe.ep, and each
  /// expert over tp, or whole experts over tp: moe.expert_tp) are an expert unit of their own
  /// just before the block
  /// (nn::HasExpertUnits).
  explicit LayerGPT(GPTConfig cfg, parallel::TensorParallel tp = {},
                    parallel::SequenceParallel sp = {}, MoEBlocks moe = {})
      : cfg_((cfg.validate(), check_tensor_parallel(cfg, tp.size()),
              check_sequence_parallel(cfg, tp.size(), sp.size(), tp.sequence_parallel()),
              check_moe(moe), cfg)),
        tp_(std::move(tp)),
        sp_(std::move(sp)),
        moe_(std::move(moe)) {
    // V rows of the token table; the first cfg_.vocab_size are the tokens the loss runs over.
    const std::int64_t C = cfg_.channels, V = cfg_.vocab_rows();
    units_.reserve(static_cast<std::size_t>(2 * cfg_.num_layers + 2));
    auto& embedding = units_.emplace_back();
    if (tp_.active()) {
      vocab_table_ = &embedding.template add<parallel::VocabParallelEmbedding<T>>(
          tp_, "transformer.wte", V, C, "tokens", 0.02);
      vocab_table_->set_vocabulary(cfg_.vocab_size);
    } else {
      wte_ = &embedding.template add<TokenEmbedding<T>>("transformer.wte", V, C, "tokens", 0.02);
      wte_->set_vocabulary(cfg_.vocab_size);
    }
    auto& positions =
        embedding.template add<PositionEmbedding<T>>("transformer.wpe", cfg_.max_seq_len, C, 0.02);
    positions.set_sequence_shard(sp_.rank(), sp_.size());  // (0, 1) without Ulysses
    if (tp_.sequence_parallel()) {
      embedding.template add<parallel::RegionLayer<T>>(tp_, parallel::Region::scatter_to_sp);
    }
    if (cfg_.dropout > 0) {  // rows split over ranks (Megatron SP or Ulysses): their part
      const DropoutShard rows = tp_.sequence_parallel()
                                    ? DropoutShard{tp_.size(), tp_.rank(), false}
                                : sp_.active() ? DropoutShard{sp_.size(), sp_.rank(), true}
                                               : DropoutShard{};
      embedding.template add<Dropout<T>>(cfg_.dropout, "embedding", 0, rows);
    }
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg_.num_layers));
    for (std::int64_t l = 0; l < cfg_.num_layers; ++l) {
      const ExpertStack<T>* experts = nullptr;
      if (moe_.is_moe_block(l)) {
        experts_units_.push_back(num_units());
        experts = &units_.emplace_back().template add<ExpertStack<T>>(
            "transformer.h." + std::to_string(l) + ".mlp", moe_.router.num_experts, C, 4 * C,
            residual_std, moe_.ep, tp_, moe_.expert_tp);
      }
      Sequential<T>& block = units_.emplace_back();
      MixtureOfExperts<T>* moe = add_gpt_block(block, cfg_, l, tp_, sp_, experts, moe_.router);
      block.set_checkpoint(cfg_.checkpoint_activations);  // as nn::GPT: the blocks only
      if (moe != nullptr) moe_layers_.push_back(moe);
    }
    auto& head = units_.emplace_back();
    if (!tp_.active()) {
      head.template add<LayerNorm<T>>("transformer.ln_f", C);
      loss_ = &head.template add<LinearCrossEntropy<T>>(
          "lm_head", [wte = wte_] { return wte->table(); }, C, V, "targets",
          cfg_.logits_chunk_bytes);
      loss_->set_vocabulary(cfg_.vocab_size);
      if (sp_.active()) {
        loss_->share_counted_rows([sp = sp_](std::int64_t n) { return sp.token_share(n); });
      }
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
    parallel_loss_->set_vocabulary(cfg_.vocab_size);
    if (sp_.active()) {
      parallel_loss_->share_counted_rows([sp = sp_](std::int64_t n) { return sp.token_share(n); });
    }
  }
  LayerGPT(const LayerGPT&) = delete;
  LayerGPT& operator=(const LayerGPT&) = delete;

  /// The configuration.
  const GPTConfig& config() const { return cfg_; }
  /// L + 2 units, plus one expert unit per MoE block.
  int num_units() const { return static_cast<int>(units_.size()); }
  /// The head's index.
  int head_unit() const { return num_units() - 1; }
  /// What unit u is, for a pipeline's partition_method type:<regex>: "Embedding",
  /// "TransformerBlock", "Experts" (an MoE block's experts) or "LMHead".
  std::string_view unit_type(int u) const {
    check_unit(u);
    if (unit_is_expert(u)) return "Experts";
    return u == 0 ? "Embedding" : u == head_unit() ? "LMHead" : "TransformerBlock";
  }
  /// True for the units holding an MoE block's experts (nn::HasExpertUnits).
  bool unit_is_expert(int u) const {
    return std::find(experts_units_.begin(), experts_units_.end(), u) != experts_units_.end();
  }
  /// Unit u's parameters, in binding order (nn::GPT's).
  std::vector<ParamSpec> unit_params(int u) const { return unit(u).params(); }
  /// The head reads unit 0's token table (tied LM head).
  std::vector<int> unit_uses(int u) const {
    if (u == head_unit()) return {0};
    if (u > 0 && unit_is_expert(u - 1)) return {u - 1};  // an MoE block reads its experts
    return {};
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
  /// Forward through every unit; returns the loss (0 in an evaluation without targets).
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
  /// The expert-parallel group the MoE blocks' experts are split over (size 1: all here).
  const parallel::ExpertParallel& expert_parallel() const { return moe_.ep; }
  /// The MoE blocks' settings.
  const MoEBlocks& moe() const { return moe_; }
  /// What the MoE layers routed in the last forward, summed over them (auxiliary losses
  /// unweighted; zeros for a dense GPT).
  MoEStats moe_stats() const {
    MoEStats sum;
    for (const MixtureOfExperts<T>* m : moe_layers_) sum += m->last_stats();
    return sum;
  }
  /// What the MoE layers routed for the micro-batches trained since reset_moe_window_stats(),
  /// summed over the layers and the micro-batches (MixtureOfExperts::window_stats: each
  /// micro-batch once, recomputed or not). In a pipeline stage, the stage's MoE blocks only.
  MoEStats moe_window_stats() const {
    MoEStats sum;
    for (const MixtureOfExperts<T>* m : moe_layers_) sum += m->window_stats();
    return sum;
  }
  /// Starts moe_window_stats() over.
  void reset_moe_window_stats() {
    for (MixtureOfExperts<T>* m : moe_layers_) m->reset_window_stats();
  }
  /// The Ulysses sequence-parallel group (size 1: each rank holds whole sequences).
  const parallel::SequenceParallel& sequence_parallel() const { return sp_; }
  /// Logits of the last forward, [B*T, V] with V the token table's rows, padding columns
  /// included (valid until the next micro-step; an Error after a forward with targets whose
  /// logits passed logits_chunk_bytes: evaluate without them); with tensor parallelism this
  /// rank's columns [B*T, V/tp], ids from rank * V/tp on.
  Tensor<const T> logits() const {
    const Tensor<const T> l = tp_.active() ? parallel_loss_->logits() : loss_->logits();
    const std::int64_t V = cfg_.vocab_rows() / tp_.size();
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

  static int check_moe(const MoEBlocks& moe) {
    moe.validate();
    return 0;
  }

  GPTConfig cfg_;
  parallel::TensorParallel tp_;
  parallel::SequenceParallel sp_;
  MoEBlocks moe_;
  std::vector<Sequential<T>> units_;
  std::vector<int> experts_units_;                // the expert units, ascending
  std::vector<MixtureOfExperts<T>*> moe_layers_;  // the MoE blocks' layers
  TokenEmbedding<T>* wte_ = nullptr;
  LinearCrossEntropy<T>* loss_ = nullptr;
  parallel::VocabParallelEmbedding<T>* vocab_table_ = nullptr;
  parallel::VocabParallelCrossEntropy<T>* parallel_loss_ = nullptr;
};

static_assert(ParksPasses<LayerGPT<double>> && ParksPasses<LayerGPT<float>> &&
              ParksPasses<LayerGPT<bf16>>);

}  // namespace zero::nn
