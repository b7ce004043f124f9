#pragma once
// WindowGradSum: the gradient contributions of parameters that every tensor-parallel rank holds
// whole but computes from its own rows (under sequence parallelism: a LayerNorm's weight and
// bias, a row-parallel layer's bias), summed over the accumulation window and then over the
// group, once. Megatron does the same in finalize_model_grads, once per step.
//
// Each backward add()s its contribution (in the compute type). The unit's last backward of the
// window (nn::StepContext::window_end, set by the engine) all-reduces the window's sums over the
// group, and the layer adds them into its real gradients (add_to); the backwards before it add
// nothing there. Outside an engine window_end is always true: every backward is reduced and added
// at once. A backward of another window (StepContext::window: the engine moves it on at every
// window's end, a failed one included) starts the sums over, so a window that failed part-way
// leaves nothing behind.

#include <cstddef>
#include <cstdint>
#include <span>

#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/dtype.hpp>
#include <zero/nn/context.hpp>

namespace zero::parallel {

/// A window's gradient contributions of n replicated values, summed over a tensor-parallel group.
template <class T>
class WindowGradSum {
 public:
  using C = compute_type_t<T>;

  /// Holds n values (what it holds is dropped when n changes).
  void resize(std::size_t n) {
    if (sums_.size() == n) return;
    sums_ = Buffer<C>(n);
    open_ = false;
  }
  /// Values it holds.
  std::size_t size() const { return sums_.size(); }

  /// Adds this backward's contribution g (size() values).
  void add(const nn::StepContext<T>& ctx, std::span<const T> g) {
    expect<ShapeError>(g.size() == sums_.size(), "WindowGradSum: ", g.size(), " contributions for ",
                       sums_.size(), " values");
    if (!open_ || ctx.window != window_) {
      for (C& s : sums_.view()) s = C(0);
      open_ = true;
      window_ = ctx.window;
    }
    C* s = sums_.data();
    for (std::size_t i = 0; i < g.size(); ++i) s[i] += convert<C>(g[i]);
  }
  /// At the window's last backward (ctx.window_end): all-reduces the window's sums over tp (one
  /// collective) and returns true; the caller then adds them into its gradients (add_to), and
  /// the next add() starts over. False before it: nothing is due yet.
  bool reduce(const nn::StepContext<T>& ctx, const TensorParallel& tp) {
    if (!ctx.window_end) return false;
    expect<Error>(open_, "WindowGradSum: the window's last backward added nothing");
    if (tp.active()) tp.comm().all_reduce(std::span<C>(sums_.data(), sums_.size()), ReduceOp::sum);
    open_ = false;
    return true;
  }
  /// grad[i] += the reduced sum of value offset + i, for i < n (after reduce() returned true).
  void add_to(T* grad, std::size_t offset, std::size_t n) const {
    const C* s = sums_.data() + offset;
    for (std::size_t i = 0; i < n; ++i) grad[i] = convert<T>(convert<C>(grad[i]) + s[i]);
  }

 private:
  Buffer<C> sums_;
  bool open_ = false;         // sums_ holds contributions of window_
  std::uint64_t window_ = 0;  // the engine's window they belong to
};

}  // namespace zero::parallel
