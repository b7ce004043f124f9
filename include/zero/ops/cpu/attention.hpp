#pragma once
// Causal multi-head self-attention on a packed qkv tensor [B, T, 3C] (q, k, v each [B, T, C],
// head h in channels [h*hs, (h+1)*hs)), as GPT-2 lays it out after c_attn:
//   preatt[t, t2] = q_t . k_t2 / sqrt(hs)  (t2 <= t),  att = softmax(preatt),
//   out_t = sum_t2 dropout(att)[t, t2] v_t2                    (GPT-2's attn_pdrop)
// Forward saves att [B, NH, T, T] (before dropout; zero above the diagonal) for the backward
// pass. The dropout mask is not stored: keep(b, h, t, t2) is redrawn from the counter-based mask
// at the entry's index in att, and saves a B*NH*T*T mask per layer between the passes.
//
// Each (batch, head) pair is a handful of GEMMs on the calling thread (gemm_serial) over blocks
// of attention_block query rows, each block against the keys up to its last row (the causal
// mask skips the rest): scores Q K^T, the row softmax, then P V; backward dV += P^T dY,
// dP = dY V^T, the softmax backward dS = P (dP - rowsum(P dP)) / sqrt(hs), dQ += dS K and
// dK += dS^T Q. The pairs split over the threads and nothing inside depends on the thread count,
// so results are bit-identical for any number of threads. attention_reference.hpp computes the
// same in loops (the tests compare the two).
// Half types: the head's q, k, v are widened to float, products, softmax and sums are float; att
// and out are rounded once, and P V uses the rounded att (the backward sees the same values);
// dqkv accumulates a whole head in float before its single rounding.
// The row softmax and its backward run as dispatched kernels for float, bf16 and f16
// (isa_dispatch.hpp): a row's max, sum of exponentials and rowsum(P dP) fold 16 partials
// (lane_reduction.hpp) and the exponentials are vmath::exp on every lane and tail, so scalar, AVX2
// and AVX-512 give the same bits. double keeps the plain loops with std::exp (the reference).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/gemm.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/ops/cpu/vector_math.hpp>

namespace zero::ops::cpu {

/// Query rows per block of the attention GEMMs: each block multiplies only the keys up to its
/// last row, so the causal mask saves about half the score FLOPs at long sequences.
inline constexpr std::int64_t attention_block = 64;

namespace detail {

// One head's operands in the compute type: q, k, v as [T, hs] matrices with a row stride (the
// packed qkv itself for f32/f64, a widened copy for half types).
template <class A>
struct HeadOperands {
  const A* q;
  const A* k;
  const A* v;
  std::int64_t ld;
};

// The head (b, h) of qkv as compute-type matrices: views into qkv when T is its own compute
// type, else a float copy [T][q k v][hs] written to dst (Tn * 3 * hs elements).
template <class T>
HeadOperands<compute_type_t<T>> head_operands(const T* qkv, std::int64_t b, std::int64_t h,
                                              std::int64_t Tn, std::int64_t C, std::int64_t hs,
                                              compute_type_t<T>* dst) {
  using A = compute_type_t<T>;
  const T* base = qkv + b * Tn * 3 * C + h * hs;
  if constexpr (std::is_same_v<A, T>) {
    return {base, base + C, base + 2 * C, 3 * C};
  } else {
    for (std::int64_t t = 0; t < Tn; ++t) {
      for (std::int64_t part = 0; part < 3; ++part) {
        const T* src = base + t * 3 * C + part * C;
        for (std::int64_t i = 0; i < hs; ++i) dst[(t * 3 + part) * hs + i] = load(src[i]);
      }
    }
    return {dst, dst + hs, dst + 2 * hs, 3 * hs};
  }
}

// p[0, n) = dropout(p) in place, for the entries row + [0, n) of att: a dropped entry is
// multiplied by 0 (DropoutMask::factor), so a NaN stays NaN, as in dropout.hpp.
template <class A>
void apply_dropout(A* p, std::int64_t n, std::int64_t row, const DropoutMask& dropout) {
  const A scale = dropout.scale<A>();
  const DropoutMask row_mask = dropout.from(row);  // a row never crosses a block
  for (std::int64_t t2 = 0; t2 < n; ++t2) {
    p[t2] = p[t2] * DropoutMask::factor(row_mask.keep(t2), scale);
  }
}

// The row softmax of one block of query rows t0 + r (r < rows) against keys [0, t0 + rows), for
// float compute: row r of scores (row stride lds) holds the scaled scores q_t . k_t2 / sqrt(hs)
// and row r of att (row stride Tn) is row t0 + r of the head's att. Writes att (rounded to T,
// zero above the diagonal) and leaves in scores the probabilities P V multiplies: the stored
// ones, dropped and scaled where dropout is active (mask_index is the index in att of the
// block's first entry). scores may be att itself (f32 without dropout).
struct AttentionSoftmax {
  template <class O, class T>
  static void run(float* scores, std::int64_t lds, T* att, std::int64_t Tn, std::int64_t t0,
                  std::int64_t rows, const DropoutMask* dropout, std::int64_t mask_index) {
    const std::int64_t keys = t0 + rows;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = t0 + r + 1;  // the causal row: keys up to the diagonal
      float* p = scores + r * lds;
      T* a = att + r * Tn;
      const float sum = exponentiate_row<O>(p, n, row_max<O>(p, n));
      write_probabilities<O>(a, p, n, 1.0f / sum, *dropout, mask_index + r * Tn);
      std::fill(a + n, a + Tn, store<T>(0.0f));
      std::fill(p + n, p + keys, 0.0f);
    }
  }

