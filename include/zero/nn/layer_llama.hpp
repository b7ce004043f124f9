#pragma once
// nn::LayerLlama: a Llama-family decoder (Llama 2 and 3, and the dense models built like them)
// assembled from the layer library: unit 0 = TokenEmbedding (model.embed_tokens), units 1..L =
// two Residuals each (add_llama_block), unit L+1 = RMSNorm (model.norm) and an untied
// LinearCrossEntropy (lm_head) on the targets. No biases, no dropout, no position table: the
// positions enter through the rotary embedding of every block's queries and keys.
//
// A block: RMSNorm (input_layernorm), one projection to grouped qkv (self_attn.qkv_proj), the
// RotaryEmbedding, RepeatKv, causal attention, the output projection (self_attn.o_proj); then
// RMSNorm (post_attention_layernorm), one projection to [gate | up] (mlp.gate_up_proj), SwiGLU
// and mlp.down_proj. The names are Hugging Face's LlamaForCausalLM's, but for the two packed
// projections: qkv_proj's rows are, for each key/value head j, q_proj's rows of its group's
// query heads [j*g*hs, (j+1)*g*hs), then k_proj's rows [j*hs, (j+1)*hs), then v_proj's (Megatron's
// grouped layout, so tensor parallelism splits it into whole groups); gate_up_proj's are
// gate_proj's rows, then up_proj's. The rotary embedding is Hugging Face's "rotate half" form, so
// its q_proj and k_proj rows go in unpermuted.
//
// Split over a tensor-parallel group tp: the projections into and out of each branch are column-
// and row-parallel (qkv_proj in whole groups, so num_kv_heads must divide by tp; gate_up_proj with
// stride 2, each rank its part of gate and of up), the token table and the LM head
// vocabulary-parallel; with Megatron's sequence parallelism the norms hold split rows. With a
// Ulysses group sp, each rank holds T/sp positions of every sequence, its rotary embedding turns
// them by their own positions, and its attention is parallel::UlyssesAttention. Without tensor
// or sequence parallelism every layer has device kernels as well (nn::CudaKernels), so the model
// runs on Compute<Cuda> too; the tensor- and sequence-parallel layers are host-only.

#include <cstdint>
#include <memory>
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
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/linear_cross_entropy.hpp>
#include <zero/nn/layers/repeat_kv.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/rms_norm.hpp>
#include <zero/nn/layers/rotary_embedding.hpp>
#include <zero/nn/layers/sequential.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/layers/swiglu.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/llama_config.hpp>
#include <zero/nn/model.hpp>
#include <zero/nn/param.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>

