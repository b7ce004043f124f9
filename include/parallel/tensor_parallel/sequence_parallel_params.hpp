#pragma once
// SequenceParallelParams: wraps a layer whose parameters are whole on every tensor-parallel rank
// but which runs on the rank's 1/tp of the rows under sequence parallelism (LayerNorm, RMSNorm).
// Each rank's parameter gradient is then only its rows' share, so the wrapper lets the inner
// layer accumulate into zeroed private gradients, sums them over the accumulation window, and
// at the unit's last backward of the window adds their sum over the group (one all-reduce,
// window_grad_sum.hpp) into the real ones. The gradients of these parameters are then equal on
// all tensor-parallel ranks when the window's reductions run, as without sequence parallelism,
// and the group reduces once per step, as Megatron's finalize_model_grads does. The sum goes in
// inside the layer's backward, so it composes with every ZeRO stage's reduction schedule (the
// backwards before it add nothing to the real gradients).

#include <any>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <parallel/tensor_parallel/window_grad_sum.hpp>
#include <zero/core/buffer.hpp>
#include <zero/nn/layers/layer.hpp>

namespace zero::parallel {

/// inner, with its parameter gradients summed over the tensor-parallel group.
template <class T>
class SequenceParallelParams final : public nn::Layer<T> {
 public:
  /// Wraps inner (which must not be null).
  SequenceParallelParams(TensorParallel tp, std::unique_ptr<nn::Layer<T>> inner)
      : tp_(std::move(tp)), inner_(std::move(inner)) {
    expect<Error>(inner_ != nullptr, "SequenceParallelParams: null layer");
  }

  std::string describe() const override { return inner_->describe() + " (sequence parallel)"; }
  std::vector<nn::ParamSpec> params() const override { return inner_->params(); }
  void bind(std::span<const nn::ParamView<T>> views) override {
    real_.assign(views.begin(), views.end());
    std::size_t total = 0;
    for (const auto& v : views) total += static_cast<std::size_t>(v.value.numel());
    if (private_.size() != total) private_ = Buffer<T>(total);
    window_sums_.resize(total);
    std::vector<nn::ParamView<T>> inner_views;
    std::size_t offset = 0;
    for (const auto& v : views) {
      Tensor<T> grad = v.grad.data() != nullptr
                           ? Tensor<T>(private_.data() + offset, v.value.shape())
                           : Tensor<T>();
      inner_views.push_back({v.value, grad});
      offset += static_cast<std::size_t>(v.value.numel());
    }
    inner_->bind(inner_views);
  }
  void forward(nn::StepContext<T>& ctx) override {
    nn::expect_host_kernels(ctx, describe());
    inner_->forward(ctx);
  }
  void backward(nn::StepContext<T>& ctx) override {
    for (T& g : private_.view()) g = T(0);
    inner_->backward(ctx);
    window_sums_.add(ctx, std::span<const T>(private_.data(), private_.size()));
    // One all-reduce for all the layer's parameters (LayerNorm: weight and bias, 2C values).
    if (!window_sums_.reduce(ctx, tp_)) return;
    std::size_t offset = 0;
    for (const auto& v : real_) {
      const auto n = static_cast<std::size_t>(v.value.numel());
      if (v.grad.data() != nullptr) window_sums_.add_to(v.grad.data(), offset, n);
      offset += n;
    }
  }
  /// The wrapped layer's.
  std::optional<nn::FlopCount> forward_flops(const nn::FlopInput& in) const override {
    return inner_->forward_flops(in);
  }
  /// The wrapped layer's (the gradient buffers here hold nothing between forward and backward).
  bool parks() const override { return inner_->parks(); }
  std::any park() override { return inner_->park(); }
  void resume(std::any saved) override { inner_->resume(std::move(saved)); }
  /// The wrapped layer.
  nn::Layer<T>& inner() { return *inner_; }

 private:
  TensorParallel tp_;
  std::unique_ptr<nn::Layer<T>> inner_;
  std::vector<nn::ParamView<T>> real_;
  Buffer<T> private_;             // the inner layer's gradients of one backward
  WindowGradSum<T> window_sums_;  // their sum over the window, then over the group
};

}  // namespace zero::parallel
