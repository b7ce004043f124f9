#pragma once
// LayerNorm over the last dimension (eps 1e-5, biased variance, as PyTorch and GPT-2):
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
// Forward saves mean and rstd per row for the backward pass, in the compute type (float for
// bf16/f16 storage: the statistics are never rounded to 16 bits).

#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// Normalises N rows of C; writes out [N, C], mean [N], rstd [N].
template <class T>
void layer_norm_forward(T* out, compute_type_t<T>* mean, compute_type_t<T>* rstd, const T* inp,
                        const T* weight, const T* bias, std::int64_t N, std::int64_t C,
                        compute_type_t<T> eps = compute_type_t<T>(1e-5)) {
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

/// Accumulates dinp, dweight, dbias from dout and the saved mean/rstd.
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const compute_type_t<T>* mean,
                         const compute_type_t<T>* rstd, std::int64_t N, std::int64_t C) {
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
      dx[c] = store<T>(load(dx[c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n]);
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