namespace zero::nn {

/// Throws ConfigError naming the field when cfg's blocks cannot split over tp tensor-parallel
/// ranks (query heads, key/value heads, intermediate size) or sp Ulysses ranks (query heads per
/// tp rank), or when Ulysses meets Megatron's sequence parallelism.
inline void check_llama_block(const LlamaConfig& cfg, int tp, int sp, bool megatron_sp = false) {
  cfg.validate();
  const auto divides = [&](std::int64_t n, const char* what) {
    expect<ConfigError>(n % tp == 0, "tensor_parallel.tp_size = ", tp, ": the model's ", what, " (",
                        n, ") must be a multiple of it");
  };
  if (tp > 1) {
    divides(cfg.num_heads, "num_heads");
    divides(cfg.num_kv_heads, "num_kv_heads");
    divides(cfg.intermediate_size, "intermediate_size");
  }
  if (sp > 1) {
    expect<ConfigError>(!megatron_sp, "Ulysses sequence parallelism (sp = ", sp,
                        ") with tensor_parallel.sequence_parallel is not supported: both split "
                        "the positions");
    parallel::check_ulysses_heads(cfg.num_heads / tp, sp);
  }
}

/// Appends Llama's block `layer` (see the file comment) to unit, split over tp and sp when they
/// have more than one rank; ConfigError as check_llama_block.
template <class T>
void add_llama_block(Sequential<T>& unit, const LlamaConfig& cfg, std::int64_t layer,
                     const parallel::TensorParallel& tp = {},
                     const parallel::SequenceParallel& sp = {}) {
  check_llama_block(cfg, tp.size(), sp.size(), tp.sequence_parallel());
  using namespace parallel;
  const int t = tp.size();
  const std::int64_t C = cfg.channels, F = cfg.intermediate_size, hs = cfg.head_size();
  const std::int64_t heads = cfg.num_heads / t, kv_heads = cfg.num_kv_heads / t;
  const double sd = cfg.initializer_range;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const std::string site = "layers." + std::to_string(layer);
  const auto norm = [&](Residual<T>& branch, const std::string& name) {
    if (tp.sequence_parallel()) {
      branch.template add<SequenceParallelParams<T>>(
          tp, std::make_unique<RMSNorm<T>>(name, C, cfg.rms_norm_eps));
    } else {
      branch.template add<RMSNorm<T>>(name, C, cfg.rms_norm_eps);
    }
  };
  // in -> out, column-parallel over tp (stride: parts split one by one) or whole.
  const auto into = [&](Residual<T>& branch, const std::string& name, std::int64_t in,
                        std::int64_t out, int stride) {
    if (tp.active()) {
      branch.template add<ColumnParallelLinear<T>>(tp, name, in, out, false, sd, stride);
    } else {
      branch.template add<Linear<T>>(name, in, out, false, sd);
    }
  };
  const auto out_of = [&](Residual<T>& branch, const std::string& name, std::int64_t in) {
    if (tp.active()) {
      branch.template add<RowParallelLinear<T>>(tp, name, in, C, false, sd);
    } else {
      branch.template add<Linear<T>>(name, in, C, false, sd);
    }
  };

  auto& attn = unit.template add<Residual<T>>(p + "self_attn");
  norm(attn, p + "input_layernorm");
  into(attn, p + "self_attn.qkv_proj", C,
       ops::cpu::grouped_qkv_width(cfg.num_kv_heads, cfg.group(), hs), 1);
  attn.template add<RotaryEmbedding<T>>(heads, kv_heads, hs, cfg.rope_theta, cfg.rope_scaling)
      .set_sequence_shard(sp.rank(), sp.size());
  attn.template add<RepeatKv<T>>(heads, kv_heads, hs);
  if (sp.active()) {
    attn.template add<UlyssesAttention<T>>(sp, heads, 0.0, site);
  } else {
    attn.template add<CausalSelfAttention<T>>(heads, 0.0, site);
  }
  out_of(attn, p + "self_attn.o_proj", cfg.num_heads * hs);

  auto& mlp = unit.template add<Residual<T>>(p + "mlp");
  norm(mlp, p + "post_attention_layernorm");
  into(mlp, p + "mlp.gate_up_proj", C, 2 * F, 2);
  mlp.template add<SwiGLU<T>>();
  out_of(mlp, p + "mlp.down_proj", F);
}

/// A Llama-family decoder built from layers (see the file comment); an nn::Model whose units are
/// a SequentialModel's (no ties: the LM head is untied).
template <class T>
class LayerLlama : private SequentialModel<T> {
  using Units = SequentialModel<T>;

 public:
  using value_type = T;

