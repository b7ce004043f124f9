#pragma once
// LinearCrossEntropy: TiedLinear (logits = x W^T, W another layer's parameter) and
// SoftmaxCrossEntropy in one loss layer that never holds more than a chunk of the logits when
// only the loss and its gradient are needed. The rows (tokens) go in chunks whose logits fit
// chunk_bytes: the forward computes each chunk's logits into one buffer and its per-row losses,
// keeping the last chunk; the backward walks the chunks back, recomputing each chunk's logits
// (the last is still there), turning them into dlogits in place and adding that chunk's input
// and weight gradients. Its cost over the two layers: one more GEMM for every chunk but the
// last, nothing when the batch fits one chunk. A batch of B*T rows needs a chunk of R x V
// logits instead of B*T x V (GPT-2's V = 50257 in f32: 201 KB a row, so 256 MiB is 1335 rows
// where B 8, T 1024 would need 1.6 GB).
// Bits: with one chunk, those of TiedLinear + SoftmaxCrossEntropy (the same kernels; dlogits
// get a buffer of their own, as in the two layers, so logits() still holds the logits after the
// backward). With several, each row's loss and input gradient are those of its chunk's
// GEMMs and the weight gradient adds the chunks' products in turn (last first); the chunking
// depends on the shape only, never on the thread count. Without labels (evaluation) it computes
// all the logits, passes them on in ctx.x and keeps them for logits(), like the two layers.

#include <algorithm>
#include <any>
#include <cstdint>
#include <functional>
#include <string>

#include <zero/core/error.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// Logits held at once by default: 256 MiB.
inline constexpr std::int64_t default_logits_chunk_bytes = std::int64_t{256} << 20;

/// The mean softmax cross-entropy of x W^T against integer labels, in row chunks (see the file
/// comment); a loss layer on [..., in].
template <class T>
class LinearCrossEntropy final : public Layer<T> {
 public:
  /// weight returns the owner's current view [classes, in] (as TiedLinear's); labels names the
  /// input (or "targets"); chunk_bytes bounds the logits held at once (at least one row; 0: no
  /// bound, the whole batch at once).
  LinearCrossEntropy(std::string name, std::function<ParamView<T>()> weight, std::int64_t in,
                     std::int64_t classes, std::string labels = "labels",
                     std::int64_t chunk_bytes = default_logits_chunk_bytes)
      : name_(std::move(name)),
        weight_(std::move(weight)),
        in_(in),
        classes_(classes),
        labels_(std::move(labels)),
        chunk_bytes_(chunk_bytes) {
    expect<ShapeError>(in > 0 && classes > 0, describe(), ": in = ", in, ", classes = ", classes,
                       "; both must be positive");
    expect<ConfigError>(chunk_bytes >= 0, describe(), ": chunk_bytes = ", chunk_bytes,
                        " must be >= 0");
  }

  std::string describe() const override { return "LinearCrossEntropy '" + name_ + "'"; }