  // The largest of x[0, n).
  template <class O>
  static float row_max(const float* x, std::int64_t n) {
    return reduce_row<O>(
        n, -std::numeric_limits<float>::infinity(),
        [&](auto ops, const auto& acc, std::int64_t i) {
          using P = decltype(ops);
          return P::max(P::load(x + i), acc);
        },
        [](float a, float b) { return optim::ScalarHostOps::max(a, b); });
  }

  // x[i] = e^(x[i] - maxval) over [0, n); returns their sum. The step stores each exponential
  // as it folds it in (reduce_row visits every element once), so the row is read once. The add
  // takes exp's last product (by 2^n, exact: e^-87 is a normal float), so a compiler that
  // contracts the two into an fma changes no bit on any path.
  template <class O>
  static float exponentiate_row(float* x, std::int64_t n, float maxval) {
    return reduce_row<O>(
        n, 0.0f,
        [&](auto ops, const auto& acc, std::int64_t i) {
          using P = decltype(ops);
          const auto e = vmath::exp<P>(P::sub(P::load(x + i), P::set1(maxval)));
          P::store(x + i, e);
          return P::add(acc, e);
        },
        [](float a, float b) { return a + b; });
  }

  // a[i] = e[i] * inv rounded to T; e[i] becomes that stored value (the one backward reads),
  // dropped or scaled by the mask drawn at index + i when dropout is active.
  template <class O, class T>
  static void write_probabilities(T* a, float* e, std::int64_t n, float inv,
                                  const DropoutMask& dropout, std::int64_t index) {
    const float keep_scale = dropout.scale<float>();
    std::uint32_t words[O::width];
    const auto at = [&](auto ops, std::int64_t i) {
      using P = decltype(ops);
      store_lanes<P>(a + i, P::mul(P::load(e + i), P::set1(inv)));
      const auto stored = load_lanes<P>(a + i);
      if (dropout.active()) {
        dropout_mask_words(words, dropout, index + i, P::width);
        P::store(e + i, P::mul(stored, P::select(words, P::set1(keep_scale), P::set1(0.0f))));
      } else {
        P::store(e + i, stored);
      }
    };
    std::int64_t i = 0;
    for (; i + O::width <= n; i += O::width) at(O{}, i);
    for (; i < n; ++i) at(optim::ScalarHostOps{}, i);
  }
};

// The softmax backward of one block of query rows t0 + r (r < rows), for float compute: row r of
// dp (row stride t0 + rows, the block's keys) holds dY V^T and becomes
// dS = att (dP - sum_j att_j dP_j) * scale, with dP = dp through the dropout mask drawn at
// mask_index + r Tn + t2 (as the forward's) and att row r of att (row stride Tn), zero above the
// diagonal.
struct AttentionSoftmaxBackward {
  template <class O, class T>
  static void run(float* dp, const T* att, std::int64_t Tn, std::int64_t t0, std::int64_t rows,
                  float scale, const DropoutMask* dropout, std::int64_t mask_index) {
    using S = optim::ScalarHostOps;
    const std::int64_t keys = t0 + rows;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = t0 + r + 1;
      float* d = dp + r * keys;
      const T* a = att + r * Tn;
      const float dot = masked_dot<O>(d, a, n, *dropout, mask_index + r * Tn);
      const auto at = [&](auto ops, std::int64_t i) {
        using P = decltype(ops);
        const auto centred = P::sub(P::load(d + i), P::set1(dot));
        P::store(d + i, P::mul(P::mul(load_lanes<P>(a + i), centred), P::set1(scale)));
      };
      std::int64_t i = 0;
      for (; i + O::width <= n; i += O::width) at(O{}, i);
      for (; i < n; ++i) at(S{}, i);
      std::fill(d + n, d + keys, 0.0f);
    }
  }

