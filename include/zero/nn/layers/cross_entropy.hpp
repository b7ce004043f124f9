#pragma once
// SoftmaxCrossEntropy: the loss layer for classification. ctx.x holds logits [..., classes];
// the labels (i32, one per row, ops::cpu::ignore_index = -1 skips a row) come from the
// micro-batch input `labels`, or from ctx.targets when it is "targets" and the batch has no
// such input. Forward sets ctx.loss to the mean over counted rows (computed in the compute type,
// rounded once to T) and leaves the logits in ctx.x; without labels (evaluation on unlabelled
// data) it only passes the logits on, and a training forward without them is an InputError.
// Backward ignores ctx.dy and seeds dloss = ctx.loss_scale.

#include <any>
#include <cstdint>
#include <string>

#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>

namespace zero::nn {

/// The labels of a loss layer's rows: the micro-batch input `name` (i32, one per row), or
/// ctx.targets when name is "targets" and the batch has no such input; null without them (an
/// unlabelled batch). InputError naming layer when their count is not rows.
template <class T>
const std::int32_t* find_row_labels(const StepContext<T>& ctx, const std::string& name,
                                    std::int64_t rows, const std::string& layer) {
  if (name == "targets" && !ctx.inputs.contains(name)) {
    expect<InputError>(ctx.targets == nullptr || ctx.tokens_count() == rows, layer, ": ",
                       ctx.tokens_count(), " targets (batch x seq_len) for ", rows,
                       " rows of logits");
    return ctx.targets;
  }
  if (!ctx.inputs.contains(name)) return nullptr;
  const Tensor<const std::int32_t> labels = ctx.template input<std::int32_t>(name);
  expect_input_on_kernels_device(ctx, labels, name, layer);
  expect<InputError>(labels.numel() == rows, layer, ": ", labels.numel(), " labels for ", rows,
                     " rows of logits");
  return labels.data();
}

/// Mean softmax cross-entropy of logits against integer labels.
template <class T>
class SoftmaxCrossEntropy final : public Layer<T> {
 public:
  /// Logits have classes columns; labels names the input.
  explicit SoftmaxCrossEntropy(std::int64_t classes, std::string labels = "labels")
      : classes_(classes), labels_(std::move(labels)) {
    expect_positive_size(describe(), "classes", classes);
  }

  std::string describe() const override { return "SoftmaxCrossEntropy '" + labels_ + "'"; }
  void forward(StepContext<T>& ctx) override {
    const std::int64_t N = rows_of(ctx.x, classes_, describe());
    logits_ = ctx.x;
    labels_data_ = find_labels(ctx, N);
    expect_labels_when_training(ctx, labels_data_ != nullptr, describe(), labels_);
    if (labels_data_ == nullptr) return;
    Kernels<T>& kernels = kernels_of(ctx);
    valid_ = kernels.count_valid_targets(labels_data_, N, classes_);
    Tensor<Stat> losses = ctx.arena->template allocate<Stat>({N});
    row_stats_ = ctx.arena->template allocate<Stat>({N, 2});  // each row's softmax max and sum
    kernels.cross_entropy_forward(losses.data(), logits_.data(), labels_data_, N, classes_,
                                  classes_, row_stats_.data());
    ctx.loss = convert<T>(kernels.cross_entropy_mean(losses.data(), labels_data_, N, valid_) +
                          static_cast<Stat>(ctx.aux_loss));
  }
  void backward(StepContext<T>& ctx) override {
    expect<InputError>(labels_data_ != nullptr, describe(),
                       ": backward needs labels; the micro-batch had no input '", labels_, "'");
    Kernels<T>& kernels = kernels_of(ctx);
    // The kernel writes dlogits: into dx, or beside it when dx already holds a gradient to add
    // to (the first layer of a Residual branch, whose skip gradient Sequential put there).
    const Tensor<T> dlogits =
        ctx.overwrite_dx ? ctx.dx : ctx.arena->template allocate<T>(logits_.shape());
    kernels.cross_entropy_backward(dlogits.data(), logits_.data(), labels_data_,
                                   logits_.numel() / classes_, classes_, classes_,
                                   convert<Stat>(ctx.loss_scale), valid_, row_stats_.data());
    if (!ctx.overwrite_dx) kernels.accumulate(ctx.dx.data(), dlogits.data(), logits_.numel());
  }
  bool writes_input_grad() const override { return true; }  // the kernel writes dlogits
  /// Logits of the last forward, [..., classes] (valid until the next micro-step).
  Tensor<const T> logits() const { return logits_; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel());  // the softmax over the logits
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(logits_, row_stats_, labels_data_, valid_); }
  void resume(std::any saved) override {
    nn::resume_members(saved, logits_, row_stats_, labels_data_, valid_);
  }

 private:
  using Stat = compute_type_t<T>;

  const std::int32_t* find_labels(const StepContext<T>& ctx, std::int64_t rows) const {
    return find_row_labels(ctx, labels_, rows, describe());
  }

  std::int64_t classes_;
  std::string labels_;
  Tensor<T> logits_;
  Tensor<Stat> row_stats_;  // [rows, 2]: the forward's softmax max and sum per row
  const std::int32_t* labels_data_ = nullptr;
  std::int64_t valid_ = 0;  // counted labels of the last forward
};

}  // namespace zero::nn
