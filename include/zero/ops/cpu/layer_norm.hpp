#pragma once
// LayerNorm over the last dimension (eps 1e-5, biased variance, as PyTorch and GPT-2):
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
// Forward saves mean and rstd per row for the backward pass, in the compute type (float for
// bf16/f16 storage: the statistics are never rounded to 16 bits).
// float, bf16 and f16 run the dispatched kernels (isa_dispatch.hpp): the row sums (mean,
// variance, the backward's two means) fold 16 partials (lane_reduction.hpp), the weight and bias
// gradients fold each column over the rows in order, so every ISA and thread count gives the same
// bits. double keeps the plain loops (the reference).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

/// Columns per task of a column reduction (a multiple of column_group).
inline constexpr std::int64_t columns_per_chunk = 64;

struct LayerNormForward {
  template <class O, class T>
  static void run(T* out, float* mean, float* rstd, const T* inp, const T* weight, const T* bias,
                  std::int64_t C, float eps, std::int64_t n0, std::int64_t n1) {
    using S = optim::ScalarHostOps;
    for (std::int64_t n = n0; n < n1; ++n) {
      const T* x = inp + n * C;
      const auto add = [](float a, float b) { return a + b; };
      const float m = reduce_row<O>(
                          C, 0.0f,
                          [&](auto ops, const auto& acc, std::int64_t c) {
                            using P = decltype(ops);
                            return P::add(acc, load_lanes<P>(x + c));
                          },
                          add) /
                      static_cast<float>(C);
      const float v = reduce_row<O>(
                          C, 0.0f,
                          [&](auto ops, const auto& acc, std::int64_t c) {
                            using P = decltype(ops);
                            const auto d = P::sub(load_lanes<P>(x + c), P::set1(m));
                            return P::fma(d, d, acc);
                          },
                          add) /
                      static_cast<float>(C);
      const float s = 1.0f / std::sqrt(v + eps);
      T* o = out + n * C;
      const auto normalise = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        const auto norm = P::mul(P::sub(load_lanes<P>(x + c), P::set1(m)), P::set1(s));
        store_lanes<P>(o + c, P::fma(norm, load_lanes<P>(weight + c), load_lanes<P>(bias + c)));
      };
      std::int64_t c = 0;
      for (; c + O::width <= C; c += O::width) normalise(O{}, c);
      for (; c < C; ++c) normalise(S{}, c);
      mean[n] = m;
      rstd[n] = s;
    }
  }
};

struct LayerNormBackwardRows {
  template <class O, class T>
  static void run(T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,
                  const float* rstd, bool overwrite, std::int64_t C, std::int64_t n0,
                  std::int64_t n1) {
    using S = optim::ScalarHostOps;
    for (std::int64_t n = n0; n < n1; ++n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      const float m = mean[n], s = rstd[n];
      const auto add = [](float a, float b) { return a + b; };
      // dnorm = weight * dout, norm = (x - mean) * rstd, for the ops-width columns at c. dnorm
      // enters sums only through fma: a plain product fed into an add or subtract could be
      // contracted on one path and not another (isa_dispatch.hpp).
      const auto dnorm_at = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        return P::mul(load_lanes<P>(weight + c), load_lanes<P>(dy + c));
      };
      const auto norm_at = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        return P::mul(P::sub(load_lanes<P>(x + c), P::set1(m)), P::set1(s));
      };
      const float dnorm_mean =
          reduce_row<O>(
              C, 0.0f,
              [&](auto ops, const auto& acc, std::int64_t c) {
                using P = decltype(ops);
                return P::fma(load_lanes<P>(weight + c), load_lanes<P>(dy + c), acc);
              },
              add) /
          static_cast<float>(C);
      const float dnorm_norm_mean =
          reduce_row<O>(
              C, 0.0f,
              [&](auto ops, const auto& acc, std::int64_t c) {
                return decltype(ops)::fma(dnorm_at(ops, c), norm_at(ops, c), acc);
              },
              add) /
          static_cast<float>(C);
      T* dx = dinp + n * C;
      const auto update = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        // dnorm - dnorm_mean with dnorm rounded first (exactly 0 for C = 1, where rstd is
        // large), as fma(dnorm, 1, -mean): an add no compiler contracts with dnorm's product.
        const auto centred = P::fma(dnorm_at(ops, c), P::set1(1.0f), P::set1(-dnorm_mean));
        const auto t = P::fnma(norm_at(ops, c), P::set1(dnorm_norm_mean), centred);
        const auto start = overwrite ? P::set1(0.0f) : load_lanes<P>(dx + c);
        store_lanes<P>(dx + c, P::fma(t, P::set1(s), start));
      };
      std::int64_t c = 0;
      for (; c + O::width <= C; c += O::width) update(O{}, c);
      for (; c < C; ++c) update(S{}, c);
    }
  }
};

