#pragma once
// UlyssesAttention: DeepSpeed-Ulysses causal self-attention (DistributedAttention) on a
// sequence-parallel rank. The input is the packed qkv of this rank's T/sp positions of each
// sequence, [B*T/sp, 3C] (GPT-2's c_attn layout; ctx.seq_len = T/sp). One all-to-all turns the
// sequence split into a head split, [B*T, 3C/sp]: every position, q|k|v of heads
// [r*nh/sp, (r+1)*nh/sp) (each C/sp channels, still packed as CausalSelfAttention reads them);
// causal attention with nh/sp heads runs on whole sequences (ctx.seq_len = T for that call); a
// second all-to-all turns the output [B*T, C/sp] back into [B*T/sp, C]. Backward runs the
// inverse all-to-alls (sequence_all_to_all.hpp).
//
// Per forward and rank, with e bytes per element (nccl-tests' S of each all_to_all):
//   forward  3*B*(T/sp)*C*e (qkv) + B*(T/sp)*C*e (output)
//   backward B*(T/sp)*C*e (output gradient) + 3*B*(T/sp)*C*e (qkv gradient)
// so 8*B*(T/sp)*C*e in 4 all-to-alls per attention's forward and backward, each rank sending
// (sp-1)/sp of it (DeepSpeed's 4Nh/P per link).
//
// Held for backward, per rank: the head-split qkv (3*B*T*C/sp elements, as many as the local
// qkv), the probabilities of nh/sp heads over whole sequences [B, nh/sp, T, T] (1/sp of
// the unsplit layer's), the head-split output and the sequence-split output (B*T*C/sp each).
// The two all-to-alls' send and receive buffers are arena scratch, released at once.
// With sp = 1 it is CausalSelfAttention: no copies, no collectives.
// Under tensor parallelism the layer sees a tensor-parallel rank's heads (C and nh its part of
// the model's): the all-to-alls split those over sp, and the attention dropout's mask is drawn
// for the model's heads, each rank its tp part's sp part (the `of_heads` shard).

#include <any>
#include <cstdint>
#include <string>
#include <utility>

#include <parallel/sequence/sequence_all_to_all.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::parallel {

/// Throws ConfigError naming the keys when num_heads does not divide by the sequence-parallel
/// size sp (Ulysses gives each rank nh/sp whole heads).
inline void check_ulysses_heads(std::int64_t num_heads, int sp) {
  expect<ConfigError>(sp >= 1 && num_heads > 0 && num_heads % sp == 0,
                      "Ulysses sequence parallelism: n_head (num_heads) = ", num_heads,
                      " is not divisible by the sequence-parallel size sp = ", sp,
                      " (sequence_parallel_size); each rank attends over num_heads / sp whole "
                      "heads");
}

/// Ulysses causal self-attention: qkv [B*T/sp, 3C] -> [B*T/sp, C] (see the file comment).
template <class T>
class UlyssesAttention final : public nn::Layer<T> {
 public:
  /// heads over the whole model, or a tensor-parallel rank's part of them given as of_heads
  /// (part of_heads.index of of_heads.parts, within each row); divisible by sp.size(), else
  /// ConfigError. attn_dropout and (site, seed) as CausalSelfAttention's, each rank drawing its
  /// heads' part of the mask, so dropout equals sp = 1.
  UlyssesAttention(SequenceParallel sp, std::int64_t heads, double attn_dropout = 0.0,
                   std::string site = "attention", std::uint64_t seed = 0,
                   nn::DropoutShard of_heads = {})
      : sp_((check_ulysses_heads(heads, sp.size()), std::move(sp))),
        heads_(heads),
        site_(std::move(site)),
        inner_(heads / sp_.size(), attn_dropout, site_, seed,
               nn::DropoutShard{of_heads.parts * sp_.size(),
                                of_heads.index * sp_.size() + sp_.rank(), true}) {}