  /// The model cfg describes (checkpoint_activations checkpoints every block unit), split over
  /// tp and sp when they have more than one rank (see the file comment); ConfigError naming the
  /// field when a size does not divide (check_llama_block; the vocabulary by tp too).
  explicit LayerLlama(LlamaConfig cfg, parallel::TensorParallel tp = {},
                      parallel::SequenceParallel sp = {})
      : cfg_((check(cfg, tp, sp), cfg)), tp_(std::move(tp)), sp_(std::move(sp)) {
    const std::int64_t C = cfg_.channels, V = cfg_.vocab_size;
    const double sd = cfg_.initializer_range;
    auto& embedding = this->add_unit();
    if (tp_.active()) {
      embedding.template add<parallel::VocabParallelEmbedding<T>>(tp_, "model.embed_tokens", V, C,
                                                                  "tokens", sd);
      if (tp_.sequence_parallel()) {
        embedding.template add<parallel::RegionLayer<T>>(tp_, parallel::Region::scatter_to_sp);
      }
    } else {
      embedding.template add<TokenEmbedding<T>>("model.embed_tokens", V, C, "tokens", sd);
    }
    for (std::int64_t l = 0; l < cfg_.num_layers; ++l) {
      Sequential<T>& block = this->add_unit();
      add_llama_block(block, cfg_, l, tp_, sp_);
      block.set_checkpoint(cfg_.checkpoint_activations);
    }
    auto& head = this->add_unit();
    if (tp_.sequence_parallel()) {
      head.template add<parallel::SequenceParallelParams<T>>(
          tp_, std::make_unique<RMSNorm<T>>("model.norm", C, cfg_.rms_norm_eps));
    } else {
      head.template add<RMSNorm<T>>("model.norm", C, cfg_.rms_norm_eps);
    }
    const auto share = [sp = sp_](std::int64_t n) { return sp.token_share(n); };
    if (tp_.active()) {
      head.template add<parallel::ColumnParallelLinear<T>>(tp_, "lm_head", C, V, false, sd);
      parallel_loss_ =
          &head.template add<parallel::VocabParallelCrossEntropy<T>>(tp_, V, "targets");
      if (sp_.active()) parallel_loss_->share_counted_rows(share);
    } else {
      loss_ = &head.template add<LinearCrossEntropy<T>>("lm_head", C, V, sd, "targets",
                                                        cfg_.logits_chunk_bytes);
      if (sp_.active()) loss_->share_counted_rows(share);
    }
  }
  LayerLlama(const LayerLlama&) = delete;
  LayerLlama& operator=(const LayerLlama&) = delete;

  // The nn::Model and nn::ParksPasses members, as SequentialModel has them.
  using Units::backward;
  using Units::backward_unit;
  using Units::bind_unit;
  using Units::forward;
  using Units::forward_unit;
  using Units::num_units;
  using Units::park_unit;
  using Units::parks_unit;
  using Units::resume_unit;
  using Units::unit_forward_flops;
  using Units::unit_params;
  using Units::unit_uses;

  /// The configuration.
  const LlamaConfig& config() const { return cfg_; }
  /// The head's index (L + 2 units: the embedding, the blocks, the head).
  int head_unit() const { return num_units() - 1; }
  /// What unit u is, for a pipeline's partition_method type:<regex>: "Embedding",
  /// "TransformerBlock" or "LMHead".
  std::string_view unit_type(int u) const {
    expect<Error>(u >= 0 && u < num_units(), "LayerLlama: unit ", u, " out of range [0, ",
                  num_units(), ")");
    return u == 0 ? "Embedding" : u == head_unit() ? "LMHead" : "TransformerBlock";
  }
  /// The tensor-parallel group the model is split over (size 1: whole).
  const parallel::TensorParallel& tensor_parallel() const { return tp_; }
  /// The Ulysses sequence-parallel group (size 1: each rank holds whole sequences).
  const parallel::SequenceParallel& sequence_parallel() const { return sp_; }
  /// Logits of the last forward, [B*T, V] (with tensor parallelism this rank's columns
  /// [B*T, V/tp]); as LayerGPT::logits.
  Tensor<const T> logits() const {
    const Tensor<const T> l = tp_.active() ? parallel_loss_->logits() : loss_->logits();
    const std::int64_t V = cfg_.vocab_size / tp_.size();
    return l.reshape(Shape{l.numel() / V, V});
  }

 private:
  static void check(const LlamaConfig& cfg, const parallel::TensorParallel& tp,
                    const parallel::SequenceParallel& sp) {
    check_llama_block(cfg, tp.size(), sp.size(), tp.sequence_parallel());
    expect<ConfigError>(cfg.vocab_size % tp.size() == 0, "tensor_parallel.tp_size = ", tp.size(),
                        ": the model's vocab_size (", cfg.vocab_size, ") must be a multiple of it");
  }

  LlamaConfig cfg_;
  parallel::TensorParallel tp_;
  parallel::SequenceParallel sp_;
  LinearCrossEntropy<T>* loss_ = nullptr;
  parallel::VocabParallelCrossEntropy<T>* parallel_loss_ = nullptr;
};

static_assert(ParksPasses<LayerLlama<double>> && ParksPasses<LayerLlama<float>>);

}  // namespace zero::nn
