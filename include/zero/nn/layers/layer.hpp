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
  /// ctx.dy in; adds into ctx.dx (writes it when ctx.overwrite_dx) and the parameter gradients.
  virtual void backward(StepContext<T>& ctx) = 0;
  /// True when backward honours StepContext::overwrite_dx (writes ctx.dx instead of adding
  /// into it), so Sequential does not zero the buffer first. The values are those of adding
  /// into zeros.
  virtual bool writes_input_grad() const { return false; }
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

/// Rows of x when its last dimension must be features: throws ShapeError naming layer otherwise.
template <class T>
std::int64_t rows_of(const Tensor<T>& x, std::int64_t features, const std::string& layer) {
  expect<ShapeError>(
      x.data() != nullptr, layer,
      ": no input activation (put an input layer such as FromInput or TokenEmbedding "
      "first in unit 0)");
  expect<ShapeError>(x.rank() >= 1 && x.dim(-1) == features, layer,
                     ": the input's last dimension is ", x.rank() >= 1 ? x.dim(-1) : 0,
                     ", expected ", features, " features");
  return x.numel() / features;
}

}  // namespace zero::nn
