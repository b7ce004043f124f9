#pragma once
// Layer<T>: the building block of a unit. A layer declares its parameters, binds views of them,
// and runs forward and backward on the StepContext of the micro-step:
//   forward:  reads ctx.x (rows of features; an input layer reads ctx.inputs instead), writes
//             ctx.x, and keeps in ctx.arena (or as views of its input) what backward needs;
//   backward: reads ctx.dy (the gradient at its output), adds the gradient at its input into
//             ctx.dx (zeroed by the caller, shaped like the forward's input; empty when the
//             layer had no input) and accumulates into its parameters' gradient views.
// nn::Sequential runs an ordered list of layers as one engine unit and owns the arena marks and
// the gradient buffers, so a layer only computes. Layers are virtual: a unit is a run-time list,
// and one call per layer per micro-step costs nothing beside the kernels.
// A pipeline stage keeps several micro-batches in flight: park() moves out what the last forward
// kept for backward (the members it set there), resume() puts it back before that backward.
// park_members / resume_members do both for a list of members. A layer that does not override
// parks() is recomputed instead, so a user's layer stays correct without them.
// Fusions Sequential makes between neighbours, each the same bits on the host as the layers run
// apart: a layer that adds_skip() writes a Residual's sum itself (forward_adding), and a layer
// that can apply the parameter-free activation after it (applies(), forward_activating) runs it
// for that layer, which takes the result (adopt_forward); where the kernel set fuses it
// (Kernels::fuses_gelu_backward), a layer after an activation takes its input gradient through
// that activation too (backward_applies(), backward_activating), reading the activation's input
// (fused_input), and the activation's backward is skipped.

#include <any>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <optional>
#include <zero/core/error.hpp>

#include <zero/nn/context.hpp>
#include <zero/nn/flops.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/param.hpp>

namespace zero::nn {

/// A parameter-free elementwise activation a layer can apply to the output it writes on behalf of
/// the activation layer after it (Layer::forward_activating).
enum class FusedActivation : unsigned char { none, gelu };

/// One building block of a unit (see the file comment for the forward/backward contract).
template <class T>
class Layer {
 public:
  Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  virtual ~Layer() = default;

