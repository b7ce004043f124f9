#pragma once
// RMSNorm over the last dimension (Llama's): out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) +
// eps). Forward saves rstd per row in the compute type; backward:
//   dx = rstd * (w*dy - x * rstd^2 * mean_c(w*dy*x)),   dweight += sum_n x * rstd * dy.
// Rows run in parallel and the weight gradient is reduced per channel in row order, so results
// do not depend on the thread count.

#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// Normalises N rows of C; writes out [N, C] and rstd [N].
template <class T>
void rms_norm_forward(T* out, compute_type_t<T>* rstd, const T* inp, const T* weight,
                      std::int64_t N, std::int64_t C,
                      compute_type_t<T> eps = compute_type_t<T>(1e-5)) {
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
