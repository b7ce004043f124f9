#pragma once
// The per-element math of every optimizer, written once over an "Ops" vocabulary (ScalarOps in
// lane_ops.hpp, the AVX2/AVX-512 vectors in cpu/vector_ops.hpp, CUDA threads use ScalarOps) so
// the scalar, SIMD and CUDA paths run the same operations in the same order.
//
// Rule of the file (see lane_ops.hpp for why): every fused multiply-add is an explicit O::fma or
// O::fnma, and no plain product ever feeds a plain add or subtract. Each rule's constants are
// computed once per step and group in double, then rounded to float.
//
// A rule has `states` state vectors (in the order its optimizer names them), and says whether it
// reads the gradient and writes the parameter and the states, so a pass that does not need a
// stream does not move it.

#include <cstdint>

#include <zero/core/macros.hpp>

namespace zero::optim {

// ---- Adam / AdamW ------------------------------------------------------------------------------

/// Adam (Kingma & Ba 2015, Algorithm 1, with PyTorch's L2 term and eps outside the square root of
/// the bias-corrected second moment) and AdamW (Loshchilov & Hutter 2019, decoupled decay):
///   g  = g + l2 * p                                  (Adam with weight_decay; 0 for AdamW)
///   m  = beta1 * m + (1 - beta1) * g
///   v  = beta2 * v + (1 - beta2) * g^2
///   p  = p * (1 - lr * wd)                           (AdamW; 1 for Adam)
///   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
struct AdamRule {
  static constexpr int states = 2;  ///< exp_avg, exp_avg_sq
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = true;
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float inv_sqrt_bias2;  ///< 1 / sqrt(1 - beta2^t)
  float neg_step_size;   ///< -lr / (1 - beta1^t)
  float l2;              ///< coupled weight decay (Adam)
  float decay;           ///< 1 - lr * weight_decay (AdamW)

  /// Updates one vector of parameters p and states s = {m, v} from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g_in, V* s) const {
    const V g = O::fma(O::set1(l2), p, g_in);
    s[0] = O::fma(O::set1(beta1), s[0], O::mul(O::set1(one_minus_beta1), g));
    s[1] = O::fma(O::set1(beta2), s[1], O::mul(O::set1(one_minus_beta2), O::mul(g, g)));
    const V denom = O::fma(O::sqrt(s[1]), O::set1(inv_sqrt_bias2), O::set1(eps));
    p = O::fma(O::set1(neg_step_size), O::div(s[0], denom), O::mul(p, O::set1(decay)));
  }
};

// ---- SGD ---------------------------------------------------------------------------------------

/// SGD as PyTorch's torch.optim.SGD (weight decay added to the gradient; the first momentum step
/// copies the gradient; Nesterov looks ahead by momentum * buf):
///   g = g + wd * p;  buf = t == 1 ? g : momentum * buf + (1 - dampening) * g
///   d = nesterov ? g + momentum * buf : buf  (d = g without momentum);  p = p - lr * d
template <bool Momentum>
struct SgdRule {
  static constexpr int states = Momentum ? 1 : 0;  ///< momentum_buffer
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = true;
  float weight_decay, momentum, one_minus_dampening, neg_lr;
  bool nesterov, first_step;

  /// Updates one vector of parameters p (and the momentum buffer s[0]) from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g_in, V* s) const {
    const V g = O::fma(O::set1(weight_decay), p, g_in);
    if constexpr (Momentum) {
      s[0] =
          first_step ? g : O::fma(O::set1(momentum), s[0], O::mul(O::set1(one_minus_dampening), g));
      const V d = nesterov ? O::fma(O::set1(momentum), s[0], g) : s[0];
      p = O::fma(O::set1(neg_lr), d, p);
    } else {
      (void)s;
      p = O::fma(O::set1(neg_lr), g, p);
    }
  }
};

// ---- RMSProp -----------------------------------------------------------------------------------

/// RMSProp as PyTorch's torch.optim.RMSprop:
///   g = g + wd * p;  v = alpha * v + (1 - alpha) * g^2
///   centered: ga = alpha * ga + (1 - alpha) * g;  avg = sqrt(v - ga^2) + eps  (else sqrt(v) + eps)
///   momentum: buf = momentum * buf + g / avg;  p = p - lr * buf   (else p = p - lr * g / avg)
template <bool Centered, bool Momentum>
struct RmspropRule {
  static constexpr int states =
      1 + (Centered ? 1 : 0) + (Momentum ? 1 : 0);  ///< square_avg, grad_avg, momentum_buffer
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = true;
  float weight_decay, alpha, one_minus_alpha, eps, momentum, neg_lr;