  // sum_i d[i] a[i] over [0, n), after d[i] goes through the dropout mask drawn at index + i
  // (stored back: the gradient then uses the masked value). The products enter the sum through
  // an explicit fma, leaving a compiler no product and add to contract on one path only.
  template <class O, class T>
  static float masked_dot(float* d, const T* a, std::int64_t n, const DropoutMask& dropout,
                          std::int64_t index) {
    const float keep_scale = dropout.scale<float>();
    std::uint32_t words[O::width];
    return reduce_row<O>(
        n, 0.0f,
        [&](auto ops, const auto& acc, std::int64_t i) {
          using P = decltype(ops);
          auto g = P::load(d + i);
          if (dropout.active()) {
            dropout_mask_words(words, dropout, index + i, P::width);
            g = P::mul(g, P::select(words, P::set1(keep_scale), P::set1(0.0f)));
            P::store(d + i, g);
          }
          return P::fma(g, load_lanes<P>(a + i), acc);
        },
        [](float a, float b) { return a + b; });
  }
};

// AttentionSoftmax for any compute type, in plain loops with std::exp: the f64 path.
template <class T>
void attention_softmax_loops(compute_type_t<T>* scores, std::int64_t lds, T* att, std::int64_t Tn,
                             std::int64_t t0, std::int64_t rows, const DropoutMask* dropout,
                             std::int64_t mask_index) {
  using A = compute_type_t<T>;
  const std::int64_t keys = t0 + rows;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = t0 + r;
    A* pre = scores + r * lds;
    A maxval = -INFINITY;
    for (std::int64_t t2 = 0; t2 <= t; ++t2) maxval = pre[t2] > maxval ? pre[t2] : maxval;
    A sum = A(0);
    for (std::int64_t t2 = 0; t2 <= t; ++t2) {
      pre[t2] = std::exp(pre[t2] - maxval);
      sum += pre[t2];
    }
    const A inv = A(1) / sum;
    T* a = att + r * Tn;
    for (std::int64_t t2 = 0; t2 <= t; ++t2) {
      a[t2] = store<T>(pre[t2] * inv);
      pre[t2] = load(a[t2]);  // the stored probability: backward sees exactly this value
    }
    for (std::int64_t t2 = t + 1; t2 < Tn; ++t2) a[t2] = store<T>(A(0));
    for (std::int64_t t2 = t + 1; t2 < keys; ++t2) pre[t2] = A(0);
    if (dropout->active()) apply_dropout(pre, t + 1, mask_index + r * Tn, *dropout);
  }
}