  /// Rows per chunk for a batch of rows (the whole batch when its logits fit chunk_bytes):
  /// chunk_bytes over a row's logits, rounded down to a multiple of 16 when that leaves some.
  std::int64_t chunk_rows(std::int64_t rows) const {
    const std::int64_t row_bytes = classes_ * static_cast<std::int64_t>(sizeof(T));
    if (chunk_bytes_ == 0 || rows * row_bytes <= chunk_bytes_) return rows;
    const std::int64_t fit = std::max<std::int64_t>(1, chunk_bytes_ / row_bytes);
    return fit >= 16 ? fit / 16 * 16 : fit;
  }

  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    const ParamView<T> w = tied_weight();
    input_ = ctx.x;
    labels_data_ = find_row_labels(ctx, labels_, N, describe());
    chunk_ = labels_data_ != nullptr ? chunk_rows(N) : N;
    logits_ = chunk_ == N ? ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, classes_))
                          : ctx.arena->template allocate<T>({chunk_, classes_});
    Kernels<T>& kernels = kernels_of(ctx);
    if (labels_data_ == nullptr) {  // evaluation: the logits are the output
      kernels.linear_forward(logits_.data(), input_.data(), w.value.data(), nullptr, N, in_,
                             classes_);
      ctx.x = logits_;
      return;
    }
    valid_ = kernels.count_valid_targets(labels_data_, N, classes_);
    Tensor<Stat> losses = ctx.arena->template allocate<Stat>({N});
    row_stats_ = ctx.arena->template allocate<Stat>({N, 2});  // each row's softmax max and sum
    for (std::int64_t n0 = 0; n0 < N; n0 += chunk_) {
      const std::int64_t rows = std::min(chunk_, N - n0);
      kernels.linear_forward(logits_.data(), input_.data() + n0 * in_, w.value.data(), nullptr,
                             rows, in_, classes_);
      kernels.cross_entropy_forward(losses.data() + n0, logits_.data(), labels_data_ + n0, rows,
                                    classes_, row_stats_.data() + 2 * n0);
    }
    ctx.loss = convert<T>(kernels.cross_entropy_mean(losses.data(), labels_data_, N, valid_) +
                          static_cast<Stat>(ctx.aux_loss));
    ctx.x = logits_;  // the last chunk's logits (all of them with one chunk)
  }

  void backward(StepContext<T>& ctx) override {
    expect<InputError>(labels_data_ != nullptr, describe(),
                       ": backward needs labels; the micro-batch had no input '", labels_, "'");
    const ParamView<T> w = tied_weight();
    const std::int64_t N = input_.numel() / in_;
    const auto dloss = convert<Stat>(ctx.loss_scale);
    const std::int64_t last = (N - 1) / chunk_ * chunk_;
    Tensor<T> dlogits = chunk_ == N ? ctx.arena->template allocate<T>(logits_.shape()) : logits_;
    Kernels<T>& kernels = kernels_of(ctx);
    for (std::int64_t n0 = last; n0 >= 0; n0 -= chunk_) {
      const std::int64_t rows = std::min(chunk_, N - n0);
      const T* x = input_.data() + n0 * in_;
      if (n0 != last) {  // the forward kept only the last chunk's logits
        kernels.linear_forward(logits_.data(), x, w.value.data(), nullptr, rows, in_, classes_);
      }
      kernels.cross_entropy_backward(dlogits.data(), logits_.data(), labels_data_ + n0, rows,
                                     classes_, dloss, valid_, row_stats_.data() + 2 * n0);
      nn::linear_backward<T>(ctx, ctx.dx.data() + n0 * in_, w.grad.data(), nullptr, dlogits.data(),
                             x, w.value.data(), rows, in_, classes_, ctx.overwrite_dx);
    }
  }
  bool writes_input_grad() const override { return true; }

  /// Logits of the last forward, [..., classes] (valid until the next micro-step); Error when
  /// that forward had labels and more rows than one chunk (it kept no whole set of logits).
  Tensor<const T> logits() const {
    expect<Error>(labels_data_ == nullptr || chunk_ == input_.numel() / in_, describe(),
                  ": the last forward computed the loss in chunks of ", chunk_,
                  " rows and kept no logits; run it without labels for them");
    return logits_;
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    const std::int64_t rows = in.input.numel() / in_;
    FlopCount f = matmul_flops(rows, in_, classes_);
    f.flops += elementwise_flops(rows * classes_).flops;  // the softmax over the logits
    return f;
  }

  bool parks() const override { return true; }
  std::any park() override {
    return nn::park_members(input_, logits_, row_stats_, labels_data_, chunk_, valid_);
  }
  void resume(std::any saved) override {
    nn::resume_members(saved, input_, logits_, row_stats_, labels_data_, chunk_, valid_);
  }

 private:
  using Stat = compute_type_t<T>;

  ParamView<T> tied_weight() const {
    const ParamView<T> w = weight_();
    expect<ShapeError>(w.value.numel() == in_ * classes_, describe(), ": the tied weight has ",
                       w.value.numel(), " elements, expected ", classes_, " x ", in_);
    return w;
  }

  std::string name_;
  std::function<ParamView<T>()> weight_;
  std::int64_t in_, classes_;
  std::string labels_;
  std::int64_t chunk_bytes_;
  Tensor<T> input_, logits_;
  Tensor<Stat> row_stats_;  // [rows, 2]: the forward's softmax max and sum per row
  const std::int32_t* labels_data_ = nullptr;
  std::int64_t chunk_ = 0, valid_ = 0;
};

}  // namespace zero::nn
