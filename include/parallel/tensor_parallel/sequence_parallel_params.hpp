#pragma once
// SequenceParallelParams: wraps a layer whose parameters are whole on every tensor-parallel rank
// but which runs on the rank's 1/tp of the rows under sequence parallelism (LayerNorm, RMSNorm).
// Each rank's parameter gradient is then only its rows' share, so the wrapper lets the inner
// layer accumulate into zeroed private gradients and adds their sum over the group
// (an all-reduce) into the real ones: after every backward the gradients of these parameters are
// equal on all tensor-parallel ranks, as without sequence parallelism. (Megatron all-reduces
// them once per step in finalize_model_grads; here it happens per micro-step, inside the layer,
// so it composes with every ZeRO stage's reduction schedule. The tensors are small: 2C per norm.)

#include <any>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
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
    // One all-reduce for all the layer's parameters (LayerNorm: weight and bias, 2C values).
    if (tp_.active())
      tp_.comm().all_reduce(std::span<T>(private_.data(), private_.size()), ReduceOp::sum);
    std::size_t offset = 0;
    for (const auto& v : real_) {
      const auto n = static_cast<std::int64_t>(v.value.numel());
      if (v.grad.data() != nullptr) detail::add_into(v.grad.data(), private_.data() + offset, n);
      offset += static_cast<std::size_t>(n);
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
  Buffer<T> private_;
};

}  // namespace zero::parallel
