#pragma once
// TokenEmbedding: rows of a table [V, C] looked up by integer ids. The ids come from the
// micro-batch input `ids` (i32, any shape [...]) or, when it is "tokens" and the batch has no
// such named input, from ctx.tokens [B, T]; the output is [..., C]. It is an input layer (it
// starts a unit-0 pipeline). The backward pass reuses GPT's deterministic scatter (positions
// grouped by id in order), so gradients are the same bits for any thread count. A table padded
// past the vocabulary (set_vocabulary) refuses ids in the padding and declares its rows in use
// (ParamSpec::rows_in_use), so a checkpoint with another padding loads.

#include <any>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/layers/layer.hpp>
#include <zero/nn/layers/token_ids.hpp>

namespace zero::nn {

/// ids [...] -> vectors [..., C].
template <class T>
class TokenEmbedding final : public Layer<T> {
 public:
  /// Parameter name.weight [vocab, channels] (normal, stddev, weight-decayed as in Megatron),
  /// looked up by the input ids.
  TokenEmbedding(std::string name, std::int64_t vocab, std::int64_t channels,
                 std::string ids = "tokens", double stddev = 0.02)
      : name_(std::move(name)),
        ids_(std::move(ids)),
        vocab_(vocab),
        channels_(channels),
        stddev_(stddev) {
    expect_positive_size(describe(), "vocab", vocab);
    expect_positive_size(describe(), "channels", channels);
  }

  std::string describe() const override { return "TokenEmbedding '" + name_ + "'"; }

  /// The ids the table holds: its first `tokens` rows, the rest padding (see the file comment).
  /// ShapeError unless 0 < tokens <= the table's rows.
  void set_vocabulary(std::int64_t tokens) {
    expect<ShapeError>(tokens > 0 && tokens <= vocab_, describe(), ": a vocabulary of ", tokens,
                       " tokens must be in [1, ", vocab_, "] (the table's rows)");
    tokens_ = tokens;
  }

  std::vector<ParamSpec> params() const override {
    ParamSpec table{name_ + ".weight", {vocab_, channels_}, Init::normal, stddev_, true};
    table.rows_in_use = tokens_;
    return {table};
  }
  void bind(std::span<const ParamView<T>> views) override { table_ = views[0]; }
  /// The bound table (value and gradient): a TiedLinear reads it as its weight.
  const ParamView<T>& table() const { return table_; }
  void forward(StepContext<T>& ctx) override {
    const TokenIds ids = token_ids(ctx, ids_, describe());
    ids_data_ = ids.data;
    const Shape shape = ids.shape;
    count_ = shape.numel();
    // [..., C]: the ids' extents and one more (a rank-0 id gives one row).
    expect<ShapeError>(shape.rank() < Shape::max_rank, describe(), ": ids of rank ", shape.rank(),
                       " leave no room for the channel dimension (at most ", Shape::max_rank - 1,
                       ")");
    Shape out_shape = Shape{count_, channels_};
    if (shape.rank() >= 1) {
      std::int64_t extents[Shape::max_rank];
      for (int i = 0; i < shape.rank(); ++i) extents[i] = shape[i];
      extents[shape.rank()] = channels_;
      out_shape = Shape::of(extents, shape.rank() + 1);
    }
    Tensor<T> y = ctx.arena->template allocate<T>(out_shape);
    // One "sequence" of count_ positions and no position table: a plain lookup.
    kernels_of(ctx).embedding_forward(y.data(), ids_data_, table_.value.data(), nullptr, 1, count_,
                                      channels_, tokens_ > 0 ? tokens_ : vocab_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    kernels_of(ctx).embedding_backward(table_.grad.data(), nullptr, ctx.dy.data(), ids_data_, 1,
                                       count_, channels_, tokens_ > 0 ? tokens_ : vocab_);
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    (void)in;
    return FlopCount{};  // a look-up or a view: no arithmetic
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(ids_data_, count_); }
  void resume(std::any saved) override { nn::resume_members(saved, ids_data_, count_); }

 private:
  std::string name_, ids_;
  std::int64_t vocab_, channels_;
  std::int64_t tokens_ = 0;  // set_vocabulary's (0: not set, every row an id)
  double stddev_;
  ParamView<T> table_;
  const std::int32_t* ids_data_ = nullptr;
  std::int64_t count_ = 0;
};

}  // namespace zero::nn
