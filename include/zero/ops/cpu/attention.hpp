#pragma once
// Causal multi-head self-attention on a packed qkv tensor [B, T, 3C] (q, k, v each [B, T, C],
// head h in channels [h*hs, (h+1)*hs)), as GPT-2 lays it out after c_attn:
//   preatt[t, t2] = q_t . k_t2 / sqrt(hs)  (t2 <= t),  att = softmax(preatt),  out_t = sum att v
// Forward saves att [B, NH, T, T] for the backward pass. Each (b, h) pair is independent, so the
// loops split over pairs and results do not depend on the thread count.

#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// Writes out [B, T, C] and att [B, NH, T, T] (entries above the diagonal are zero).
template <class T>
void attention_forward(T* out, T* att, const T* qkv, std::int64_t B, std::int64_t Tn,
                       std::int64_t C, std::int64_t NH) {
  const std::int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  parallel_for(B * NH, [&](std::int64_t bh) {
    const std::int64_t b = bh / NH, h = bh % NH;
    for (std::int64_t t = 0; t < Tn; ++t) {
      const T* q = qkv + (b * Tn + t) * 3 * C + h * hs;
      T* a = att + ((b * NH + h) * Tn + t) * Tn;
      T maxval = -INFINITY;
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* k = qkv + (b * Tn + t2) * 3 * C + C + h * hs;
        T dot = T(0);
        for (std::int64_t i = 0; i < hs; ++i) dot += q[i] * k[i];
        a[t2] = dot * scale;
        maxval = a[t2] > maxval ? a[t2] : maxval;
      }
      T sum = T(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        a[t2] = std::exp(a[t2] - maxval);
        sum += a[t2];
      }
      const T inv = T(1) / sum;
      for (std::int64_t t2 = 0; t2 < Tn; ++t2) a[t2] = t2 <= t ? a[t2] * inv : T(0);
      T* o = out + (b * Tn + t) * C + h * hs;
      for (std::int64_t i = 0; i < hs; ++i) o[i] = T(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        for (std::int64_t i = 0; i < hs; ++i) o[i] += a[t2] * v[i];
      }
    }
  });
}

/// Accumulates dqkv [B, T, 3C] from dout [B, T, C], the saved att and the forward input qkv.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, std::int64_t B,
                        std::int64_t Tn, std::int64_t C, std::int64_t NH) {
  const std::int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  parallel_for(B * NH, [&](std::int64_t bh) {
    const std::int64_t b = bh / NH, h = bh % NH;
    for (std::int64_t t = 0; t < Tn; ++t) {
      const T* a = att + ((b * NH + h) * Tn + t) * Tn;
      const T* dy = dout + (b * Tn + t) * C + h * hs;
      const T* q = qkv + (b * Tn + t) * 3 * C + h * hs;
      T* dq = dqkv + (b * Tn + t) * 3 * C + h * hs;
      // datt[t2] = dy . v_t2; dv_t2 += att[t2] * dy
      T datt_dot_att = T(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        T* dv = dqkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        T d = T(0);
        for (std::int64_t i = 0; i < hs; ++i) {
          d += dy[i] * v[i];
          dv[i] += a[t2] * dy[i];
        }
        datt_dot_att += d * a[t2];
      }
      // softmax backward: dpre[t2] = att[t2] * (datt[t2] - sum_j att[j] datt[j]); then
      // dq += dpre * k * scale, dk_t2 += dpre * q * scale. datt is recomputed to avoid a buffer.
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        const T* k = qkv + (b * Tn + t2) * 3 * C + C + h * hs;
        T* dk = dqkv + (b * Tn + t2) * 3 * C + C + h * hs;
        T d = T(0);
        for (std::int64_t i = 0; i < hs; ++i) d += dy[i] * v[i];
        const T dpre = a[t2] * (d - datt_dot_att) * scale;
        for (std::int64_t i = 0; i < hs; ++i) {
          dq[i] += dpre * k[i];
          dk[i] += dpre * q[i];
        }
      }
    }
  });
}

}  // namespace zero::ops::cpu
