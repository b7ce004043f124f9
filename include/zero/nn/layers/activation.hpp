#pragma once
// Elementwise activations as layers: ReLU, GELU (tanh approximation, GPT-2's) and SiLU. Each
// keeps a view of its input (the previous layer's output stays in the arena until this unit's
// backward); GELU runs on the pass's kernels (any device), ReLU and SiLU on the host's only. The
// shape passes through unchanged.

#include <any>
#include <cstdint>
#include <string>

#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/activation.hpp>

namespace zero::nn {

/// Which elementwise function an Activation applies.
enum class ActivationKind : unsigned char { relu, gelu, silu };

/// An elementwise activation layer.
template <class T>
class Activation : public Layer<T> {
 public:
  /// The activation kind.
  explicit Activation(ActivationKind kind) : kind_(kind) {}

  std::string describe() const override {
    switch (kind_) {
      case ActivationKind::relu:
        return "ReLU";
      case ActivationKind::gelu:
        return "GELU";
      case ActivationKind::silu:
        return "SiLU";
    }
    return "Activation";
  }
  void forward(StepContext<T>& ctx) override {
    expect<ShapeError>(ctx.x.data() != nullptr, describe(), ": no input activation");
    if (kind_ != ActivationKind::gelu) expect_host_kernels(ctx, describe());
    input_ = ctx.x;
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    const std::int64_t n = y.numel();
    switch (kind_) {
      case ActivationKind::relu:
        ops::cpu::relu_forward(y.data(), input_.data(), n);
        break;
      case ActivationKind::gelu:
        kernels_of(ctx).gelu_forward(y.data(), input_.data(), n);
        break;
      case ActivationKind::silu:
        ops::cpu::silu_forward(y.data(), input_.data(), n);
        break;
    }
    ctx.x = y;
  }
  void backward(StepContext<T>& ctx) override {
    const std::int64_t n = input_.numel();
    T* dx = ctx.dx.data();
    const T* dy = ctx.dy.data();
    switch (kind_) {
      case ActivationKind::relu:
        ops::cpu::relu_backward(dx, input_.data(), dy, n);
        break;
      case ActivationKind::gelu:
        kernels_of(ctx).gelu_backward(dx, input_.data(), dy, n, ctx.overwrite_dx);
        break;
      case ActivationKind::silu:
        ops::cpu::silu_backward(dx, input_.data(), dy, n);
        break;
    }
  }

  /// GELU may be computed by the layer before it (Layer::forward_activating: a Linear's GEMM).
  FusedActivation fusable_as() const override {
    return kind_ == ActivationKind::gelu ? FusedActivation::gelu : FusedActivation::none;
  }
  void adopt_forward(StepContext<T>& ctx, Tensor<T> input) override {
    expect<Error>(kind_ == ActivationKind::gelu, describe(),
                  ": only GELU is computed by the layer before it");
    expect<ShapeError>(input.shape() == ctx.x.shape(), describe(), ": input ", input.shape(),
                       " and output ", ctx.x.shape(), " differ");
    input_ = input;
  }
  Tensor<const T> fused_input() const override { return input_; }

  /// GELU writes its input gradient when asked (StepContext::overwrite_dx); ReLU and SiLU add.
  bool writes_input_grad() const override { return kind_ == ActivationKind::gelu; }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    return elementwise_flops(in.input.numel());
  }

  bool parks() const override { return true; }
  std::any park() override { return nn::park_members(input_); }
  void resume(std::any saved) override { nn::resume_members(saved, input_); }

 private:
  ActivationKind kind_;
  Tensor<T> input_;
};

/// max(x, 0).
template <class T>
struct ReLU final : Activation<T> {
  ReLU() : Activation<T>(ActivationKind::relu) {}
};
/// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
struct GELU final : Activation<T> {
  GELU() : Activation<T>(ActivationKind::gelu) {}
};
/// x * sigmoid(x).
template <class T>
struct SiLU final : Activation<T> {
  SiLU() : Activation<T>(ActivationKind::silu) {}
};

}  // namespace zero::nn
