#pragma once
// Sequential: an ordered list of layers run as one engine unit. It concatenates the layers'
// parameters (binding order = layer order), hands each layer its slice of the bound views, runs
// forward in order and backward in reverse, and owns what the layers share:
//   - one arena mark per unit: forward takes it before the first layer, backward releases it
//     after the last, so saved activations stay LIFO across units as the engine requires;
//   - the gradient between layers: two buffers used in turn (a layer reads dy from one and
//     writes dx into the other), each zeroed and shaped like the layer's forward input, so a
//     layer only adds its input gradient. They are memory of the pass's kernels (host or
//     device), as are the copies and fills Sequential makes itself. The unit's last dx is left in
//     ctx.dx and ctx.dy for the unit below (the nn::Model contract, as GPT's units);
//   - optionally, activation checkpointing (set_checkpoint): only the unit's input and output
//     stay in the arena between forward and backward;
//   - parking (park/resume): what the last forward kept for backward, its own and each layer's,
//     moved out while other micro-batches run (pipeline stages), when every layer parks;
//   - fusions of neighbours (layer.hpp): a layer followed by an activation it can apply
//     (Linear, then GELU) runs both in one kernel call, and, given a skip path (a Residual's
//     branch), the last layer adds it as it writes (Linear). On the host the same kernels run
//     apart, so the bits are those of the layers unfused; a device set fuses them in its GEMMs.
//     Backward, where the kernel set fuses it (Kernels::fuses_gelu_backward, not the host's), a
//     layer after an activation (Linear after GELU) writes the activation's input gradient.

#include <algorithm>
#include <any>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <zero/nn/layers/layer.hpp>

namespace zero::nn {

/// One unit made of layers.
template <class T>
class Sequential {
 public:
  Sequential() = default;
  Sequential(Sequential&&) noexcept = default;
  Sequential& operator=(Sequential&&) noexcept = default;

  /// Appends a layer built from args; returns it (keep it to read a loss layer's logits).
  template <class L, class... Args>
  L& add(Args&&... args) {
    auto layer = std::make_unique<L>(std::forward<Args>(args)...);
    L& ref = *layer;
    add(std::move(layer));
    return ref;
  }
  /// Appends an already built layer.
  void add(std::unique_ptr<Layer<T>> layer) {
    expect<Error>(layer != nullptr, "Sequential::add: null layer");
    layers_.push_back(std::move(layer));
  }

  /// Number of layers.
  std::size_t size() const { return layers_.size(); }
  /// Layer i.
  Layer<T>& layer(std::size_t i) const { return *layers_.at(i); }

  /// Every layer's parameters, in layer order.
  std::vector<ParamSpec> params() const {
    std::vector<ParamSpec> all;
    for (const auto& l : layers_) {
      for (ParamSpec& p : l->params()) all.push_back(std::move(p));
    }
    return all;
  }
  /// Binds views (in params() order), each layer its own slice.
  void bind(std::span<const ParamView<T>> views) {
    // Counted now, not in add(): a Residual gains its layers after it was added.
    std::vector<std::size_t> counts;
    std::size_t total = 0;
    for (const auto& l : layers_) total += counts.emplace_back(l->params().size());
    expect<ShapeError>(views.size() == total, "Sequential::bind: got ", views.size(), " views for ",
                       total, " parameters");
    std::size_t offset = 0;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      layers_[i]->bind(views.subspan(offset, counts[i]));
      offset += counts[i];
    }
  }

  /// Activation checkpointing: between a training forward and its backward keep only the
  /// unit's input and output, and recompute the layers' forward just before the backward (the
  /// same results: dropout masks are redrawn from (site, ctx.step)). Trades one more forward
  /// for the unit's internal activations.
  void set_checkpoint(bool on) { checkpoint_ = on; }
  /// True when the unit recomputes its forward before its backward.
  bool checkpoint() const { return checkpoint_; }

  /// True when the last layer can add a skip path to its output (Layer::adds_skip).
  bool last_adds_skip() const { return !layers_.empty() && layers_.back()->adds_skip(); }

