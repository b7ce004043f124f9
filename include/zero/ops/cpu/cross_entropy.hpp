#pragma once
// Fused softmax cross-entropy over the vocabulary, mean over the tokens whose target is not
// ignore_index (-100 in PyTorch; GPT training uses -1 for padding here by default).
//   loss = mean_n [ logsumexp(logits_n) - logits_n[target_n] ]
//   dlogits_n = (softmax(logits_n) - onehot(target_n)) * dloss / valid     (0 for ignored rows)
// Logits may be stored in a half type; the softmax, logsumexp, per-token losses and their mean
// are computed in float (compute_type_t), and only dlogits is rounded to the storage type.

#include <cmath>
#include <cstdint>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// Target value marking a token that does not count towards the loss.
inline constexpr std::int32_t ignore_index = -1;

/// Number of targets that count (not ignore_index); throws ShapeError for a target outside
/// [0, V) that is not ignore_index.
inline std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                        std::int64_t V) {
  std::int64_t valid = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    expect<ShapeError>(targets[n] >= 0 && targets[n] < V, "cross_entropy: target ", targets[n],
                       " at position ", n, " is outside the vocabulary [0, ", V, ")");
    ++valid;
  }
  return valid;
}

/// Per-token losses [N] (0 for ignored tokens); returns the mean over valid tokens (0 if none).
/// Losses and the mean are in the compute type (float for half-type logits).
template <class T>
compute_type_t<T> cross_entropy_forward(compute_type_t<T>* losses, const T* logits,
                                        const std::int32_t* targets, std::int64_t N,
                                        std::int64_t V) {
  using A = compute_type_t<T>;
  const std::int64_t valid = count_valid_targets(targets, N, V);
  parallel_for(N, [&](std::int64_t n) {
    if (targets[n] == ignore_index) {
      losses[n] = A(0);
      return;
    }
    const T* x = logits + n * V;
    A maxval = load(x[0]);
    for (std::int64_t v = 1; v < V; ++v) maxval = load(x[v]) > maxval ? load(x[v]) : maxval;
    A sum = A(0);
    for (std::int64_t v = 0; v < V; ++v) sum += std::exp(load(x[v]) - maxval);
    losses[n] = std::log(sum) + maxval - load(x[targets[n]]);
  });
  A total = A(0);
  for (std::int64_t n = 0; n < N; ++n) total += losses[n];  // fixed order: deterministic
  return valid > 0 ? total / static_cast<A>(valid) : A(0);
}

/// Writes (not accumulates) dlogits [N, V] for the mean loss scaled by dloss.
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V,
                            compute_type_t<T> dloss = compute_type_t<T>(1)) {
  using A = compute_type_t<T>;
  const std::int64_t valid = count_valid_targets(targets, N, V);
  const A scale = valid > 0 ? dloss / static_cast<A>(valid) : A(0);
  parallel_for(N, [&](std::int64_t n) {
    T* d = dlogits + n * V;
    if (targets[n] == ignore_index) {
      for (std::int64_t v = 0; v < V; ++v) d[v] = store<T>(A(0));
      return;
    }
    const T* x = logits + n * V;
    A maxval = load(x[0]);
    for (std::int64_t v = 1; v < V; ++v) maxval = load(x[v]) > maxval ? load(x[v]) : maxval;
    // The row's exponentials: in dlogits itself for f32/f64, in a float row for half types.
    const ComputeBuffer<T> e(d, V);
    A sum = A(0);
    for (std::int64_t v = 0; v < V; ++v) {
      e[v] = std::exp(load(x[v]) - maxval);
      sum += e[v];
    }
    const A inv = A(1) / sum;
    for (std::int64_t v = 0; v < V; ++v) e[v] = e[v] * inv * scale;
    e[targets[n]] -= scale;
    e.scatter();
  });
}

}  // namespace zero::ops::cpu
