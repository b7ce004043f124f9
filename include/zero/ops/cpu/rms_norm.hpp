#pragma once
// RMSNorm over the last dimension (Llama's): out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) +
// eps). Forward saves rstd per row in the compute type; backward:
//   dx = rstd * (w*dy - x * rstd^2 * mean_c(w*dy*x)),   dweight += sum_n x * rstd * dy.
// Rows run in parallel and the weight gradient is reduced per channel in row order, so results
// do not depend on the thread count. float, bf16 and f16 run the dispatched kernels
// (isa_dispatch.hpp): row sums fold 16 partials (lane_reduction.hpp), the weight gradient's
// columns are vector lanes, so every ISA gives the same bits; double keeps the plain loops.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

struct RmsNormForward {
  template <class O, class T>
  static void run(T* out, float* rstd, const T* inp, const T* weight, std::int64_t C, float eps,
                  std::int64_t n0, std::int64_t n1) {
    for (std::int64_t n = n0; n < n1; ++n) {
      const T* x = inp + n * C;
      const float ss = reduce_row<O>(
          C, 0.0f,
          [&](auto ops, const auto& acc, std::int64_t c) {
            using P = decltype(ops);
            const auto xc = load_lanes<P>(x + c);
            return P::fma(xc, xc, acc);
          },
          [](float a, float b) { return a + b; });
      const float s = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
      T* o = out + n * C;
      const auto write = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        store_lanes<P>(o + c,
                       P::mul(P::mul(load_lanes<P>(x + c), P::set1(s)), load_lanes<P>(weight + c)));
      };
      std::int64_t c = 0;
      for (; c + O::width <= C; c += O::width) write(O{}, c);
      for (; c < C; ++c) write(optim::ScalarHostOps{}, c);
      rstd[n] = s;
    }
  }
};

struct RmsNormBackwardRows {
  template <class O, class T>
  static void run(T* dinp, const T* dout, const T* inp, const T* weight, const float* rstd,
                  std::int64_t C, std::int64_t n0, std::int64_t n1) {
    for (std::int64_t n = n0; n < n1; ++n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      const auto wdy_at = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        return P::mul(load_lanes<P>(weight + c), load_lanes<P>(dy + c));
      };
      const float dot = reduce_row<O>(
          C, 0.0f,
          [&](auto ops, const auto& acc, std::int64_t c) {
            using P = decltype(ops);
            return P::fma(wdy_at(ops, c), load_lanes<P>(x + c), acc);
          },
          [](float a, float b) { return a + b; });
      const float s = rstd[n];
      const float k = s * s * dot / static_cast<float>(C);
      T* dx = dinp + n * C;
      const auto update = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        const auto t = P::fnma(load_lanes<P>(x + c), P::set1(k), wdy_at(ops, c));
        store_lanes<P>(dx + c, P::fma(P::set1(s), t, load_lanes<P>(dx + c)));
      };
      std::int64_t c = 0;
      for (; c + O::width <= C; c += O::width) update(O{}, c);
      for (; c < C; ++c) update(optim::ScalarHostOps{}, c);
    }
  }
};

struct RmsNormBackwardColumns {
  template <class O, class T>
  static void run(T* dweight, const T* dout, const T* inp, const float* rstd, std::int64_t N,
                  std::int64_t C, std::int64_t c0, std::int64_t c1) {
    reduce_columns<O, 1>(
        c0, c1, N,
        [](auto ops, std::int64_t) {
          using P = decltype(ops);
          return std::array<typename P::V, 1>{P::set1(0.0f)};
        },
        [&](auto ops, auto& acc, std::int64_t n, std::int64_t c) {
          using P = decltype(ops);
          const auto xs = P::mul(load_lanes<P>(inp + n * C + c), P::set1(rstd[n]));
          acc[0] = P::fma(xs, load_lanes<P>(dout + n * C + c), acc[0]);
        },
        [&](auto ops, const auto& acc, std::int64_t c) {
          using P = decltype(ops);
          store_lanes<P>(dweight + c, P::add(load_lanes<P>(dweight + c), acc[0]));
        });
  }
};

}  // namespace detail

/// Normalises N rows of C; writes out [N, C] and rstd [N].
template <class T>
void rms_norm_forward(T* out, compute_type_t<T>* rstd, const T* inp, const T* weight,
                      std::int64_t N, std::int64_t C,
                      compute_type_t<T> eps = compute_type_t<T>(1e-5)) {
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::RmsNormForward, T*, float*, const T*, const T*,
                                   std::int64_t, float, std::int64_t, std::int64_t>();
    const std::int64_t rows = rows_per_task(C);
    parallel_chunks(N, rows, N * C, [&](std::int64_t n0, std::int64_t n1) {
      kernel(out, rstd, inp, weight, C, eps, n0, n1);
    });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    A ss = A(0);
    for (std::int64_t c = 0; c < C; ++c) ss += load(x[c]) * load(x[c]);
    const A s = A(1) / std::sqrt(ss / static_cast<A>(C) + eps);
    T* o = out + n * C;
    for (std::int64_t c = 0; c < C; ++c) o[c] = store<T>(load(x[c]) * s * load(weight[c]));
    rstd[n] = s;
  });
}

/// Accumulates dinp and dweight from dout and the saved rstd.
template <class T>
void rms_norm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                       const compute_type_t<T>* rstd, std::int64_t N, std::int64_t C) {
  if constexpr (dispatched_type<T>) {
    const auto rows_kernel =
        kernel_for<detail::RmsNormBackwardRows, T*, const T*, const T*, const T*, const float*,
                   std::int64_t, std::int64_t, std::int64_t>();
    const std::int64_t rows = rows_per_task(C);
    parallel_chunks(N, rows, N * C, [&](std::int64_t n0, std::int64_t n1) {
      rows_kernel(dinp, dout, inp, weight, rstd, C, n0, n1);
    });
    const auto columns =
        kernel_for<detail::RmsNormBackwardColumns, T*, const T*, const T*, const float*,
                   std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(C, 64, N * C, [&](std::int64_t c0, std::int64_t c1) {
      columns(dweight, dout, inp, rstd, N, C, c0, c1);
    });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    A dot = A(0);
    for (std::int64_t c = 0; c < C; ++c) dot += load(weight[c]) * load(dy[c]) * load(x[c]);
    const A s = rstd[n];
    const A k = s * s * dot / static_cast<A>(C);
    T* dx = dinp + n * C;
    for (std::int64_t c = 0; c < C; ++c) {
      dx[c] = store<T>(load(dx[c]) + s * (load(weight[c]) * load(dy[c]) - load(x[c]) * k));
    }
  });
  parallel_for(C, [&](std::int64_t c) {
    A dw = A(0);
    for (std::int64_t n = 0; n < N; ++n)
      dw += load(inp[n * C + c]) * rstd[n] * load(dout[n * C + c]);
    dweight[c] = store<T>(load(dweight[c]) + dw);
  });
}

}  // namespace zero::ops::cpu