// AttentionSoftmaxBackward for any compute type, in plain loops: the f64 path.
template <class T>
void attention_softmax_backward_loops(compute_type_t<T>* dp, const T* att, std::int64_t Tn,
                                      std::int64_t t0, std::int64_t rows, compute_type_t<T> scale,
                                      const DropoutMask* dropout, std::int64_t mask_index) {
  using A = compute_type_t<T>;
  const std::int64_t keys = t0 + rows;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = t0 + r;
    const T* a = att + r * Tn;
    A* d = dp + r * keys;
    if (dropout->active()) apply_dropout(d, t + 1, mask_index + r * Tn, *dropout);
    A dot = A(0);
    for (std::int64_t t2 = 0; t2 <= t; ++t2) dot += d[t2] * load(a[t2]);
    for (std::int64_t t2 = 0; t2 <= t; ++t2) d[t2] = load(a[t2]) * (d[t2] - dot) * scale;
    for (std::int64_t t2 = t + 1; t2 < keys; ++t2) d[t2] = A(0);
  }
}

/// The row softmax of a block for storage type T: AttentionSoftmax's entry for the host ISA
/// (float, bf16, f16), the plain loops otherwise.
template <class T>
auto attention_softmax_for() {
  using A = compute_type_t<T>;
  if constexpr (dispatched_type<T>) {
    return kernel_for<AttentionSoftmax, A*, std::int64_t, T*, std::int64_t, std::int64_t,
                      std::int64_t, const DropoutMask*, std::int64_t>();
  } else {
    return &attention_softmax_loops<T>;
  }
}

/// The softmax backward of a block for storage type T, chosen as attention_softmax_for.
template <class T>
auto attention_softmax_backward_for() {
  using A = compute_type_t<T>;
  if constexpr (dispatched_type<T>) {
    return kernel_for<AttentionSoftmaxBackward, A*, const T*, std::int64_t, std::int64_t,
                      std::int64_t, A, const DropoutMask*, std::int64_t>();
  } else {
    return &attention_softmax_backward_loops<T>;
  }
}

// Calls body(bh, scratch) for every (batch, head) pair bh in [0, pairs). The pairs are split
// into one contiguous range per thread, each with scratch_elems of its own from one allocation
// per call (not one per pair: at long sequences a pair's scratch is past malloc's mmap
// threshold). Pairs are independent, so the split changes no result.
template <class A, class Body>
void for_each_pair(std::int64_t pairs, std::int64_t scratch_elems, Body&& body) {
  const std::int64_t workers =
      std::clamp<std::int64_t>(num_threads(), 1, std::max<std::int64_t>(pairs, 1));
  const auto scratch =
      std::make_unique_for_overwrite<A[]>(static_cast<std::size_t>(workers * scratch_elems));
  parallel_for(workers, [&](std::int64_t w) {
    A* own = scratch.get() + w * scratch_elems;
    for (std::int64_t bh = pairs * w / workers; bh < pairs * (w + 1) / workers; ++bh) body(bh, own);
  });
}

}  // namespace detail

