#pragma once
// LinearCrossEntropy: TiedLinear (logits = x W^T, W another layer's parameter, or the layer's own
// for an untied head) and SoftmaxCrossEntropy in one loss layer that never holds more than a chunk
// of the logits when only the loss and its gradient are needed. The rows (tokens) go in chunks
// whose logits fit chunk_bytes, each chunk's logits computed into one buffer. With one chunk, the
// forward keeps the logits and the backward turns them into dlogits and the two gradients, as the
// two layers do. With several, a training forward also computes the gradients (the loss's seed,
// ctx.loss_scale, is known before the forward): each chunk's logits become its dlogits in place
// as soon as its losses are out, its rows of the input gradient go to a buffer kept for the
// backward, and its weight gradient is added to a weight-sized buffer kept the same way; the
// backward hands the input gradient on and adds the weight gradient into the weight's (Liger's
// fused linear cross-entropy). Its cost over the two layers: no FLOPs, and a weight-sized and an
// input-sized buffer held from the forward to the backward beside the chunk of logits (89 MB
// for GPT-2 in bf16); a backward that recomputes (below) computes every chunk's logits but the
// last again instead. A forward that is not training (ctx.training false) computes only the
// losses and keeps the last chunk; a backward after it walks the chunks back, recomputing each
// chunk's logits but the last.
// Bits: with one chunk, those of TiedLinear + SoftmaxCrossEntropy (the same kernels; dlogits
// get a buffer of their own, as in the two layers, so logits() still holds the logits after the
// backward). With several, each row's loss and input gradient are those of its chunk's
// GEMMs and the weight gradient adds the chunks' products in turn (first first in a training
// forward, then into the weight's gradient; last first in a backward that recomputes); the
// chunking depends on the shape only, never on the thread count or the device: the chunks are
// as even as the bound allows, so the last is not a remainder of a few rows (B 8, T 1024 at
// GPT-2's bf16 logits: 4 chunks of 2048 rows, not 3 of 2656 and one of 224). Without labels
// (evaluation) it computes all the logits, passes them on in ctx.x and keeps them for logits(),
// like the two layers; a training forward without them is an InputError.
// Padded rows: with several chunks, the chunk's rows lie kernels.logits_row_stride(classes) apart
// (ld; classes on the host). A device whose GEMMs want rows of whole 16-byte packs (GPT-2's
// 50257 is not: cuBLASLt's odd-size kernels ran the LM head 5x slower) pads them, and the layer
// hands every GEMM a copy of the weight with ld - classes zero rows after its own (made once a
// pass, dropped after) and a weight gradient of ld rows (the training forward's buffer, or, in a
// backward that recomputes, a copy of the weight's gradient the same way, copied back after the
// last chunk). The zero rows add exact zeros to every sum and the cross-entropy kernels zero the
// padded columns of dlogits, so the values are those of rows classes apart, with no per-GEMM
// copy of the weight or of the logits (ops/cuda/linear.cuh pads any odd-sized GEMM that way: 8 GB
// of copies a step for GPT-2 at B 8). The bound counts classes elements a row, so the chunking
// stays the host's.
// Shared rows: when the rows of one batch are spread over ranks that average their losses (the
// positions of Ulysses sequence parallelism), share_counted_rows gives a function that turns
// this rank's count of labelled rows into the weight of its mean, so the ranks' mean is the
// mean over all their counted rows (padding spread unevenly over the positions is counted per
// token, as one process counts it). The loss and the backward's seed are multiplied by it; with
// equal counts it is exactly 1.
// Padding classes: set_vocabulary(V) with V below classes makes the weight's rows from V on
// padding (a token table padded past the vocabulary, as Megatron pads it for tensor parallelism
// and llm.c for the GEMMs): their logits are computed but never in the softmax, a label must be
// below V, and their rows of the weight gradient get exact zeros (the cross-entropy kernels read
// V columns of rows ld apart and zero the rest of dlogits). The evaluation logits keep all
// classes columns.

