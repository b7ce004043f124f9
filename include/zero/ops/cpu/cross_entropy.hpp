#pragma once
// Fused softmax cross-entropy over the vocabulary, mean over the tokens whose target is not
// ignore_index (-100 in PyTorch; GPT training uses -1 for padding here by default).
//   loss = mean_n [ logsumexp(logits_n) - logits_n[target_n] ]
//   dlogits_n = (softmax(logits_n) - onehot(target_n)) * dloss / valid     (0 for ignored rows)
// Logits may be stored in a half type; the softmax, logsumexp, per-token losses and their mean
// are computed in float (compute_type_t), and only dlogits is rounded to the storage type.
// float, bf16 and f16 run the dispatched kernels (isa_dispatch.hpp), vectorised along the
// vocabulary: a row's max and sum of exponentials fold 16 partials (lane_reduction.hpp) and the
// exponentials are vmath::exp, so every ISA and thread count gives the same bits; the backward
// recomputes the exponentials instead of keeping a row of them (and may write over the logits).
// The forward can leave each row's max and sum of exponentials (row_stats, two numbers per row);
// a backward given them skips the two passes that would recompute them (the same values, so the
// same bits) and reads the row once. double keeps the plain loops. Rows may lie ld >= V elements
// apart (a logits buffer whose rows are padded for the GEMM that wrote it): the columns [V, ld)
// are never read, and the backward writes zeros there, so the padded dlogits rows feed the next
// GEMM's reduction with exact zeros.

#include <cmath>
#include <cstdint>
#include <limits>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/ops/cpu/vector_math.hpp>

namespace zero::ops::cpu {

/// Target value marking a token that does not count towards the loss.
inline constexpr std::int32_t ignore_index = -1;

namespace detail {

/// The row stride of a call: ld, or V when ld is 0; ShapeError when below V.
inline std::int64_t logits_row_stride(std::int64_t V, std::int64_t ld, const char* op) {
  if (ld == 0) return V;
  expect<ShapeError>(ld >= V, op, ": rows ", ld, " elements apart cannot hold ", V, " logits");
  return ld;
}

/// The row max of x[0, V) and the sum of e^(x - max) over the row.
template <class O, class T>
inline void softmax_max_sum(const T* x, std::int64_t V, float& maxval, float& sum) {
  maxval = reduce_row<O>(
      V, -std::numeric_limits<float>::infinity(),
      [&](auto ops, const auto& acc, std::int64_t v) {
        using P = decltype(ops);
        return P::max(load_lanes<P>(x + v), acc);
      },
      [](float a, float b) { return optim::ScalarHostOps::max(a, b); });
  const float m = maxval;
  sum = reduce_row<O>(
      V, 0.0f,
      [&](auto ops, const auto& acc, std::int64_t v) {
        using P = decltype(ops);
        return P::add(acc, vmath::exp<P>(P::sub(load_lanes<P>(x + v), P::set1(m))));
      },
      [](float a, float b) { return a + b; });
}

struct CrossEntropyForward {
  template <class O, class T>
  static void run(float* losses, float* row_stats, const T* logits, const std::int32_t* targets,
                  std::int64_t V, std::int64_t ld, std::int64_t n0, std::int64_t n1) {
    for (std::int64_t n = n0; n < n1; ++n) {
      if (targets[n] == ignore_index) {
        losses[n] = 0.0f;
        continue;
      }
      const T* x = logits + n * ld;
      float maxval, sum;
      softmax_max_sum<O>(x, V, maxval, sum);
      if (row_stats != nullptr) {
        row_stats[2 * n] = maxval;
        row_stats[2 * n + 1] = sum;
      }
      losses[n] = std::log(sum) + maxval - load(x[targets[n]]);
    }
  }
};

struct CrossEntropyBackward {
  template <class O, class T>
  static void run(T* dlogits, const T* logits, const float* row_stats, const std::int32_t* targets,
                  std::int64_t V, std::int64_t ld, float scale, std::int64_t n0, std::int64_t n1) {
    using S = optim::ScalarHostOps;
    for (std::int64_t n = n0; n < n1; ++n) {
      T* d = dlogits + n * ld;
      for (std::int64_t v = V; v < ld; ++v) store_lanes<S>(d + v, 0.0f);  // the row's padding
      std::int64_t v = 0;
      if (targets[n] == ignore_index) {
        for (; v + O::width <= V; v += O::width) store_lanes<O>(d + v, O::set1(0.0f));
        for (; v < V; ++v) store_lanes<S>(d + v, 0.0f);
        continue;
      }
      const T* x = logits + n * ld;
      const float target_logit = load(x[targets[n]]);  // read first: dlogits may be logits
      float maxval, sum;
      if (row_stats != nullptr) {
        maxval = row_stats[2 * n];
        sum = row_stats[2 * n + 1];
      } else {
        softmax_max_sum<O>(x, V, maxval, sum);
      }
      const float factor = 1.0f / sum * scale;
      const auto write = [&](auto ops, std::int64_t i) {
        using P = decltype(ops);
        const auto e = vmath::exp<P>(P::sub(load_lanes<P>(x + i), P::set1(maxval)));
        store_lanes<P>(d + i, P::mul(e, P::set1(factor)));
      };
      for (; v + O::width <= V; v += O::width) write(O{}, v);
      for (; v < V; ++v) write(S{}, v);
      // The target's entry again, minus the one-hot (every lane computes e the same way, so
      // the product is the value the row pass wrote), rounded to T once. The product enters the
      // subtraction through fma(product, 1, -scale): a plain product fed into a subtraction is
      // contracted into one FMA in the vector instantiations (target "fma") but rounded twice
      // in the scalar one, which changed the last bit in about one row in a hundred.
      const float e = vmath::exp<S>(S::sub(target_logit, maxval));
      store_lanes<S>(d + targets[n], S::fma(S::mul(e, factor), 1.0f, -scale));
    }
  }
};

}  // namespace detail

/// Throws the ShapeError for target, at position, outside the vocabulary [0, V) (the host's
/// count_valid_targets and its CUDA twin both refuse with it).
[[noreturn]] inline void throw_target_outside_vocabulary(std::int32_t target, std::int64_t position,
                                                         std::int64_t V) {
  raise<ShapeError>("cross_entropy: target ", target, " at position ", position,
                    " is outside the vocabulary [0, ", V, ")");
}

/// Number of targets that count (not ignore_index); throws ShapeError for a target outside
/// [0, V) that is not ignore_index.
inline std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                        std::int64_t V) {
  std::int64_t valid = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    if (targets[n] < 0 || targets[n] >= V) throw_target_outside_vocabulary(targets[n], n, V);
    ++valid;
  }
  return valid;
}

