#pragma once
// VocabParallelCrossEntropy: softmax cross-entropy over logits split on the vocabulary, rank i
// holding columns [i*V/tp, (i+1)*V/tp) of every row (the output of the column-parallel LM head).
// The whole logits never exist on one rank (Megatron's vocab-parallel cross-entropy):
//   m_n = max over the group of the local row maxima           (all-reduce max, N values)
//   s_n = sum over the group of sum_v exp(l_nv - m_n)          (all-reduce sum, with the next)
//   p_n = l_n,target - m_n on the rank holding the target, 0 elsewhere
//   loss_n = log s_n - p_n,  loss = mean over counted rows (ignore_index rows skipped)
// The two sums travel in one all-reduce of 2N values. Backward needs no communication:
//   dlogits_nv = (exp(l_nv - m_n) / s_n - [v == target_n]) * dloss / counted rows.
// Statistics are in the compute type (float for half types), as the whole-vocabulary kernel.
// A vocabulary padded to split evenly (set_vocabulary: the first vocab of the V columns are
// tokens) leaves the padding columns out of the max and the sums, and their dlogits zero: each
// rank counts its columns below vocab, none on a rank that holds only padding (its max is -inf
// and the group's comes from the others). When the rows are a part of the rows whose mean is
// the loss (Ulysses sequence parallelism's positions), share_counted_rows weighs this rank's
// mean as LinearCrossEntropy's does.

#include <algorithm>
#include <any>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::parallel {

/// Mean cross-entropy of vocabulary-split logits [N, V/tp] against labels [N] in [0, V).
template <class T>
class VocabParallelCrossEntropy final : public nn::Layer<T> {
 public:
  /// vocab is the whole vocabulary V; labels names the micro-batch input ("targets":
  /// ctx.targets).
  VocabParallelCrossEntropy(TensorParallel tp, std::int64_t vocab, std::string labels = "targets")
      : tp_(std::move(tp)), vocab_(vocab), tokens_(vocab), labels_(std::move(labels)) {
    expect<ConfigError>(vocab > 0 && vocab % tp_.size() == 0, describe(), ": the vocabulary of ",
                        vocab, " does not split over tensor-parallel size ", tp_.size());
  }

  std::string describe() const override { return "VocabParallelCrossEntropy '" + labels_ + "'"; }

