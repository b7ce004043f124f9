#pragma once
// LayerNorm over the last dimension (eps 1e-5, biased variance, as PyTorch and GPT-2):
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
// Forward saves mean and rstd per row for the backward pass.

#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// Normalises N rows of C; writes out [N, C], mean [N], rstd [N].
template <class T>
void layer_norm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                        std::int64_t N, std::int64_t C, T eps = T(1e-5)) {
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    T m = T(0);
    for (std::int64_t c = 0; c < C; ++c) m += x[c];
    m /= static_cast<T>(C);
    T v = T(0);
    for (std::int64_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= static_cast<T>(C);
    const T s = T(1) / std::sqrt(v + eps);
    T* o = out + n * C;
    for (std::int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  });
}

/// Accumulates dinp, dweight, dbias from dout and the saved mean/rstd.
template <class T>
void layer_norm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                         const T* weight, const T* mean, const T* rstd, std::int64_t N,
                         std::int64_t C) {
  parallel_for(N, [&](std::int64_t n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    T dnorm_mean = T(0), dnorm_norm_mean = T(0);
    for (std::int64_t c = 0; c < C; ++c) {
      const T norm = (x[c] - mean[n]) * rstd[n];
      const T dnorm = weight[c] * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<T>(C);
    dnorm_norm_mean /= static_cast<T>(C);
    T* dx = dinp + n * C;
    for (std::int64_t c = 0; c < C; ++c) {
      const T norm = (x[c] - mean[n]) * rstd[n];
      const T dnorm = weight[c] * dy[c];
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n];
    }
  });
  // Parameter gradients reduce over rows; threads own channels so the row order is fixed.
  parallel_for(C, [&](std::int64_t c) {
    T dw = T(0), db = T(0);
    for (std::int64_t n = 0; n < N; ++n) {
      const T norm = (inp[n * C + c] - mean[n]) * rstd[n];
      dw += norm * dout[n * C + c];
      db += dout[n * C + c];
    }
    dweight[c] += dw;
    dbias[c] += db;
  });
}

}  // namespace zero::ops::cpu
