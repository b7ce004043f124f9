#pragma once
// PositionEmbedding: adds a learned vector per position, x[b, t, :] += table[t, :], to rows
// that are (batch, position) pairs (B = ctx.batch, T = ctx.seq_len <= max_positions). After a
// TokenEmbedding it is GPT-2's encoder (wte + wpe) with the same bits: one rounding of
// e + p per element, and the positions' gradient summed over the batch in batch order by the
// same kernel. Under Ulysses sequence parallelism a rank's rows are one block of positions of
// each sequence: set_sequence_shard(r, sp) adds table[r*T + t] instead (T = ctx.seq_len, the rank's
// own length).

#include <any>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// x + table[position] for rows of C features.
template <class T>
class PositionEmbedding final : public Layer<T> {
 public:
  /// Parameter name.weight [max_positions, channels] (normal, stddev, weight-decayed as in
  /// Megatron).
  PositionEmbedding(std::string name, std::int64_t max_positions, std::int64_t channels,
                    double stddev = 0.02)
      : name_(std::move(name)), max_(max_positions), channels_(channels), stddev_(stddev) {
    expect_positive_size(describe(), "max_positions", max_positions);
    expect_positive_size(describe(), "channels", channels);
  }

  /// Rows hold positions [index*T, (index+1)*T) of each sequence (T = ctx.seq_len): the
  /// index-th of shards blocks of a sequence split over sequence-parallel ranks; (0, 1), the
  /// default, is whole. The length checked against max_positions is the whole sequence's, so
  /// every rank of the split refuses the same batches.
  void set_sequence_shard(std::int64_t index, std::int64_t shards) {
    expect<ConfigError>(shards >= 1 && index >= 0 && index < shards, describe(),
                        ": sequence shard ", index, " of ", shards,
                        "; expected 0 <= index < shards");
    shard_ = index;
    shards_ = shards;
  }

  std::string describe() const override { return "PositionEmbedding '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    return {{name_ + ".weight", {max_, channels_}, Init::normal, stddev_, true}};
  }
  void bind(std::span<const ParamView<T>> views) override { table_ = views[0]; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, channels_, describe());
    B_ = ctx.batch;
    T_ = ctx.seq_len;
    first_ = shard_ * T_;
    expect<ShapeError>(shards_ * T_ <= max_, describe(), ": sequence length ", shards_ * T_,
                       shards_ > 1 ? " (the rank's " + std::to_string(T_) + " positions x " +
                                         std::to_string(shards_) + " sequence-parallel ranks)"
                                   : std::string(),
                       " exceeds max_positions ", max_);
    expect<ShapeError>(B_ * T_ == N, describe(), ": ", N, " rows, but batch * seq_len = ", B_ * T_);
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    kernels_of(ctx).add_periodic_rows(y.data(), ctx.x.data(),
                                      table_.value.data() + first_ * channels_, N, T_, channels_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    Kernels<T>& kernels = kernels_of(ctx);
    kernels.accumulate(ctx.dx.data(), ctx.dy.data(), ctx.dx.numel());
    kernels.embedding_backward(nullptr, table_.grad.data() + first_ * channels_, ctx.dy.data(),
                               nullptr, B_, T_, channels_, 0);  // no token table
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel());  // the add onto the token embedding
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(B_, T_, first_); }
  void resume(std::any saved) override { nn::resume_members(saved, B_, T_, first_); }

 private:
  std::string name_;
  std::int64_t max_, channels_;
  double stddev_;
  ParamView<T> table_;
  std::int64_t shard_ = 0, shards_ = 1;
  std::int64_t B_ = 0, T_ = 0, first_ = 0;
};

}  // namespace zero::nn
