#pragma once
// RepeatKv: grouped qkv rows (kv_heads groups of heads/kv_heads query heads, one key and one value
// head each; layer_llama.hpp's attention projection) to the packed [q | k | v] rows that
// CausalSelfAttention and UlyssesAttention read, each key and value head repeated for every query
// head of its group (grouped-query attention as Hugging Face's repeat_kv;
// ops/cpu/grouped_qkv.hpp). The backward sums each key's and value's gradient over its group in
// a fixed order. No parameters; runs on the pass's kernel set.

#include <cstdint>
#include <string>

#include <zero/nn/kernels.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>

namespace zero::nn {

/// Grouped qkv [N, kv_heads * (heads/kv_heads + 2) * head_size] -> packed [N, 3 * heads *
/// head_size].
template <class T>
class RepeatKv final : public Layer<T> {
 public:
  /// heads query heads sharing kv_heads key/value heads (heads a multiple of kv_heads).
  RepeatKv(std::int64_t heads, std::int64_t kv_heads, std::int64_t head_size)
      : heads_(heads), kv_heads_(kv_heads), head_size_(head_size) {
    expect_positive_size(describe(), "heads", heads);
    expect_positive_size(describe(), "kv_heads", kv_heads);
    expect_positive_size(describe(), "head_size", head_size);
    expect<ConfigError>(heads % kv_heads == 0, describe(), ": heads (", heads,
                        ") must be a multiple of kv_heads (", kv_heads, ")");
  }

  std::string describe() const override { return "RepeatKv"; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N =
        rows_of(ctx.x, ops::cpu::grouped_qkv_width(kv_heads_, group(), head_size_), describe());
    Tensor<T> y =
        ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, 3 * heads_ * head_size_));
    kernels_of(ctx).repeat_kv_forward(y.data(), ctx.x.data(), N, kv_heads_, group(), head_size_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t N = ctx.dy.numel() / (3 * heads_ * head_size_);
    kernels_of(ctx).repeat_kv_backward(ctx.dx.data(), ctx.dy.data(), N, kv_heads_, group(),
                                       head_size_, ctx.overwrite_dx);
  }
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput&) const override {
    return FlopCount{0, 0};  // moves values only
  }

  bool parks() const override { return true; }  // keeps nothing between forward and backward

 private:
  std::int64_t group() const { return heads_ / kv_heads_; }

  std::int64_t heads_, kv_heads_, head_size_;
};

}  // namespace zero::nn