  /// Updates one vector of parameters p and states s from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g_in, V* s) const {
    const V g = O::fma(O::set1(weight_decay), p, g_in);
    s[0] = O::fma(O::set1(alpha), s[0], O::mul(O::set1(one_minus_alpha), O::mul(g, g)));
    V variance = s[0];
    if constexpr (Centered) {
      s[1] = O::fma(O::set1(alpha), s[1], O::mul(O::set1(one_minus_alpha), g));
      variance = O::fnma(s[1], s[1], s[0]);
    }
    const V avg = O::add(O::sqrt(variance), O::set1(eps));
    if constexpr (Momentum) {
      constexpr int k = Centered ? 2 : 1;
      s[k] = O::fma(O::set1(momentum), s[k], O::div(g, avg));
      p = O::fma(O::set1(neg_lr), s[k], p);
    } else {
      p = O::fma(O::set1(neg_lr), O::div(g, avg), p);
    }
  }
};

// ---- Adagrad -----------------------------------------------------------------------------------

/// Adagrad (Duchi, Hazan & Singer 2011) as PyTorch's torch.optim.Adagrad:
///   clr = lr / (1 + (t - 1) * lr_decay);  g = g + wd * p;  sum = sum + g^2
///   p = p - clr * g / (sqrt(sum) + eps)
struct AdagradRule {
  static constexpr int states = 1;  ///< sum
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = true;
  float weight_decay, eps, neg_clr;

  /// Updates one vector of parameters p and the accumulator s[0] from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g_in, V* s) const {
    const V g = O::fma(O::set1(weight_decay), p, g_in);
    s[0] = O::fma(g, g, s[0]);
    const V std_dev = O::add(O::sqrt(s[0]), O::set1(eps));
    p = O::fma(O::set1(neg_clr), O::div(g, std_dev), p);
  }
};

// ---- Lion --------------------------------------------------------------------------------------

/// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):
///   c = beta1 * m + (1 - beta1) * g;  p = p * (1 - lr * wd) - lr * sign(c)
///   m = beta2 * m + (1 - beta2) * g
struct LionRule {
  static constexpr int states = 1;  ///< exp_avg
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = true;
  float beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay;

  /// Updates one vector of parameters p and the momentum s[0] from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g, V* s) const {
    const V c = O::fma(O::set1(beta1), s[0], O::mul(O::set1(one_minus_beta1), g));
    p = O::fma(O::set1(neg_lr), O::sign(c), O::mul(p, O::set1(decay)));
    s[0] = O::fma(O::set1(beta2), s[0], O::mul(O::set1(one_minus_beta2), g));
  }
};

// ---- LAMB --------------------------------------------------------------------------------------

/// LAMB's first pass (You et al. 2020, Algorithm 2): the Adam moments, no parameter write.
///   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
struct LambMomentsRule {
  static constexpr int states = 2;  ///< exp_avg, exp_avg_sq
  static constexpr bool reads_grad = true;
  static constexpr bool writes_param = false;
  static constexpr bool writes_states = true;
  float beta1, one_minus_beta1, beta2, one_minus_beta2;

  /// Updates the moments s = {m, v} from gradient g.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g, V* s) const {
    (void)p;
    s[0] = O::fma(O::set1(beta1), s[0], O::mul(O::set1(one_minus_beta1), g));
    s[1] = O::fma(O::set1(beta2), s[1], O::mul(O::set1(one_minus_beta2), O::mul(g, g)));
  }
};

/// LAMB's update direction u = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps) + wd * p.
struct LambDirection {
  float inv_bias1, inv_sqrt_bias2, eps, weight_decay;

  /// u for one vector of parameters p with moments m and v.
  template <class O, class V>
  ZERO_HOST_DEVICE V operator()(const V& p, const V& m, const V& v) const {
    const V denom = O::fma(O::sqrt(v), O::set1(inv_sqrt_bias2), O::set1(eps));
    return O::fma(O::set1(weight_decay), p, O::div(O::mul(m, O::set1(inv_bias1)), denom));
  }
};

/// LAMB's last pass: p = p - lr * trust_ratio * u, the ratio fixed per tensor.
struct LambApplyRule {
  static constexpr int states = 2;  ///< exp_avg, exp_avg_sq (read only)
  static constexpr bool reads_grad = false;
  static constexpr bool writes_param = true;
  static constexpr bool writes_states = false;
  LambDirection direction;
  float neg_scaled_lr;  ///< -lr * trust_ratio of this tensor

  /// Applies the trust-ratio-scaled direction to one vector of parameters.
  template <class O, class V>
  ZERO_HOST_DEVICE void apply(V& p, const V& g, V* s) const {
    (void)g;
    p = O::fma(O::set1(neg_scaled_lr), direction.template operator()<O>(p, s[0], s[1]), p);
  }
};

}  // namespace zero::optim
