#pragma once
// DeferredWeightGrads: the weight-gradient half of a split backward, for zero-bubble pipeline
// schedules (ZB-H1). A layer's backward has two parts: the input gradient, which the previous
// pipeline stage is waiting for, and the weight gradient, which only the optimizer step reads.
// When the StepContext carries a DeferredWeightGrads (ctx.weight_grads), layers compute the
// input gradient at once and leave their weight-gradient GEMMs here, with copies of what those
// read: the layer's input and the gradient at its output (both live in the activation arena,
// which the backward releases). run() computes them later, into the same gradient buffers, in
// the order they were left. Only the matrix products move: the cheap vector gradients
// (LayerNorm's, embeddings', biases of layers that sum them apart) stay in the input half.
// A layer that does not split simply computes everything in the input half, which is still
// correct, only not overlapped. The copies' storage is kept from run to run.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <zero/nn/context.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::nn {

/// Weight-gradient work left by a backward's input half (see the file comment).
template <class T>
class DeferredWeightGrads {
 public:
  DeferredWeightGrads() = default;
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;

  /// Leaves linear_backward's weight part: dweight [OC, C] += dout^T inp and dbias [OC] +=
  /// column sums of dout (either may be null), copying dout [N, OC] and inp [N, C] now.
  void linear(T* dweight, T* dbias, const T* dout, const T* inp, std::int64_t N, std::int64_t C,
              std::int64_t OC) {
    if (dweight == nullptr && dbias == nullptr) return;
    Job& job = next();
    job.dweight = dweight;
    job.dbias = dbias;
    job.N = N;
    job.C = C;
    job.OC = OC;
    job.dout.assign(dout, dout + N * OC);
    if (dweight != nullptr) job.inp.assign(inp, inp + N * C);
  }
  /// Leaves fn, a layer's own weight-gradient work: it must own (or outlive) what it reads.
  void call(std::function<void()> fn) { next().fn = std::move(fn); }

  /// Computes every weight gradient left, in order, and empties the list.
  void run() {
    for (std::size_t i = 0; i < size_; ++i) {
      Job& job = jobs_[i];
      if (job.fn) {
        job.fn();
        job.fn = nullptr;  // drop its captures now
        continue;
      }
      ops::cpu::linear_backward<T>(nullptr, job.dweight, job.dbias, job.dout.data(),
                                   job.dweight != nullptr ? job.inp.data() : nullptr, nullptr,
                                   job.N, job.C, job.OC);
    }
    size_ = 0;
  }
  /// Drops every weight gradient left without computing it (the engine does so when a failure
  /// ends the window they were aimed at).
  void clear() noexcept {
    for (std::size_t i = 0; i < size_; ++i) jobs_[i].fn = nullptr;
    size_ = 0;
  }
  /// True with nothing left to compute.
  bool empty() const { return size_ == 0; }
  /// Jobs left to compute.
  std::size_t size() const { return size_; }

 private:
  struct Job {
    T* dweight = nullptr;
    T* dbias = nullptr;
    std::int64_t N = 0, C = 0, OC = 0;
    std::vector<T> dout, inp;
    std::function<void()> fn;
  };
  Job& next() {
    if (size_ == jobs_.size()) jobs_.emplace_back();
    Job& job = jobs_[size_++];
    job.fn = nullptr;
    return job;
  }

  std::vector<Job> jobs_;  // [0, size_) pending; the rest keep their storage
  std::size_t size_ = 0;
};

/// A layer's linear backward (ops::cpu::linear_backward's arguments): all of it now, on the
/// pass's kernels, or, with ctx.weight_grads set (host only), the input gradient now and the
/// weight and bias gradients left there.
template <class T>
void linear_backward(const StepContext<T>& ctx, T* dinp, T* dweight, T* dbias, const T* dout,
                     const T* inp, const T* weight, std::int64_t N, std::int64_t C, std::int64_t OC,
                     bool overwrite_dinp = false) {
  if (ctx.weight_grads == nullptr) {
    kernels_of(ctx).linear_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC,
                                    overwrite_dinp);
    return;
  }
  expect_host_kernels(ctx, "a split backward (DeferredWeightGrads)");
  if (dinp != nullptr)
    ops::cpu::linear_backward<T>(dinp, nullptr, nullptr, dout, inp, weight, N, C, OC,
                                 overwrite_dinp);
  ctx.weight_grads->linear(dweight, dbias, dout, inp, N, C, OC);
}

}  // namespace zero::nn
