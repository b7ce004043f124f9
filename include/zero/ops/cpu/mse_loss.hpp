#pragma once
// Mean squared error over n elements: loss = mean_i (pred_i - target_i)^2, and its gradient
// dpred_i = 2 (pred_i - target_i) / n * dloss. The sum runs in a fixed order in the compute type
// (float for half-type predictions), so the loss is the same bits for any thread count.

#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// The mean of (pred - target)^2 over n elements (0 for n = 0).
template <class T>
compute_type_t<T> mse_forward(const T* pred, const compute_type_t<T>* target, std::int64_t n) {
  using A = compute_type_t<T>;
  A sum = A(0);
  for (std::int64_t i = 0; i < n; ++i) {
    const A d = load(pred[i]) - target[i];
    sum += d * d;
  }
  return n > 0 ? sum / static_cast<A>(n) : A(0);
}

/// dpred[i] += 2 (pred[i] - target[i]) / n * dloss.
template <class T>
void mse_backward(T* dpred, const T* pred, const compute_type_t<T>* target, std::int64_t n,
                  compute_type_t<T> dloss = compute_type_t<T>(1)) {
  using A = compute_type_t<T>;
  const A scale = n > 0 ? A(2) * dloss / static_cast<A>(n) : A(0);
  parallel_for(n, [&](std::int64_t i) {
    dpred[i] = store<T>(load(dpred[i]) + (load(pred[i]) - target[i]) * scale);
  });
}

}  // namespace zero::ops::cpu
