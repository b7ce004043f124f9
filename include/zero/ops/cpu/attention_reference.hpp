#pragma once
// The reference (loop) form of attention.hpp's kernels: the same contract, computed entry by
// entry in the obvious order, without BLAS. Tests hold the GEMM form to it.
//
// Causal multi-head self-attention on a packed qkv tensor [B, T, 3C] (q, k, v each [B, T, C],
// head h in channels [h*hs, (h+1)*hs)), as GPT-2 lays it out after c_attn:
//   preatt[t, t2] = q_t . k_t2 / sqrt(hs)  (t2 <= t),  att = softmax(preatt),
//   out_t = sum_t2 dropout(att)[t, t2] v_t2                    (GPT-2's attn_pdrop)
// Forward saves att [B, NH, T, T] (before dropout) for the backward pass. The dropout mask is
// not stored: keep(b, h, t, t2) is redrawn from the counter-based mask at the entry's index in
// att, which costs one Philox draw per entry against the hs-long products each entry needs
// anyway, and saves a B*NH*T*T mask per layer (as large as att itself) between the passes.
// Each (b, h) pair is independent, so the loops split over pairs and results do not depend on
// the thread count. Half types: products, softmax and sums in float; att, out and dqkv rounded
// once (dqkv accumulates a whole head in float before its single rounding).

#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// attention_forward in loops: writes out [B, T, C] and att [B, NH, T, T] (entries above the
/// diagonal are zero); dropout (off by default) applies to the probabilities multiplying v, not to
/// the saved att.
template <class T>
void attention_forward_reference(T* out, T* att, const T* qkv, std::int64_t B, std::int64_t Tn,
                                 std::int64_t C, std::int64_t NH, const DropoutMask& dropout = {}) {
  using A = compute_type_t<T>;
  const std::int64_t hs = C / NH;
  const A scale = A(1) / std::sqrt(static_cast<A>(hs));
  const A drop_scale = dropout.active() ? dropout.scale<A>() : A(1);
  parallel_for(B * NH, [&](std::int64_t bh) {
    const std::int64_t b = bh / NH, h = bh % NH;
    for (std::int64_t t = 0; t < Tn; ++t) {
      const T* q = qkv + (b * Tn + t) * 3 * C + h * hs;
      const std::int64_t row = ((b * NH + h) * Tn + t) * Tn;
      const DropoutMask row_mask = dropout.from(row);  // a row never crosses a block
      T* a = att + row;
      const ComputeBuffer<T> pre(a, Tn);  // pre-softmax scores, then exponentials
      A maxval = -INFINITY;
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* k = qkv + (b * Tn + t2) * 3 * C + C + h * hs;
        A dot = A(0);
        for (std::int64_t i = 0; i < hs; ++i) dot += load(q[i]) * load(k[i]);
        pre[t2] = dot * scale;
        maxval = pre[t2] > maxval ? pre[t2] : maxval;
      }
      A sum = A(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        pre[t2] = std::exp(pre[t2] - maxval);
        sum += pre[t2];
      }
      const A inv = A(1) / sum;
      for (std::int64_t t2 = 0; t2 < Tn; ++t2) a[t2] = store<T>(t2 <= t ? pre[t2] * inv : A(0));
      T* o = out + (b * Tn + t) * C + h * hs;
      const ComputeBuffer<T> acc(o, hs);
      for (std::int64_t i = 0; i < hs; ++i) acc[i] = A(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        A p = load(a[t2]);  // the stored probability: backward sees exactly the same value
        if (dropout.active()) p = row_mask.keep(t2) ? p * drop_scale : A(0);
        for (std::int64_t i = 0; i < hs; ++i) acc[i] += p * load(v[i]);
      }
      acc.scatter();
    }
  });
}