struct LayerNormBackwardColumns {
  template <class O, class T>
  static void run(T* dweight, T* dbias, const T* dout, const T* inp, const float* mean,
                  const float* rstd, std::int64_t N, std::int64_t C, std::int64_t c0,
                  std::int64_t c1) {
    reduce_columns<O, 2>(
        c0, c1, N,
        [](auto ops, std::int64_t) {
          using P = decltype(ops);
          return std::array<typename P::V, 2>{P::set1(0.0f), P::set1(0.0f)};
        },
        [&](auto ops, auto& acc, std::int64_t n, std::int64_t c) {
          using P = decltype(ops);
          const auto dy = load_lanes<P>(dout + n * C + c);
          const auto norm =
              P::mul(P::sub(load_lanes<P>(inp + n * C + c), P::set1(mean[n])), P::set1(rstd[n]));
          acc[0] = P::fma(norm, dy, acc[0]);
          acc[1] = P::add(acc[1], dy);
        },
        [&](auto ops, const auto& acc, std::int64_t c) {
          using P = decltype(ops);
          store_lanes<P>(dweight + c, P::add(load_lanes<P>(dweight + c), acc[0]));
          store_lanes<P>(dbias + c, P::add(load_lanes<P>(dbias + c), acc[1]));
        });
  }
};

}  // namespace detail

/// Normalises N rows of C; writes out [N, C], mean [N], rstd [N].
template <class T>
void layer_norm_forward(T* out, compute_type_t<T>* mean, compute_type_t<T>* rstd, const T* inp,
                        const T* weight, const T* bias, std::int64_t N, std::int64_t C,
                        compute_type_t<T> eps = compute_type_t<T>(1e-5)) {
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::LayerNormForward, T*, float*, float*, const T*, const T*,
                                   const T*, std::int64_t, float, std::int64_t, std::int64_t>();
    parallel_chunks(N, rows_per_task(C), N * C, [&](std::int64_t n0, std::int64_t n1) {
      kernel(out, mean, rstd, inp, weight, bias, C, eps, n0, n1);
    });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    A m = A(0);
    for (std::int64_t c = 0; c < C; ++c) m += load(x[c]);
    m /= static_cast<A>(C);
    A v = A(0);
    for (std::int64_t c = 0; c < C; ++c) v += (load(x[c]) - m) * (load(x[c]) - m);
    v /= static_cast<A>(C);
    const A s = A(1) / std::sqrt(v + eps);
    T* o = out + n * C;
    for (std::int64_t c = 0; c < C; ++c) {
      o[c] = store<T>((load(x[c]) - m) * s * load(weight[c]) + load(bias[c]));
    }
    mean[n] = m;
    rstd[n] = s;
  });
}

/// Accumulates dinp, dweight, dbias from dout and the saved mean/rstd; overwrite_dinp writes
/// dinp instead (the values of accumulating into zeros).
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const compute_type_t<T>* mean,
                         const compute_type_t<T>* rstd, std::int64_t N, std::int64_t C,
                         bool overwrite_dinp = false) {
  if constexpr (dispatched_type<T>) {
    const auto rows =
        kernel_for<detail::LayerNormBackwardRows, T*, const T*, const T*, const T*, const float*,
                   const float*, bool, std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(N, rows_per_task(C), N * C, [&](std::int64_t n0, std::int64_t n1) {
      rows(dinp, dout, inp, weight, mean, rstd, overwrite_dinp, C, n0, n1);
    });
    const auto columns =
        kernel_for<detail::LayerNormBackwardColumns, T*, T*, const T*, const T*, const float*,
                   const float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(C, detail::columns_per_chunk, N * C, [&](std::int64_t c0, std::int64_t c1) {
      columns(dweight, dbias, dout, inp, mean, rstd, N, C, c0, c1);
    });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    A dnorm_mean = A(0), dnorm_norm_mean = A(0);
    for (std::int64_t c = 0; c < C; ++c) {
      const A norm = (load(x[c]) - mean[n]) * rstd[n];
      const A dnorm = load(weight[c]) * load(dy[c]);
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<A>(C);
    dnorm_norm_mean /= static_cast<A>(C);
    T* dx = dinp + n * C;
    for (std::int64_t c = 0; c < C; ++c) {
      const A norm = (load(x[c]) - mean[n]) * rstd[n];
      const A dnorm = load(weight[c]) * load(dy[c]);
      dx[c] = store<T>((overwrite_dinp ? A(0) : load(dx[c])) +
                       (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n]);
    }
  });
  // Parameter gradients reduce over rows; threads own channels so the row order is fixed.
  parallel_for(C, [&](std::int64_t c) {
    A dw = A(0), db = A(0);
    for (std::int64_t n = 0; n < N; ++n) {
      const A norm = (load(inp[n * C + c]) - mean[n]) * rstd[n];
      dw += norm * load(dout[n * C + c]);
      db += load(dout[n * C + c]);
    }
    dweight[c] = store<T>(load(dweight[c]) + dw);
    dbias[c] = store<T>(load(dbias[c]) + db);
  });
}

}  // namespace zero::ops::cpu