  /// Runs every layer forward: ctx.x in, ctx.x out. Given skip (only when last_adds_skip()),
  /// the last layer writes skip + its output (a residual's sum, Layer::forward_adding), in the
  /// recomputation before backward too.
  void forward(StepContext<T>& ctx, Tensor<const T> skip = {}) {
    expect<Error>(!layers_.empty(), "Sequential::forward: the unit has no layers");
    expect<Error>(skip.data() == nullptr || last_adds_skip(),
                  "Sequential::forward: the last layer (", layers_.back()->describe(),
                  ") cannot add a skip path to its output");
    mark_ = ctx.arena->mark();
    input_ = ctx.x;
    skip_ = skip;
    run_forward(ctx);
    recompute_ = checkpoint_ && ctx.training;
    if (recompute_) {
      // Move the output down to the unit's mark and drop everything above it. The released
      // bytes are still in place, and memmove handles the overlap.
      const Tensor<T> out = ctx.x;
      ctx.arena->release(mark_);
      Tensor<T> kept = ctx.arena->template allocate<T>(out.shape());
      kernels_of(ctx).copy(kept.data(), out.data(), out.numel());
      ctx.x = kept;
    }
  }

  /// MACs and FLOPs of the last forward (nn/flops.hpp), summed over the layers; empty before a
  /// forward ran or when some layer does not report its count.
  std::optional<FlopCount> forward_flops() const {
    if (input_shapes_.size() != layers_.size() || layers_.empty()) return std::nullopt;
    FlopCount sum;
    for (std::size_t k = 0; k < layers_.size(); ++k) {
      const std::optional<FlopCount> f =
          layers_[k]->forward_flops({input_shapes_[k], batch_, seq_len_});
      if (!f) return std::nullopt;
      sum += *f;
    }
    return sum;
  }

  /// Runs every layer backward in reverse: ctx.dy in, ctx.dx (and ctx.dy) out; releases the
  /// unit's activations. input_grad_start, when given, is where the gradient at the unit's
  /// input starts instead of zero (a residual's skip path): the first layer adds into it, so
  /// the sum is rounded once, as GPT's hand-written blocks do. input_grad_into, when given, is
  /// where the first layer writes that gradient (ctx.dx out is it) instead of this unit's own
  /// buffer, so a caller that wants it there needs no copy.
  void backward(StepContext<T>& ctx, Tensor<const T> input_grad_start = {},
                Tensor<T> input_grad_into = {}) {
    if (recompute_) {  // the internals were dropped after forward: rebuild them above the output
      const Tensor<T> dy = ctx.dy;
      // The forward added its layers' auxiliary losses (an MoE router's) already: the rerun's
      // are the same values, not a second share.
      const auto aux_loss = ctx.aux_loss;
      ctx.x = input_;
      run_forward(ctx);
      ctx.dy = dy;
      ctx.aux_loss = aux_loss;
      recompute_ = false;
    }
    Kernels<T>& kernels = kernels_of(ctx);
    const bool fuse = kernels.fuses_gelu_backward() && ctx.weight_grads == nullptr;
    int turn = 0;  // the gradient buffer this layer writes; the other holds its dy
    for (std::size_t k = layers_.size(); k-- > 0;) {
      // A layer after an activation that it takes its input gradient through (where the kernel
      // set fuses it): it writes the activation's input gradient, and the activation is done.
      FusedActivation through = FusedActivation::none;
      if (fuse && k > 0 && input_shapes_[k - 1].rank() > 0 && layers_[k - 1]->writes_input_grad() &&
          !(k == 1 && input_grad_start.data() != nullptr)) {
        const FusedActivation a = layers_[k - 1]->fusable_as();
        if (a != FusedActivation::none && layers_[k]->backward_applies(a)) through = a;
      }
      const std::size_t target = through != FusedActivation::none ? k - 1 : k;
      const Shape& shape = input_shapes_[target];
      if (shape.rank() == 0) {
        ctx.dx = {};
      } else {
        if (target == 0 && input_grad_into.data() != nullptr) {
          expect<ShapeError>(input_grad_into.numel() == shape.numel(),
                             "Sequential::backward: the input gradient's buffer has ",
                             input_grad_into.numel(), " elements, the unit's input ",
                             shape.numel());
          ctx.dx = input_grad_into.reshape(shape);
        } else {
          KernelMemory& buffer = gradients_[turn];
          const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * sizeof(T);
          if (buffer.size < bytes || buffer.device != kernels.device()) {
            buffer = kernels.allocate(bytes);
          }
          ctx.dx = buffer.view<T>(shape);
        }
        const profile::OpTimes::Scope zeroing(ctx.op_times, "Sequential");
        const bool starts = target == 0 && input_grad_start.data() != nullptr;
        ctx.overwrite_dx = !starts && layers_[target]->writes_input_grad();
        if (starts) {
          expect<ShapeError>(input_grad_start.numel() == ctx.dx.numel(),
                             "Sequential::backward: the input gradient start has ",
                             input_grad_start.numel(), " elements, the unit's input ",
                             ctx.dx.numel());
          // A layer that starts from it itself (a LayerNorm) reads it where it would read dx.
          if (target == k && layers_[k]->starts_input_grad() &&
              input_grad_start.data() != ctx.dx.data()) {
            ctx.dx_start = input_grad_start.data();
          } else {
            kernels.copy(ctx.dx.data(), input_grad_start.data(), ctx.dx.numel());
          }
        } else if (!ctx.overwrite_dx) {
          kernels.fill_zero(ctx.dx.data(), ctx.dx.numel());
        }
      }
      {
        const profile::OpTimes::Scope timed(ctx.op_times, kind_of(*layers_[k], ctx));
        if (through != FusedActivation::none) {
          layers_[k]->backward_activating(ctx, through, layers_[k - 1]->fused_input());
          k = target;  // the activation's backward ran with it
        } else {
          layers_[k]->backward(ctx);
        }
        ctx.overwrite_dx = false;
        ctx.dx_start = nullptr;
      }
      ctx.dy = ctx.dx;
      turn ^= 1;
    }
    ctx.arena->release(mark_);
  }