#include <algorithm>
#include <any>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

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
        vocab_(classes),
        labels_(std::move(labels)),
        chunk_bytes_(chunk_bytes) {
    expect<ShapeError>(in > 0 && classes > 0, describe(), ": in = ", in, ", classes = ", classes,
                       "; both must be positive");
    expect<ConfigError>(chunk_bytes >= 0, describe(), ": chunk_bytes = ", chunk_bytes,
                        " must be >= 0");
  }

  /// An untied head (Llama's lm_head): the layer's own parameter name.weight [classes, in],
  /// normal with stddev, weight-decayed, instead of another layer's; otherwise as above.
  LinearCrossEntropy(std::string name, std::int64_t in, std::int64_t classes, double stddev,
                     std::string labels = "labels",
                     std::int64_t chunk_bytes = default_logits_chunk_bytes)
      : LinearCrossEntropy(std::move(name), nullptr, in, classes, std::move(labels), chunk_bytes) {
    expect<ConfigError>(stddev > 0.0, describe(), ": stddev = ", stddev, "; expected > 0");
    own_stddev_ = stddev;
    weight_ = [this] { return own_; };
  }

  std::string describe() const override { return "LinearCrossEntropy '" + name_ + "'"; }
  /// name.weight when the layer owns its weight; none when it reads another layer's.
  std::vector<ParamSpec> params() const override {
    if (own_stddev_ == 0.0) return {};
    return {{name_ + ".weight", {classes_, in_}, Init::normal, own_stddev_, true}};
  }
  void bind(std::span<const ParamView<T>> views) override {
    if (own_stddev_ != 0.0) own_ = views[0];
  }

  /// The weight of this rank's mean given its counted rows (see the file comment), called on
  /// every rank of the group in each labelled forward; null (the default): 1, the rows are this
  /// rank's alone.
  void share_counted_rows(std::function<double(std::int64_t)> share) {
    share_of_ = std::move(share);
  }

  /// The classes a label may name and the softmax runs over: the weight's first vocab rows, the
  /// rest padding (see the file comment); classes by default. ShapeError unless
  /// 0 < vocab <= classes.
  void set_vocabulary(std::int64_t vocab) {
    expect<ShapeError>(vocab > 0 && vocab <= classes_, describe(), ": a vocabulary of ", vocab,
                       " classes must be in [1, ", classes_, "] (the weight's rows)");
    vocab_ = vocab;
  }
  /// The classes the softmax runs over (set_vocabulary; classes by default).
  std::int64_t vocabulary() const { return vocab_; }

  /// Rows per chunk for a batch of rows (the whole batch when its logits fit chunk_bytes): the
  /// fewest chunks of at most chunk_bytes over a row's logits (at least one row), made as even
  /// as they can be, rounded up to a multiple of 16 rows where that still fits.
  std::int64_t chunk_rows(std::int64_t rows) const {
    const std::int64_t row_bytes = classes_ * static_cast<std::int64_t>(sizeof(T));
    if (chunk_bytes_ == 0 || rows * row_bytes <= chunk_bytes_) return rows;
    const std::int64_t fit = std::max<std::int64_t>(1, chunk_bytes_ / row_bytes);
    const std::int64_t chunks = (rows + fit - 1) / fit;
    const std::int64_t even = (rows + chunks - 1) / chunks, rounded = (even + 15) / 16 * 16;
    return rounded <= fit ? rounded : even;
  }

  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, in_, describe());
    const ParamView<T> w = tied_weight();
    input_ = ctx.x;
    labels_data_ = find_row_labels(ctx, labels_, N, describe());
    expect_labels_when_training(ctx, labels_data_ != nullptr, describe(), labels_);
    chunk_ = labels_data_ != nullptr ? chunk_rows(N) : N;
    ld_ = row_stride(ctx, N);
    logits_ = chunk_ == N ? ctx.arena->template allocate<T>(ctx.x.shape().with_extent(-1, classes_))
                          : ctx.arena->template allocate<T>({chunk_, ld_});
    Kernels<T>& kernels = kernels_of(ctx);
    if (labels_data_ == nullptr) {  // evaluation: the logits are the output
      kernels.linear_forward(logits_.data(), input_.data(), w.value.data(), nullptr, N, in_,
                             classes_);
      ctx.x = logits_;
      return;
    }
    valid_ = kernels.count_valid_targets(labels_data_, N, vocab_);
    share_ = share_of_ ? share_of_(valid_) : 1.0;
    Tensor<Stat> losses = ctx.arena->template allocate<Stat>({N});
    row_stats_ = ctx.arena->template allocate<Stat>({N, 2});  // each row's softmax max and sum
    grads_in_forward_ = ctx.training && chunk_ < N;
    if (grads_in_forward_) {
      input_grad_ = ctx.arena->template allocate<T>({N, in_});
      weight_grad_ = ctx.arena->template allocate<T>({ld_, in_});
      kernels.fill_zero(weight_grad_.data(), ld_ * in_);
    }
    const PaddedRows weight = padded_rows(kernels, w.value.data());
    const Stat dloss = seed(ctx);
    for (std::int64_t n0 = 0; n0 < N; n0 += chunk_) {
      const std::int64_t rows = std::min(chunk_, N - n0);
      const T* x = input_.data() + n0 * in_;
      kernels.linear_forward(logits_.data(), x, weight.data, nullptr, rows, in_, ld_);
      if (grads_in_forward_) {  // the chunk's logits become its dlogits, in place
        kernels.cross_entropy_forward_backward(losses.data() + n0, logits_.data(), logits_.data(),
                                               labels_data_ + n0, rows, vocab_, ld_,
                                               row_stats_.data() + 2 * n0, dloss, valid_);
        kernels.linear_backward(input_grad_.data() + n0 * in_, weight_grad_.data(), nullptr,
                                logits_.data(), x, weight.data, rows, in_, ld_, true);
      } else {
        kernels.cross_entropy_forward(losses.data() + n0, logits_.data(), labels_data_ + n0, rows,
                                      vocab_, ld_, row_stats_.data() + 2 * n0);
      }
    }
    ctx.loss = convert<T>(kernels.cross_entropy_mean(losses.data(), labels_data_, N, valid_) *
                              static_cast<Stat>(share_) +
                          static_cast<Stat>(ctx.aux_loss));
    // The last chunk's logits (all of them with one chunk; its dlogits after a training forward
    // in several).
    ctx.x = logits_;
  }

  void backward(StepContext<T>& ctx) override {
    expect<InputError>(labels_data_ != nullptr, describe(),
                       ": backward needs labels; the micro-batch had no input '", labels_, "'");
    if (grads_in_forward_) {
      hand_on_forward_grads(ctx);
      return;
    }
    // A split backward would leave the weight-gradient GEMMs with the address of the padded
    // gradient copy, which is gone by then; it runs on the host's kernels, whose rows are not
    // padded.
    expect<Error>(ctx.weight_grads == nullptr || ld_ == classes_, describe(),
                  ": a split backward cannot leave the weight gradient of logits rows padded to ",
                  ld_, " elements for later; run it on a kernel set that does not pad them");
    const ParamView<T> w = tied_weight();
    const std::int64_t N = input_.numel() / in_;
    if (N == 0) return;  // no rows: no gradient (and no chunk to divide by)
    const Stat dloss = seed(ctx);
    const std::int64_t last = (N - 1) / chunk_ * chunk_;
    Tensor<T> dlogits = chunk_ == N ? ctx.arena->template allocate<T>(logits_.shape()) : logits_;
    Kernels<T>& kernels = kernels_of(ctx);
    const PaddedRows weight = padded_rows(kernels, w.value.data());
    const PaddedRows grad = padded_rows(kernels, w.grad.data());
    for (std::int64_t n0 = last; n0 >= 0; n0 -= chunk_) {
      const std::int64_t rows = std::min(chunk_, N - n0);
      const T* x = input_.data() + n0 * in_;
      if (n0 != last) {  // the forward kept only the last chunk's logits
        kernels.linear_forward(logits_.data(), x, weight.data, nullptr, rows, in_, ld_);
      }
      kernels.cross_entropy_backward(dlogits.data(), logits_.data(), labels_data_ + n0, rows,
                                     vocab_, ld_, dloss, valid_, row_stats_.data() + 2 * n0);
      nn::linear_backward<T>(ctx, ctx.dx.data() + n0 * in_, grad.data, nullptr, dlogits.data(), x,
                             weight.data, rows, in_, ld_, ctx.overwrite_dx);
    }
    if (grad.data != w.grad.data()) kernels.copy(w.grad.data(), grad.data, classes_ * in_);
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
    f.flops += elementwise_flops(rows * vocab_).flops;  // the softmax over the logits
    return f;
  }

  bool parks() const override { return true; }
  std::any park() override {
    return nn::park_members(input_, logits_, row_stats_, labels_data_, chunk_, ld_, valid_, share_,
                            grads_in_forward_, input_grad_, weight_grad_);
  }
  void resume(std::any saved) override {
    nn::resume_members(saved, input_, logits_, row_stats_, labels_data_, chunk_, ld_, valid_,
                       share_, grads_in_forward_, input_grad_, weight_grad_);
  }

 private:
  using Stat = compute_type_t<T>;

  // The backward's seed: the loss scale times this rank's share of the loss.
  Stat seed(const StepContext<T>& ctx) const {
    return convert<Stat>(ctx.loss_scale) * static_cast<Stat>(share_);
  }

  /// The backward of a training forward that computed the gradients: the input gradient handed
  /// on (written or added, as Sequential asks), the weight gradient's first classes rows added
  /// into the weight's. In a split backward this addition stays in the input half too (there is
  /// no product left to defer, and the buffer goes with the pass's activations).
  void hand_on_forward_grads(StepContext<T>& ctx) {
    const ParamView<T> w = tied_weight();
    Kernels<T>& kernels = kernels_of(ctx);
    if (ctx.overwrite_dx) {
      kernels.copy(ctx.dx.data(), input_grad_.data(), input_grad_.numel());
    } else {
      kernels.accumulate(ctx.dx.data(), input_grad_.data(), input_grad_.numel());
    }
    kernels.accumulate(w.grad.data(), weight_grad_.data(), classes_ * in_);
  }

  /// A weight-shaped matrix [classes, in] as the GEMMs of rows ld_ apart read it: the matrix
  /// itself when ld_ is classes, else a copy (memory of the pass's kernel set, freed in its
  /// order when dropped) with ld_ - classes zero rows after its own.
  struct PaddedRows {
    T* data = nullptr;
    KernelMemory copy;
  };
  PaddedRows padded_rows(Kernels<T>& kernels, T* matrix) const {
    if (ld_ == classes_) return {matrix, {}};
    PaddedRows out;
    out.copy = kernels.allocate(static_cast<std::size_t>(ld_ * in_) * sizeof(T));
    out.data = out.copy.template view<T>({ld_, in_}).data();
    kernels.copy(out.data, matrix, classes_ * in_);
    kernels.fill_zero(out.data + classes_ * in_, (ld_ - classes_) * in_);
    return out;
  }

  /// The stride of this forward's logits rows: the kernel set's when the logits go in several
  /// chunks, classes otherwise.
  std::int64_t row_stride(const StepContext<T>& ctx, std::int64_t N) const {
    if (chunk_ == N) return classes_;
    const std::int64_t ld = kernels_of(ctx).logits_row_stride(classes_);
    expect<Error>(ld >= classes_, describe(), ": the kernel set's logits row stride ", ld,
                  " is below the ", classes_, " classes");
    return ld;
  }

  ParamView<T> tied_weight() const {
    const ParamView<T> w = weight_();
    expect<ShapeError>(w.value.numel() == in_ * classes_, describe(), ": the tied weight has ",
                       w.value.numel(), " elements, expected ", classes_, " x ", in_);
    return w;
  }

  std::string name_;
  std::function<ParamView<T>()> weight_;
  double own_stddev_ = 0.0;  // > 0: the layer owns its weight, own_
  ParamView<T> own_;
  std::int64_t in_, classes_;
  std::int64_t vocab_;  // the classes in the softmax: the first vocab_ of classes_
  std::string labels_;
  std::int64_t chunk_bytes_;
  Tensor<T> input_, logits_;
  Tensor<Stat> row_stats_;  // [rows, 2]: the forward's softmax max and sum per row
  const std::int32_t* labels_data_ = nullptr;
  std::int64_t chunk_ = 0, ld_ = 0, valid_ = 0;   // ld_: elements between the chunk's logits rows
  std::function<double(std::int64_t)> share_of_;  // null: the rows are this rank's alone
  double share_ = 1.0;                            // the last labelled forward's weight
  // A training forward in several chunks computed the gradients: the input's [rows, in] and the
  // weight's [ld_, in] (its rows past classes_ zero).
  bool grads_in_forward_ = false;
  Tensor<T> input_grad_, weight_grad_;
};

}  // namespace zero::nn
