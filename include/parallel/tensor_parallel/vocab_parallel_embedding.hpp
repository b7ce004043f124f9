#pragma once
// VocabParallelEmbedding: a token table [V, C] split on the vocabulary, rank i holding rows
// [i*V/tp, (i+1)*V/tp). Each rank looks up the ids in its range (zero rows for the others) and the
// rows are all-reduced over the group (reduce_from_tp), so every rank ends with every row. The
// backward needs no communication: each rank scatters the (replicated) output gradient into the
// rows it holds, positions grouped by id in order (deterministic, as ops::cpu::embedding_backward).
// With sequence parallelism the GPT adds its positions to the whole rows first and then scatters
// them (Megatron does the same for learned absolute positions), so this layer always all-reduces.
// A table padded to split evenly (set_vocabulary, as TokenEmbedding's) refuses ids in the padding
// and declares its rows in use (ParamSpec::rows_in_use): a checkpoint padded for another
// tensor-parallel size loads.

#include <algorithm>
#include <any>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/nn/layers/token_ids.hpp>
#include <zero/ops/cpu/embedding.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::parallel {

/// ids [...] -> vectors [..., C], the table split over the vocabulary.
template <class T>
class VocabParallelEmbedding final : public nn::Layer<T> {
 public:
  /// Parameter name.weight [V/tp, C] (part of [V, C], normal, stddev, not weight-decayed),
  /// looked up by the micro-batch input ids ("tokens": ctx.tokens).
  VocabParallelEmbedding(TensorParallel tp, std::string name, std::int64_t vocab,
                         std::int64_t channels, std::string ids = "tokens", double stddev = 0.02)
      : tp_(std::move(tp)),
        name_(std::move(name)),
        ids_(std::move(ids)),
        vocab_(vocab),
        channels_(channels),
        stddev_(stddev) {
    expect<ConfigError>(vocab > 0 && channels > 0, describe(), ": vocab = ", vocab,
                        ", channels = ", channels, "; both must be positive");
    expect<ConfigError>(vocab % tp_.size() == 0, describe(), ": the vocabulary of ", vocab,
                        " tokens does not split over tensor-parallel size ", tp_.size(),
                        " (pad it to a multiple of ", tp_.size(), ")");
  }

  std::string describe() const override { return "VocabParallelEmbedding '" + name_ + "'"; }

  /// The ids the table holds: its first `tokens` rows, the rest padding (see the file comment).
  /// ConfigError unless 0 < tokens <= the table's rows.
  void set_vocabulary(std::int64_t tokens) {
    expect<ConfigError>(tokens > 0 && tokens <= vocab_, describe(), ": a vocabulary of ", tokens,
                        " tokens must be in [1, ", vocab_, "] (the table's rows)");
    tokens_ = tokens;
  }
  std::vector<nn::ParamSpec> params() const override {
    return {{name_ + ".weight",
             {part(), channels_},
             nn::Init::normal,
             stddev_,
             true,  // decayed, as nn::TokenEmbedding (Megatron decays its embeddings)
             nn::TensorSplit::of({vocab_, channels_}, 0, tp_.size(), tp_.rank()),
             tokens_}};
  }
  void bind(std::span<const nn::ParamView<T>> views) override { table_ = views[0]; }
  /// The bound part of the table (value and gradient): the tied LM head reads it.
  const nn::ParamView<T>& table() const { return table_; }
  /// The first id of this rank's range.
  std::int64_t first_id() const { return tp_.rank() * part(); }

  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    const nn::TokenIds batch_ids = nn::token_ids(ctx, ids_, describe());
    ids_data_ = batch_ids.data;
    const Shape shape = batch_ids.shape;
    count_ = shape.numel();
    const std::int64_t ids_below = tokens_ > 0 ? tokens_ : vocab_;
    for (std::int64_t i = 0; i < count_; ++i) {
      expect<ShapeError>(ids_data_[i] >= 0 && ids_data_[i] < ids_below, describe(), ": token ",
                         ids_data_[i], " at position ", i, " is outside the vocabulary [0, ",
                         ids_below, ")");
    }
    Shape out_shape = Shape{count_, channels_};
    if (shape.rank() == 2) out_shape = Shape{shape[0], shape[1], channels_};
    Tensor<T> y = ctx.arena->template allocate<T>(out_shape);
    const std::int64_t first = first_id(), last = first + part(), C = channels_;
    const T* table = table_.value.data();
    T* out = y.data();
    const std::int32_t* ids = ids_data_;
    ops::cpu::parallel_for(count_, [&](std::int64_t i) {
      const std::int64_t id = ids[i];
      T* o = out + i * C;
      if (id >= first && id < last) {
        std::copy(table + (id - first) * C, table + (id - first + 1) * C, o);
      } else {
        std::fill(o, o + C, T(0));
      }
    });
    region_forward(Region::reduce_from_tp, tp_, y.data(), y.data(), count_, C);
    ctx.x = y;
  }
  void backward(nn::StepContext<T>& ctx) override {
    // The positions whose ids this rank holds, with local ids; their gradient rows are gathered
    // so the deterministic scatter of the whole-table case applies unchanged.
    const std::int64_t first = first_id(), last = first + part(), C = channels_;
    std::vector<std::int32_t> local_ids;
    std::vector<std::int64_t> positions;
    for (std::int64_t i = 0; i < count_; ++i) {
      if (ids_data_[i] >= first && ids_data_[i] < last) {
        local_ids.push_back(static_cast<std::int32_t>(ids_data_[i] - first));
        positions.push_back(i);
      }
    }
    const auto M = static_cast<std::int64_t>(positions.size());
    if (M == 0) return;
    const auto mark = ctx.arena->mark();
    Tensor<T> rows = ctx.arena->template allocate<T>({M, C});
    const T* dy = ctx.dy.data();
    for (std::int64_t j = 0; j < M; ++j) {
      const T* src = dy + positions[static_cast<std::size_t>(j)] * C;
      std::copy(src, src + C, rows.data() + j * C);
    }
    ops::cpu::embedding_backward<T>(table_.grad.data(), nullptr, rows.data(), local_ids.data(), 1,
                                    M, C);
    ctx.arena->release(mark);
  }

  /// A look-up: no FLOPs (as TokenEmbedding).
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput&) const override {
    return nn::FlopCount{};
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(ids_data_, count_); }
  void resume(std::any saved) override { nn::resume_members(saved, ids_data_, count_); }

 private:
  std::int64_t part() const { return vocab_ / tp_.size(); }

  TensorParallel tp_;
  std::string name_, ids_;
  std::int64_t vocab_, channels_;
  std::int64_t tokens_ = 0;  // set_vocabulary's (0: not set, every row an id)
  double stddev_;
  nn::ParamView<T> table_;
  const std::int32_t* ids_data_ = nullptr;
  std::int64_t count_ = 0;
};

}  // namespace zero::parallel