  std::string describe() const override {
    return "UlyssesAttention '" + site_ + "' (sp " + std::to_string(sp_.size()) + ")";
  }

  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    if (!sp_.active()) {
      inner_.forward(ctx);
      return;
    }
    expect<ShapeError>(ctx.x.data() != nullptr && ctx.x.rank() >= 1 && ctx.x.dim(-1) % 3 == 0,
                       describe(), ": input must be packed qkv [B*T/sp, 3C]");
    B_ = ctx.batch;
    local_len_ = ctx.seq_len;
    C_ = ctx.x.dim(-1) / 3;
    expect<ShapeError>(C_ % heads_ == 0, describe(), ": C = ", C_, " is not divisible by ", heads_,
                       " heads");
    expect<ShapeError>(B_ * local_len_ * 3 * C_ == ctx.x.numel(), describe(), ": ",
                       ctx.x.numel() / (3 * C_),
                       " rows of qkv, but the micro-batch has batch * seq_len = ", B_ * local_len_,
                       " (this rank's positions)");
    const std::int64_t S = sp_.size(), T_whole = local_len_ * S;
    BumpArena& arena = *ctx.arena;
    // Kept for backward: the inner layer keeps a view of it as its qkv.
    Tensor<T> heads = arena.allocate<T>({B_ * T_whole, 3 * C_ / S});
    sequence_to_heads(sp_, arena, ctx.x.data(), heads.data(), B_, local_len_, 3, C_);
    const Shape out_shape = ctx.x.shape().with_extent(-1, C_);
    ctx.x = heads;
    {
      const SeqLenScope whole(ctx, T_whole);
      inner_.forward(ctx);  // ctx.x = [B*T, C/sp]
    }
    Tensor<T> out = arena.allocate<T>(out_shape);
    heads_to_sequence(sp_, arena, ctx.x.data(), out.data(), B_, local_len_, 1, C_);
    ctx.x = out;
  }

  void backward(nn::StepContext<T>& ctx) override {
    if (!sp_.active()) {
      inner_.backward(ctx);
      return;
    }
    const std::int64_t S = sp_.size(), rows = B_ * local_len_ * S;
    const Tensor<T> dx = ctx.dx, dy = ctx.dy;
    BumpArena& arena = *ctx.arena;
    const BumpArena::Mark mark = arena.mark();
    Tensor<T> dy_heads = arena.allocate<T>({rows, C_ / S});
    sequence_to_heads(sp_, arena, dy.data(), dy_heads.data(), B_, local_len_, 1, C_);
    Tensor<T> dqkv_heads = arena.allocate<T>({rows, 3 * C_ / S});
    for (T& v : dqkv_heads) v = T(0);
    ctx.dy = dy_heads;
    ctx.dx = dqkv_heads;
    inner_.backward(ctx);
    heads_to_sequence(sp_, arena, dqkv_heads.data(), dx.data(), B_, local_len_, 3, C_,
                      /*accumulate=*/true);
    arena.release(mark);
    ctx.dx = dx;
    ctx.dy = dy;
  }

  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput& in) const override {
    // This rank's share: nh/sp heads over whole sequences of sp * (local seq_len) positions.
    nn::FlopInput whole = in;
    whole.seq_len = in.seq_len * sp_.size();
    whole.input = in.input.with_extent(-1, in.input[-1] / sp_.size());
    return inner_.forward_flops(whole);
  }

  bool parks() const override { return true; }
  std::any park() override {
    return std::pair{nn::park_members(B_, local_len_, C_), inner_.park()};
  }
  void resume(std::any saved) override {
    auto* kept = std::any_cast<std::pair<std::any, std::any>>(&saved);
    expect<Error>(kept != nullptr, describe(), ": resume: the saved state is not this layer's");
    nn::resume_members(kept->first, B_, local_len_, C_);
    inner_.resume(std::move(kept->second));
  }

  /// The sequence-parallel group.
  const SequenceParallel& sequence_parallel() const { return sp_; }

 private:
  // Sets ctx.seq_len for the inner call and restores the rank's own length after it.
  struct SeqLenScope {
    nn::StepContext<T>& ctx;
    std::int64_t saved;
    SeqLenScope(nn::StepContext<T>& c, std::int64_t whole) : ctx(c), saved(c.seq_len) {
      ctx.seq_len = whole;
    }
    ~SeqLenScope() { ctx.seq_len = saved; }
    SeqLenScope(const SeqLenScope&) = delete;
    SeqLenScope& operator=(const SeqLenScope&) = delete;
  };

  SequenceParallel sp_;
  std::int64_t heads_;
  std::string site_;
  nn::CausalSelfAttention<T> inner_;
  std::int64_t B_ = 0, local_len_ = 0, C_ = 0;
};

}  // namespace zero::parallel