  /// What the layer is, for messages ("Linear 'mlp.fc1'").
  virtual std::string describe() const = 0;
  /// Parameters in binding order (none for activations and losses).
  virtual std::vector<ParamSpec> params() const { return {}; }
  /// Binds views in params() order (value and gradient).
  virtual void bind(std::span<const ParamView<T>> views) { (void)views; }
  /// ctx.x in, ctx.x out; saves what backward needs.
  virtual void forward(StepContext<T>& ctx) = 0;
  /// True when forward_adding can write skip + f(x) itself (a Residual's last layer: the skip
  /// path added as the output is written, with no pass of its own and no second buffer).
  virtual bool adds_skip() const { return false; }
  /// forward, with ctx.x out = skip + f(x) (skip shaped like the output; ShapeError otherwise);
  /// only for a layer that adds_skip(). backward is unchanged: dy reaches f(x) as it is.
  virtual void forward_adding(StepContext<T>& ctx, Tensor<const T> skip) {
    (void)ctx;
    (void)skip;
    raise<Error>(describe(), ": forward_adding called on a layer that does not add a skip path");
  }
  /// What this layer is when the layer before may compute it (an activation layer: GELU);
  /// none by default.
  virtual FusedActivation fusable_as() const { return FusedActivation::none; }
  /// True when forward_activating can apply a to the output it writes.
  virtual bool applies(FusedActivation a) const {
    (void)a;
    return false;
  }
  /// forward, then a: ctx.x out = a(f(x)); returns f(x), the activation layer's input (in the
  /// arena before ctx.x). Only for a layer that applies(a).
  virtual Tensor<T> forward_activating(StepContext<T>& ctx, FusedActivation a) {
    (void)ctx;
    (void)a;
    raise<Error>(describe(), ": forward_activating called on a layer that applies no activation");
  }
  /// Takes the forward the layer before ran for this one (forward_activating): input is what its
  /// forward would have read, ctx.x already its output. Only for a layer fusable_as() something.
  virtual void adopt_forward(StepContext<T>& ctx, Tensor<T> input) {
    (void)ctx;
    (void)input;
    raise<Error>(describe(), ": adopt_forward called on a layer that is not fusable");
  }
  /// What an activation layer saved as its input (fusable_as() something): the layer after it
  /// reads it to take its backward through the activation (backward_activating).
  virtual Tensor<const T> fused_input() const {
    raise<Error>(describe(), ": fused_input called on a layer that is not fusable");
  }
  /// True when backward_activating can take the input gradient through activation a before it.
  virtual bool backward_applies(FusedActivation a) const {
    (void)a;
    return false;
  }
  /// backward, with ctx.dx the gradient at the input of the activation a before this layer
  /// (activation_input, what it saved): a'(activation_input) times this layer's input gradient,
  /// written, not added; the activation layer's backward is then not run. Only for a layer that
  /// backward_applies(a).
  virtual void backward_activating(StepContext<T>& ctx, FusedActivation a,
                                   Tensor<const T> activation_input) {
    (void)ctx;
    (void)a;
    (void)activation_input;
    raise<Error>(describe(), ": backward_activating called on a layer that applies no activation");
  }
  /// ctx.dy in; adds into ctx.dx (writes it when ctx.overwrite_dx) and the parameter gradients.
  virtual void backward(StepContext<T>& ctx) = 0;
  /// True when backward honours StepContext::overwrite_dx (writes ctx.dx instead of adding
  /// into it), so Sequential does not zero the buffer first. The values are those of adding
  /// into zeros.
  virtual bool writes_input_grad() const { return false; }
  /// True when backward honours StepContext::dx_start (writes ctx.dx = dx_start + its input
  /// gradient), so a Sequential whose input gradient starts from a residual's skip gradient does
  /// not copy it into ctx.dx first. The values are those of adding into the copy.
  virtual bool starts_input_grad() const { return false; }
  /// MACs and FLOPs of a forward that saw in (nn/flops.hpp conventions); empty when the layer
  /// does not know its count, and the flops profiler then shows its unit as n/a.
  virtual std::optional<FlopCount> forward_flops(const FlopInput& in) const {
    (void)in;
    return std::nullopt;
  }
  /// True when park() and resume() hold everything forward keeps for backward.
  virtual bool parks() const { return false; }
  /// Moves out what the last forward kept for backward (empty when it keeps nothing).
  virtual std::any park() { return {}; }
  /// Puts back what park() moved out, before that forward's backward.
  virtual void resume(std::any saved) { (void)saved; }
};

/// A layer's park(): moves members into one std::any (each left value-initialised).
template <class... M>
std::any park_members(M&... members) {
  return std::tuple<M...>(std::exchange(members, M{})...);
}
/// A layer's resume(): moves back what park_members(members...) moved out.
template <class... M>
void resume_members(std::any& saved, M&... members) {
  auto* kept = std::any_cast<std::tuple<M...>>(&saved);
  expect<Error>(kept != nullptr, "Layer::resume: the saved state is not this layer's");
  std::tie(members...) = std::move(*kept);
}

/// ShapeError naming layer when there is no input activation x (a layer first in unit 0).
template <class T>
void expect_input_activation(const Tensor<T>& x, const std::string& layer) {
  expect<ShapeError>(
      x.data() != nullptr, layer,
      ": no input activation (put an input layer such as FromInput or TokenEmbedding "
      "first in unit 0)");
}

/// A loss layer's refusal of a training forward without its labels (has_labels false): InputError
/// naming layer and the input. Its backward could not seed a gradient, and the micro-step would
/// count toward the accumulation window with nothing in it; an evaluation (ctx.training false)
/// passes the predictions on without them.
template <class T>
void expect_labels_when_training(const StepContext<T>& ctx, bool has_labels,
                                 const std::string& layer, const std::string& name) {
  expect<InputError>(!ctx.training || has_labels, layer,
                     ": a training forward needs the labels, and the micro-batch has no input '",
                     name,
                     "' (evaluate, or a forward with training off, gives the predictions "
                     "without them)");
}

/// A size a layer is built with (channels, vocabulary, classes): ShapeError naming layer and
/// what unless it is positive (a 0 would make empty parameters and divide by zero in a mean).
inline void expect_positive_size(const std::string& layer, const char* what, std::int64_t size) {
  expect<ShapeError>(size > 0, layer, ": ", what, " = ", size, "; expected > 0");
}

/// Rows of x when its last dimension must be features: throws ShapeError naming layer otherwise.
template <class T>
std::int64_t rows_of(const Tensor<T>& x, std::int64_t features, const std::string& layer) {
  expect_input_activation(x, layer);
  expect<ShapeError>(x.rank() >= 1 && x.dim(-1) == features, layer,
                     ": the input's last dimension is ", x.rank() >= 1 ? x.dim(-1) : 0,
                     ", expected ", features, " features");
  return x.numel() / features;
}

}  // namespace zero::nn