/// attention_backward in loops: accumulates dqkv [B, T, 3C] from dout [B, T, C], the saved att and
/// the forward input qkv; dropout must be the forward's mask.
template <class T>
void attention_backward_reference(T* dqkv, const T* dout, const T* qkv, const T* att,
                                  std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                                  const DropoutMask& dropout = {}) {
  using A = compute_type_t<T>;
  const std::int64_t hs = C / NH;
  const A scale = A(1) / std::sqrt(static_cast<A>(hs));
  const A drop_scale = dropout.active() ? dropout.scale<A>() : A(1);
  parallel_for(B * NH, [&](std::int64_t bh) {
    const std::int64_t b = bh / NH, h = bh % NH;
    // The head's gradients: dqkv itself for f32/f64; for half types a float copy [T][q k v][hs]
    // that collects every contribution and is rounded into dqkv once at the end.
    A* grad = nullptr;
    std::int64_t row_stride = 3 * C, k_offset = C, v_offset = 2 * C;
    std::unique_ptr<A[]> head;
    auto head_elem = [&](std::int64_t t, std::int64_t part, std::int64_t i) -> T& {
      return dqkv[(b * Tn + t) * 3 * C + part * C + h * hs + i];
    };
    if constexpr (std::is_same_v<A, T>) {
      grad = dqkv + b * Tn * 3 * C + h * hs;
    } else {
      row_stride = 3 * hs, k_offset = hs, v_offset = 2 * hs;
      head = std::make_unique_for_overwrite<A[]>(static_cast<std::size_t>(Tn * 3 * hs));
      grad = head.get();
      for (std::int64_t t = 0; t < Tn; ++t) {
        for (std::int64_t part = 0; part < 3; ++part) {
          for (std::int64_t i = 0; i < hs; ++i) {
            grad[t * row_stride + part * hs + i] = load(head_elem(t, part, i));
          }
        }
      }
    }
    for (std::int64_t t = 0; t < Tn; ++t) {
      const std::int64_t row = ((b * NH + h) * Tn + t) * Tn;
      const DropoutMask row_mask = dropout.from(row);  // a row never crosses a block
      const T* a = att + row;
      const T* dy = dout + (b * Tn + t) * C + h * hs;
      const T* q = qkv + (b * Tn + t) * 3 * C + h * hs;
      A* dq = grad + t * row_stride;
      // datt[t2] = dy . v_t2; dv_t2 += dropout(att)[t2] * dy; the probability's gradient dp is
      // datt through the dropout mask.
      A datt_dot_att = A(0);
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        A* dv = grad + t2 * row_stride + v_offset;
        const A p = load(a[t2]);
        const bool kept = !dropout.active() || row_mask.keep(t2);
        const A p_used = !dropout.active() ? p : (kept ? p * drop_scale : A(0));
        A d = A(0);
        for (std::int64_t i = 0; i < hs; ++i) {
          d += load(dy[i]) * load(v[i]);
          dv[i] += p_used * load(dy[i]);
        }
        const A dp = !dropout.active() ? d : (kept ? d * drop_scale : A(0));
        datt_dot_att += dp * p;
      }
      // softmax backward: dpre[t2] = att[t2] * (dp[t2] - sum_j att[j] dp[j]); then
      // dq += dpre * k * scale, dk_t2 += dpre * q * scale. datt is recomputed to avoid a buffer.
      for (std::int64_t t2 = 0; t2 <= t; ++t2) {
        const T* v = qkv + (b * Tn + t2) * 3 * C + 2 * C + h * hs;
        const T* k = qkv + (b * Tn + t2) * 3 * C + C + h * hs;
        A* dk = grad + t2 * row_stride + k_offset;
        A d = A(0);
        for (std::int64_t i = 0; i < hs; ++i) d += load(dy[i]) * load(v[i]);
        const bool kept = !dropout.active() || row_mask.keep(t2);
        const A dp = !dropout.active() ? d : (kept ? d * drop_scale : A(0));
        const A dpre = load(a[t2]) * (dp - datt_dot_att) * scale;
        for (std::int64_t i = 0; i < hs; ++i) {
          dq[i] += dpre * load(k[i]);
          dk[i] += dpre * load(q[i]);
        }
      }
    }
    if constexpr (!std::is_same_v<A, T>) {
      for (std::int64_t t = 0; t < Tn; ++t) {
        for (std::int64_t part = 0; part < 3; ++part) {
          for (std::int64_t i = 0; i < hs; ++i) {
            head_elem(t, part, i) = store<T>(grad[t * row_stride + part * hs + i]);
          }
        }
      }
    }
  });
}

}  // namespace zero::ops::cpu