/// Writes out [B, T, C] and att [B, NH, T, T] (entries above the diagonal are zero); dropout
/// (off by default) applies to the probabilities multiplying v, not to the saved att.
template <class T>
void attention_forward(T* out, T* att, const T* qkv, std::int64_t B, std::int64_t Tn,
                       std::int64_t C, std::int64_t NH, const DropoutMask& dropout = {}) {
  using A = compute_type_t<T>;
  const std::int64_t hs = C / NH;
  const A scale = A(1) / std::sqrt(static_cast<A>(hs));
  // Scores and probabilities of one block of rows [block, Tn] in the compute type: att itself
  // for f32/f64 without dropout, else scratch. For half types the widened head and its output
  // [Tn, hs] are scratch too.
  constexpr bool in_place = std::is_same_v<A, T>;
  const bool scratch_scores = !in_place || dropout.active();
  const std::int64_t widened_elems = in_place ? 0 : Tn * 3 * hs;
  const std::int64_t out_elems = in_place ? 0 : Tn * hs;
  const std::int64_t scores_elems = scratch_scores ? std::min(attention_block, Tn) * Tn : 0;
  const auto softmax = detail::attention_softmax_for<T>();
  blas_single_threaded();
  detail::for_each_pair<A>(
      B * NH, widened_elems + out_elems + scores_elems, [&](std::int64_t bh, A* scratch) {
        const std::int64_t b = bh / NH, h = bh % NH;
        const auto head = detail::head_operands(qkv, b, h, Tn, C, hs, scratch);
        T* att_head = att + bh * Tn * Tn;
        A* out_head = scratch + widened_elems;
        std::int64_t ld_out = hs;
        if constexpr (in_place) {
          out_head = out + b * Tn * C + h * hs;
          ld_out = C;
        }
        A* const scores = scratch + widened_elems + out_elems;
        for (std::int64_t t0 = 0; t0 < Tn; t0 += attention_block) {
          const std::int64_t rows = std::min(attention_block, Tn - t0), keys = t0 + rows;
          A* s = scores;
          std::int64_t lds = keys;
          if constexpr (in_place) {
            if (!scratch_scores) {
              s = att_head + t0 * Tn;
              lds = Tn;
            }
          }
          gemm_serial<A>(Trans::no, Trans::yes, rows, keys, hs, scale, head.q + t0 * head.ld,
                         head.ld, head.k, head.ld, A(0), s, lds);
          softmax(s, lds, att_head + t0 * Tn, Tn, t0, rows, &dropout, (bh * Tn + t0) * Tn);
          gemm_serial<A>(Trans::no, Trans::no, rows, hs, keys, A(1), s, lds, head.v, head.ld, A(0),
                         out_head + t0 * ld_out, ld_out);
        }
        if constexpr (!in_place) {
          for (std::int64_t t = 0; t < Tn; ++t) {
            T* o = out + (b * Tn + t) * C + h * hs;
            for (std::int64_t i = 0; i < hs; ++i) o[i] = store<T>(out_head[t * hs + i]);
          }
        }
      });
}