  /// True when every layer parks (Layer::parks): park() then holds all the forward kept.
  bool parks() const {
    return std::all_of(layers_.begin(), layers_.end(), [](const auto& l) { return l->parks(); });
  }
  /// Moves out what the last forward kept for backward (the unit's arena mark and input, and
  /// each layer's park()); another micro-batch's forward and backward may run before resume().
  std::any park() {
    expect<Error>(parks(), "Sequential::park: a layer does not implement Layer::park");
    Parked p{std::move(input_shapes_), batch_, seq_len_, mark_, input_, skip_, recompute_, {}};
    input_shapes_ = {};
    recompute_ = false;
    for (const auto& l : layers_) p.layers.push_back(l->park());
    return p;
  }
  /// Puts back what park() moved out, before that forward's backward.
  void resume(std::any saved) {
    auto* p = std::any_cast<Parked>(&saved);
    expect<Error>(p != nullptr && p->layers.size() == layers_.size(),
                  "Sequential::resume: the saved state is not this unit's");
    input_shapes_ = std::move(p->input_shapes);
    batch_ = p->batch;
    seq_len_ = p->seq_len;
    mark_ = p->mark;
    input_ = p->input;
    skip_ = p->skip;
    recompute_ = p->recompute;
    for (std::size_t k = 0; k < layers_.size(); ++k) layers_[k]->resume(std::move(p->layers[k]));
  }

 private:
  struct Parked {
    std::vector<Shape> input_shapes;
    std::int64_t batch, seq_len;
    BumpArena::Mark mark;
    Tensor<T> input;
    Tensor<const T> skip;
    bool recompute;
    std::vector<std::any> layers;
  };

  void run_forward(StepContext<T>& ctx) {
    input_shapes_.clear();
    batch_ = ctx.batch;
    seq_len_ = ctx.seq_len;
    for (std::size_t k = 0; k < layers_.size(); ++k) {
      Layer<T>& l = *layers_[k];
      // An empty shape marks a layer with no input (an input layer): it gets no dx.
      input_shapes_.push_back(ctx.x.data() != nullptr ? ctx.x.shape() : Shape{});
      const profile::OpTimes::Scope timed(ctx.op_times, kind_of(l, ctx));
      const FusedActivation next =
          k + 1 < layers_.size() ? layers_[k + 1]->fusable_as() : FusedActivation::none;
      if (skip_.data() != nullptr && k + 1 == layers_.size()) {
        l.forward_adding(ctx, skip_);
      } else if (next != FusedActivation::none && ctx.x.data() != nullptr && l.applies(next)) {
        // This layer computes the activation after it too; that layer takes the result.
        const Tensor<T> pre = l.forward_activating(ctx, next);
        input_shapes_.push_back(pre.shape());
        layers_[++k]->adopt_forward(ctx, pre);
      } else {
        l.forward(ctx);
      }
    }
  }

  // The layer's kind for the op timer, only when one is set (describe() builds a string).
  static std::string kind_of(const Layer<T>& layer, const StepContext<T>& ctx) {
    if (ctx.op_times == nullptr) return {};
    return std::string(profile::OpTimes::kind_of(layer.describe()));
  }

  std::vector<std::unique_ptr<Layer<T>>> layers_;
  std::vector<Shape> input_shapes_;
  std::int64_t batch_ = 0, seq_len_ = 0;  // of the last forward, for forward_flops
  KernelMemory gradients_[2];
  BumpArena::Mark mark_ = 0;
  Tensor<T> input_;
  Tensor<const T> skip_;  // what the last forward added to the last layer's output (none: empty)
  bool checkpoint_ = false, recompute_ = false;
};

}  // namespace zero::nn