/// The mean of per-token losses [N] over valid tokens (0 if none), summed in order.
template <class A>
A cross_entropy_mean(const A* losses, std::int64_t N, std::int64_t valid) {
  A total = A(0);
  for (std::int64_t n = 0; n < N; ++n) total += losses[n];  // fixed order: deterministic
  return valid > 0 ? total / static_cast<A>(valid) : A(0);
}

/// Per-token losses [N] (0 for ignored tokens); returns the mean over valid tokens (0 if none).
/// Losses and the mean are in the compute type (float for half-type logits). With row_stats
/// ([N, 2]), each counted row's max and sum of e^(logit - max) go there for the backward (ignored
/// rows' entries are left as they were). Row n starts at logits + n * ld (0: ld = V).
template <class T>
compute_type_t<T> cross_entropy_forward(compute_type_t<T>* losses, const T* logits,
                                        const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                        compute_type_t<T>* row_stats = nullptr,
                                        std::int64_t ld = 0) {
  using A = compute_type_t<T>;
  ld = detail::logits_row_stride(V, ld, "cross_entropy_forward");
  const std::int64_t valid = count_valid_targets(targets, N, V);
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<detail::CrossEntropyForward, float*, float*, const T*, const std::int32_t*,
                   std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(N, rows_per_task(V), N * V, [&](std::int64_t n0, std::int64_t n1) {
      kernel(losses, row_stats, logits, targets, V, ld, n0, n1);
    });
  } else {
    parallel_for(N, [&](std::int64_t n) {
      if (targets[n] == ignore_index) {
        losses[n] = A(0);
        return;
      }
      const T* x = logits + n * ld;
      A maxval = load(x[0]);
      for (std::int64_t v = 1; v < V; ++v) maxval = load(x[v]) > maxval ? load(x[v]) : maxval;
      A sum = A(0);
      for (std::int64_t v = 0; v < V; ++v) sum += std::exp(load(x[v]) - maxval);
      if (row_stats != nullptr) {
        row_stats[2 * n] = maxval;
        row_stats[2 * n + 1] = sum;
      }
      losses[n] = std::log(sum) + maxval - load(x[targets[n]]);
    });
  }
  return cross_entropy_mean(losses, N, valid);
}

/// Writes (not accumulates) dlogits [N, V] for the mean loss scaled by dloss; dlogits may be
/// logits (in place). valid is the number of tokens the mean is over: by default those of
/// targets, else the whole batch's when these N rows are one chunk of it. row_stats, when
/// given, is what cross_entropy_forward left for these logits (the result is the same bits, in
/// one pass over each row instead of three). Rows lie ld apart in both (0: ld = V); the columns
/// [V, ld) of dlogits become zeros.
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                            std::int64_t N, std::int64_t V,
                            compute_type_t<T> dloss = compute_type_t<T>(1), std::int64_t valid = -1,
                            const compute_type_t<T>* row_stats = nullptr, std::int64_t ld = 0) {
  using A = compute_type_t<T>;
  ld = detail::logits_row_stride(V, ld, "cross_entropy_backward");
  const std::int64_t in_rows = count_valid_targets(targets, N, V);
  if (valid < 0) valid = in_rows;
  const A scale = valid > 0 ? dloss / static_cast<A>(valid) : A(0);
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<detail::CrossEntropyBackward, T*, const T*, const float*, const std::int32_t*,
                   std::int64_t, std::int64_t, float, std::int64_t, std::int64_t>();
    parallel_chunks(N, rows_per_task(V), N * V, [&](std::int64_t n0, std::int64_t n1) {
      kernel(dlogits, logits, row_stats, targets, V, ld, scale, n0, n1);
    });
    return;
  }
  parallel_for(N, [&](std::int64_t n) {
    T* d = dlogits + n * ld;
    for (std::int64_t v = V; v < ld; ++v) d[v] = store<T>(A(0));
    if (targets[n] == ignore_index) {
      for (std::int64_t v = 0; v < V; ++v) d[v] = store<T>(A(0));
      return;
    }
    const T* x = logits + n * ld;
    A maxval = load(x[0]);
    if (row_stats != nullptr) {
      maxval = row_stats[2 * n];
    } else {
      for (std::int64_t v = 1; v < V; ++v) maxval = load(x[v]) > maxval ? load(x[v]) : maxval;
    }
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