/// Accumulates dqkv [B, T, 3C] from dout [B, T, C], the saved att and the forward input qkv;
/// dropout must be the forward's mask.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, std::int64_t B,
                        std::int64_t Tn, std::int64_t C, std::int64_t NH,
                        const DropoutMask& dropout = {}) {
  using A = compute_type_t<T>;
  const std::int64_t hs = C / NH;
  const A scale = A(1) / std::sqrt(static_cast<A>(hs));
  constexpr bool in_place = std::is_same_v<A, T>;
  // Scratch per pair: p and dp for one block of rows (2 [block, Tn]); for half types also the
  // widened head, its float gradients [T][q k v][hs] and dy [T, hs].
  const std::int64_t block = std::min(attention_block, Tn);
  const std::int64_t head_elems = in_place ? 0 : Tn * 3 * hs;
  const std::int64_t dy_elems = in_place ? 0 : Tn * hs;
  const auto softmax_backward = detail::attention_softmax_backward_for<T>();
  blas_single_threaded();
  detail::for_each_pair<A>(
      B * NH, 2 * head_elems + dy_elems + 2 * block * Tn, [&](std::int64_t bh, A* scratch) {
        const std::int64_t b = bh / NH, h = bh % NH;
        const auto head = detail::head_operands(qkv, b, h, Tn, C, hs, scratch);
        // The head's gradients dq, dk, dv: dqkv itself for f32/f64; for half types a float copy
        // [T][q k v][hs] that collects every contribution and is rounded into dqkv once at the end.
        // dy likewise (a view of dout, or a widened copy).
        A* grad = nullptr;
        const A* dy = nullptr;
        std::int64_t ld_grad = 3 * C, ld_dy = C, k_offset = C, v_offset = 2 * C;
        if constexpr (in_place) {
          grad = dqkv + b * Tn * 3 * C + h * hs;
          dy = dout + b * Tn * C + h * hs;
        } else {
          ld_grad = 3 * hs, ld_dy = hs, k_offset = hs, v_offset = 2 * hs;
          grad = scratch + head_elems;
          A* dy_head = scratch + 2 * head_elems;
          for (std::int64_t t = 0; t < Tn; ++t) {
            const T* src = dqkv + (b * Tn + t) * 3 * C + h * hs;
            for (std::int64_t part = 0; part < 3; ++part) {
              for (std::int64_t i = 0; i < hs; ++i)
                grad[t * ld_grad + part * hs + i] = load(src[part * C + i]);
            }
            const T* d = dout + (b * Tn + t) * C + h * hs;
            for (std::int64_t i = 0; i < hs; ++i) dy_head[t * hs + i] = load(d[i]);
          }
          dy = dy_head;
        }
        // Per block: p (the probabilities as used, dropout applied) and dp = dY V^T, then dS in dp.
        A* p = scratch + 2 * head_elems + dy_elems;
        A* dp = p + block * Tn;
        const T* att_head = att + bh * Tn * Tn;
        for (std::int64_t t0 = 0; t0 < Tn; t0 += attention_block) {
          const std::int64_t rows = std::min(attention_block, Tn - t0), keys = t0 + rows;
          for (std::int64_t r = 0; r < rows; ++r) {
            const T* a = att_head + (t0 + r) * Tn;
            for (std::int64_t t2 = 0; t2 < keys; ++t2) p[r * keys + t2] = load(a[t2]);
            if (dropout.active()) {
              detail::apply_dropout(p + r * keys, keys, (bh * Tn + t0 + r) * Tn, dropout);
            }
          }
          const A* dy_block = dy + t0 * ld_dy;
          // dV[0, keys) += P^T dY
          gemm_serial<A>(Trans::yes, Trans::no, keys, hs, rows, A(1), p, keys, dy_block, ld_dy,
                         A(1), grad + v_offset, ld_grad);
          // dP = dY V^T through the mask, then the softmax backward on the saved (undropped) att:
          // dS = att (dP - sum_j att_j dP_j) / sqrt(hs).
          gemm_serial<A>(Trans::no, Trans::yes, rows, keys, hs, A(1), dy_block, ld_dy, head.v,
                         head.ld, A(0), dp, keys);
          softmax_backward(dp, att_head + t0 * Tn, Tn, t0, rows, scale, &dropout,
                           (bh * Tn + t0) * Tn);
          // dQ[block] += dS K;  dK[0, keys) += dS^T Q[block]
          gemm_serial<A>(Trans::no, Trans::no, rows, hs, keys, A(1), dp, keys, head.k, head.ld,
                         A(1), grad + t0 * ld_grad, ld_grad);
          gemm_serial<A>(Trans::yes, Trans::no, keys, hs, rows, A(1), dp, keys,
                         head.q + t0 * head.ld, head.ld, A(1), grad + k_offset, ld_grad);
        }
        if constexpr (!in_place) {
          for (std::int64_t t = 0; t < Tn; ++t) {
            T* dst = dqkv + (b * Tn + t) * 3 * C + h * hs;
            for (std::int64_t part = 0; part < 3; ++part) {
              for (std::int64_t i = 0; i < hs; ++i)
                dst[part * C + i] = store<T>(grad[t * ld_grad + part * hs + i]);
            }
          }
        }
      });
}

}  // namespace zero::ops::cpu
