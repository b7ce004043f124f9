#pragma once
// RotaryEmbedding: rotary position embedding (RoPE, Llama's "rotate half" form) on rows of grouped
// qkv, the output of the attention's projection in layer_llama.hpp: kv_heads groups of
// heads/kv_heads query heads, one key head and one value head, each head_size channels
// (ops/cpu/rotary.hpp). Every query and key head turns by the angles of its row's position; the
// values pass through. Rows are (batch, position) with B = ctx.batch and T = ctx.seq_len; under
// Ulysses sequence parallelism a rank's rows are one block of positions of each sequence, and
// set_sequence_shard(r, sp) makes them positions [r*T, (r+1)*T). No parameters. Runs on the
// pass's kernel set: the angles are computed on the host (ops::cpu::rotary_table, in double) once
// per shape, and a device set gets a copy of them in its memory, made once per shape and set.

#include <any>
#include <cstdint>
#include <string>
#include <vector>

#include <zero/core/device.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/rotary.hpp>

namespace zero::nn {

/// Turns the query and key heads of grouped qkv rows by their positions' angles.
template <class T>
class RotaryEmbedding final : public Layer<T> {
 public:
  /// heads query heads sharing kv_heads key/value heads (heads a multiple of kv_heads), each of
  /// head_size channels (even); pair i of a head at position p turns by p * theta^(-2i/head_size)
  /// (Llama 2: theta 10000; Llama 3: 500000), its frequency scaled as scaling says (Llama 3.1).
  RotaryEmbedding(std::int64_t heads, std::int64_t kv_heads, std::int64_t head_size,
                  double theta = 10000.0, ops::cpu::RopeScaling scaling = {})
      : heads_(heads),
        kv_heads_(kv_heads),
        head_size_(head_size),
        theta_(theta),
        scaling_(scaling) {
    scaling_.validate();
    expect_positive_size(describe(), "heads", heads);
    expect_positive_size(describe(), "kv_heads", kv_heads);
    expect_positive_size(describe(), "head_size", head_size);
    expect<ConfigError>(heads % kv_heads == 0, describe(), ": heads (", heads,
                        ") must be a multiple of kv_heads (", kv_heads, ")");
    expect<ConfigError>(head_size % 2 == 0, describe(), ": head_size ", head_size,
                        " must be even (a head turns in pairs of channels)");
    expect<ConfigError>(theta > 1.0, describe(), ": theta ", theta, " must be greater than 1");
  }

  /// Rows hold positions [index*T, (index+1)*T) of each sequence (T = ctx.seq_len): the
  /// index-th of shards blocks of a sequence split over sequence-parallel ranks; (0, 1), the
  /// default, is whole.
  void set_sequence_shard(std::int64_t index, std::int64_t shards) {
    expect<ConfigError>(shards >= 1 && index >= 0 && index < shards, describe(),
                        ": sequence shard ", index, " of ", shards,
                        "; expected 0 <= index < shards");
    shard_ = index;
  }

  std::string describe() const override { return "RotaryEmbedding"; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t width = ops::cpu::grouped_qkv_width(kv_heads_, group(), head_size_);
    const std::int64_t N = rows_of(ctx.x, width, describe());
    B_ = ctx.batch;
    T_ = ctx.seq_len;
    expect<ShapeError>(B_ * T_ == N, describe(), ": ", N, " rows, but batch * seq_len = ", B_ * T_);
    first_ = shard_ * T_;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    Kernels<T>& kernels = kernels_of(ctx);
    const Angles a = angles(kernels);
    kernels.rotary_forward(y.data(), ctx.x.data(), a.cos, a.sin, N, T_, kv_heads_, group(),
                           head_size_);
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    Kernels<T>& kernels = kernels_of(ctx);
    const Angles a = angles(kernels);
    kernels.rotary_backward(ctx.dx.data(), ctx.dy.data(), a.cos, a.sin, B_ * T_, T_, kv_heads_,
                            group(), head_size_, ctx.overwrite_dx);
  }
  bool writes_input_grad() const override { return true; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    // Two products and a sum per turned value: the g + 1 query and key heads of each g + 2.
    return elementwise_flops(in.input.numel() / (group() + 2) * (group() + 1), 3);
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(B_, T_, first_); }
  void resume(std::any saved) override { nn::resume_members(saved, B_, T_, first_); }

 private:
  using A = compute_type_t<T>;
  struct Table {
    std::int64_t first = -1, seq_len = -1;
    std::vector<A> cos, sin;
  };

  std::int64_t group() const { return heads_ / kv_heads_; }

  // The cos and sin tables of positions [first_, first_ + T_) in the memory of kernels' device:
  // the host's table itself, or its copy for a device set, made when the shape or the set
  // changed.
  struct Angles {
    const A* cos;
    const A* sin;
  };
  Angles angles(Kernels<T>& kernels) {
    const Table& t = table(first_, T_);
    if (kernels.device() == DeviceKind::host) return {t.cos.data(), t.sin.data()};
    const std::size_t n = t.cos.size();
    if (copy_for_ != kernels.id() || copy_first_ != t.first || copy_seq_len_ != t.seq_len) {
      copy_ = kernels.allocate(2 * n * sizeof(A));
      A* d = copy_.template view<A>({static_cast<std::int64_t>(2 * n)}).data();
      kernels.copy_from_host(d, t.cos.data(), n * sizeof(A));
      kernels.copy_from_host(d + n, t.sin.data(), n * sizeof(A));
      copy_for_ = kernels.id();
      copy_first_ = t.first;
      copy_seq_len_ = t.seq_len;
    }
    const A* d = copy_.template view<A>({static_cast<std::int64_t>(2 * n)}).data();
    return {d, d + n};
  }

  // The angles of positions [first, first + seq_len), computed once per shape.
  const Table& table(std::int64_t first, std::int64_t seq_len) {
    if (table_.first != first || table_.seq_len != seq_len) {
      const auto n = static_cast<std::size_t>(seq_len * (head_size_ / 2));
      table_.cos.resize(n);
      table_.sin.resize(n);
      ops::cpu::rotary_table(table_.cos.data(), table_.sin.data(), first, seq_len, head_size_,
                             theta_, scaling_);
      table_.first = first;
      table_.seq_len = seq_len;
    }
    return table_;
  }

  std::int64_t heads_, kv_heads_, head_size_;
  double theta_;
  ops::cpu::RopeScaling scaling_;
  std::int64_t shard_ = 0;
  std::int64_t B_ = 0, T_ = 0, first_ = 0;
  Table table_;
  KernelMemory copy_;  // table_'s cos then sin, in the memory of the device of set copy_for_
  std::uint64_t copy_for_ = 0;  // the set's Kernels::id (0: none)
  std::int64_t copy_first_ = -1, copy_seq_len_ = -1;
};

}  // namespace zero::nn