  /// The weight of this rank's mean given its counted rows, called in each labelled forward
  /// on every rank of the rows' group (LinearCrossEntropy::share_counted_rows); null (the
  /// default): 1.
  void share_counted_rows(std::function<double(std::int64_t)> share) {
    share_of_ = std::move(share);
  }
  /// The tokens among the V columns: the first vocab, the rest padding (see the file comment);
  /// V by default. ConfigError unless 0 < vocab <= V.
  void set_vocabulary(std::int64_t vocab) {
    expect<ConfigError>(vocab > 0 && vocab <= vocab_, describe(), ": a vocabulary of ", vocab,
                        " tokens must be in [1, ", vocab_, "] (the split columns)");
    tokens_ = vocab;
  }
  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    const std::int64_t V = part();
    N_ = nn::rows_of(ctx.x, V, describe());
    logits_ = ctx.x;
    labels_data_ = find_labels(ctx);
    nn::expect_labels_when_training(ctx, labels_data_ != nullptr, describe(), labels_);
    if (labels_data_ == nullptr) return;
    const std::int64_t valid = ops::cpu::count_valid_targets(labels_data_, N_, tokens_);
    share_ = share_of_ ? share_of_(valid) : 1.0;
    const std::int64_t counted = counted_columns();
    max_ = ctx.arena->template allocate<Stat>({N_});
    sums_ = ctx.arena->template allocate<Stat>({2, N_});  // [predicted; sum of exponentials]
    const T* x = logits_.data();
    Stat* m = max_.data();
    ops::cpu::parallel_for(N_, [&](std::int64_t n) {
      Stat best = -std::numeric_limits<Stat>::infinity();
      for (std::int64_t v = 0; v < counted; ++v) {
        const Stat l = ops::cpu::load(x[n * V + v]);
        best = l > best ? l : best;
      }
      m[n] = best;
    });
    if (tp_.active()) tp_.comm().all_reduce(max_.span(), ReduceOp::max);
    const std::int64_t first = tp_.rank() * V;
    const std::int32_t* labels = labels_data_;
    Stat* predicted = sums_.data();
    Stat* sum = sums_.data() + N_;
    ops::cpu::parallel_for(N_, [&](std::int64_t n) {
      Stat s = Stat(0);
      for (std::int64_t v = 0; v < counted; ++v) {
        s += std::exp(ops::cpu::load(x[n * V + v]) - m[n]);
      }
      sum[n] = s;
      const std::int64_t local = labels[n] - first;
      predicted[n] = labels[n] != ops::cpu::ignore_index && local >= 0 && local < counted
                         ? ops::cpu::load(x[n * V + local]) - m[n]
                         : Stat(0);
    });
    if (tp_.active()) tp_.comm().all_reduce(sums_.span(), ReduceOp::sum);
    Stat total = Stat(0);
    for (std::int64_t n = 0; n < N_; ++n) {  // fixed order: deterministic
      if (labels[n] != ops::cpu::ignore_index) total += std::log(sum[n]) - predicted[n];
    }
    ctx.loss = convert<T>((valid > 0 ? total / static_cast<Stat>(valid) : Stat(0)) *
                              static_cast<Stat>(share_) +
                          static_cast<Stat>(ctx.aux_loss));
  }
  void backward(nn::StepContext<T>& ctx) override {
    expect<nn::InputError>(labels_data_ != nullptr, describe(),
                           ": backward needs labels; the micro-batch had no input '", labels_, "'");
    const std::int64_t V = part(), first = tp_.rank() * V, counted = counted_columns();
    const std::int64_t valid = ops::cpu::count_valid_targets(labels_data_, N_, tokens_);
    const Stat scale = valid > 0 ? convert<Stat>(ctx.loss_scale) * static_cast<Stat>(share_) /
                                       static_cast<Stat>(valid)
                                 : Stat(0);
    const T* x = logits_.data();
    T* dx = ctx.dx.data();
    const Stat* m = max_.data();
    const Stat* sum = sums_.data() + N_;
    const std::int32_t* labels = labels_data_;
    // dlogits go into dx, or are added to what it holds (overwrite_dx false: the first layer of
    // a Residual branch, whose skip gradient Sequential put there).
    const bool overwrite = ctx.overwrite_dx;
    const auto put = [overwrite](T& d, Stat g) {
      d = ops::cpu::store<T>(overwrite ? g : ops::cpu::load(d) + g);
    };
    ops::cpu::parallel_for(N_, [&](std::int64_t n) {
      T* d = dx + n * V;
      if (labels[n] == ops::cpu::ignore_index) {
        for (std::int64_t v = 0; v < V; ++v) put(d[v], Stat(0));
        return;
      }
      const Stat inv = Stat(1) / sum[n];
      const std::int64_t local = labels[n] - first;
      for (std::int64_t v = 0; v < counted; ++v) {
        Stat g = std::exp(ops::cpu::load(x[n * V + v]) - m[n]) * inv * scale;
        if (v == local) g -= scale;
        put(d[v], g);
      }
      for (std::int64_t v = counted; v < V; ++v) put(d[v], Stat(0));  // padding
    });
  }
  bool writes_input_grad() const override { return true; }  // honours overwrite_dx
  /// This rank's logits of the last forward, [N, V/tp] (valid until the next micro-step).
  Tensor<const T> logits() const { return logits_; }

  /// The softmax over this rank's logits.
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput& in) const override {
    return nn::elementwise_flops(in.input.numel());
  }

  bool parks() const override { return true; }
  std::any park() override {
    return nn::park_members(logits_, max_, sums_, labels_data_, N_, share_);
  }
  void resume(std::any saved) override {
    nn::resume_members(saved, logits_, max_, sums_, labels_data_, N_, share_);
  }

 private:
  using Stat = compute_type_t<T>;

  std::int64_t part() const { return vocab_ / tp_.size(); }
  // This rank's columns that are tokens: those of [rank * V/tp, (rank + 1) * V/tp) below
  // tokens_ (all but on the ranks holding the padding).
  std::int64_t counted_columns() const {
    const std::int64_t V = part();
    return std::clamp<std::int64_t>(tokens_ - tp_.rank() * V, 0, V);
  }
  // The whole-vocabulary loss's rule: a named input, or ctx.targets (batch x seq_len of them
  // for N_ rows), counted against the rows.
  const std::int32_t* find_labels(const nn::StepContext<T>& ctx) const {
    return nn::find_row_labels(ctx, labels_, N_, describe());
  }

  TensorParallel tp_;
  std::int64_t vocab_;   // V: the split columns
  std::int64_t tokens_;  // the first tokens_ of them are tokens, the rest padding
  std::string labels_;
  Tensor<T> logits_;
  Tensor<Stat> max_, sums_;
  const std::int32_t* labels_data_ = nullptr;
  std::int64_t N_ = 0;
  std::function<double(std::int64_t)> share_of_;  // null: the rows are this rank's alone
  double share_ = 1.0;                            // the last labelled forward's weight
};

}  // namespace zero::parallel
