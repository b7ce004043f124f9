#pragma once
// ReLU, SiLU (x * sigmoid(x)) and SwiGLU (silu(gate) * up) for the layer library; GELU lives
// in gelu.hpp. Like every host
// kernel they load to the compute type, compute there and round once per stored element, and
// the backward passes accumulate into dinp so a caller can sum gradients from several users.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/ops/cpu/vector_math.hpp>

namespace zero::ops::cpu {

/// out[i] = max(inp[i], 0) for n elements; a NaN stays NaN (as PyTorch's), so a diverged
/// activation reaches the loss and the engine's non-finite checks instead of becoming 0.
template <class T>
void relu_forward(T* out, const T* inp, std::int64_t n) {
  using A = compute_type_t<T>;
  parallel_for(n, [&](std::int64_t i) {
    const A x = load(inp[i]);
    out[i] = store<T>(x <= A(0) ? A(0) : x);
  });
}

/// dinp[i] += dout[i] where inp[i] > 0 (the subgradient at 0 is 0, as in PyTorch).
template <class T>
void relu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {
  using A = compute_type_t<T>;
  parallel_for(n, [&](std::int64_t i) {
    if (load(inp[i]) > A(0)) dinp[i] = store<T>(load(dinp[i]) + load(dout[i]));
  });
}

/// out[i] = inp[i] * sigmoid(inp[i]) for n elements.
template <class T>
void silu_forward(T* out, const T* inp, std::int64_t n) {
  using A = compute_type_t<T>;
  parallel_for(n, [&](std::int64_t i) {
    const A x = load(inp[i]);
    out[i] = store<T>(x / (A(1) + std::exp(-x)));
  });
}

/// dinp[i] += silu'(inp[i]) * dout[i], silu' = s (1 + x (1 - s)) with s = sigmoid(x).
template <class T>
void silu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {
  using A = compute_type_t<T>;
  parallel_for(n, [&](std::int64_t i) {
    const A x = load(inp[i]);
    const A s = A(1) / (A(1) + std::exp(-x));
    dinp[i] = store<T>(load(dinp[i]) + s * (A(1) + x * (A(1) - s)) * load(dout[i]));
  });
}

namespace detail {

// SwiGLU of one vector of a row at j: gate and up are the row's halves. s = 1 / (1 + e),
// e = exp(-g) (vector_math.hpp), out = (g s) u.
template <class O, class T>
inline void swiglu_forward_at(T* out, const T* gate, const T* up, std::int64_t j) {
  const auto g = load_lanes<O>(gate + j);
  const auto e = vmath::exp<O>(O::mul(O::set1(-1.0f), g));
  const auto s = O::div(O::set1(1.0f), O::add(O::set1(1.0f), e));
  store_lanes<O>(out + j, O::mul(O::mul(g, s), load_lanes<O>(up + j)));
}

// Its gradients at j: dgate (+)= (d u) silu'(g), silu'(g) = s + (g s)(s e) (1 - s as e s, without
// the cancellation of 1 - s where s is near 1); dup (+)= d (g s).
template <class O, class T>
inline void swiglu_backward_at(T* dgate, T* dup, const T* gate, const T* up, const T* dout,
                               bool overwrite, std::int64_t j) {
  const auto g = load_lanes<O>(gate + j), u = load_lanes<O>(up + j), d = load_lanes<O>(dout + j);
  const auto e = vmath::exp<O>(O::mul(O::set1(-1.0f), g));
  const auto s = O::div(O::set1(1.0f), O::add(O::set1(1.0f), e));
  const auto gs = O::mul(g, s);
  const auto slope = O::fma(gs, O::mul(s, e), s);
  const auto zero = O::set1(0.0f);
  store_lanes<O>(dgate + j,
                 O::fma(O::mul(d, u), slope, overwrite ? zero : load_lanes<O>(dgate + j)));
  store_lanes<O>(dup + j, O::fma(d, gs, overwrite ? zero : load_lanes<O>(dup + j)));
}

struct SwigluForward {
  template <class O, class T>
  static void run(T* out, const T* inp, std::int64_t f, std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* gate = inp + r * 2 * f;
      T* o = out + r * f;
      std::int64_t j = 0;
      for (; j + O::width <= f; j += O::width) swiglu_forward_at<O>(o, gate, gate + f, j);
      for (; j < f; ++j) swiglu_forward_at<optim::ScalarHostOps>(o, gate, gate + f, j);
    }
  }
};

struct SwigluBackward {
  template <class O, class T>
  static void run(T* dinp, const T* inp, const T* dout, bool overwrite, std::int64_t f,
                  std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* gate = inp + r * 2 * f;
      T* dgate = dinp + r * 2 * f;
      const T* d = dout + r * f;
      std::int64_t j = 0;
      for (; j + O::width <= f; j += O::width) {
        swiglu_backward_at<O>(dgate, dgate + f, gate, gate + f, d, overwrite, j);
      }
      for (; j < f; ++j) {
        swiglu_backward_at<optim::ScalarHostOps>(dgate, dgate + f, gate, gate + f, d, overwrite, j);
      }
    }
  }
};

}  // namespace detail

/// SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020; Llama's MLP): rows of
/// [gate (f) | up (f)] give out[r, j] = silu(gate[r, j]) * up[r, j], rows of f. float, bf16 and
/// f16 run the dispatched kernels (isa_dispatch.hpp: the vector exp of vector_math.hpp, every ISA
/// the same bits, rows in parallel); double the plain loop with std::exp (the reference).
template <class T>
void swiglu_forward(T* out, const T* inp, std::int64_t rows, std::int64_t f) {
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<detail::SwigluForward, T*, const T*, std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(rows, rows_per_task(f), rows * f,
                    [&](std::int64_t r0, std::int64_t r1) { kernel(out, inp, f, r0, r1); });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(rows * f, [&](std::int64_t k) {
    const std::int64_t r = k / f, j = k % f;
    const A g = load(inp[r * 2 * f + j]), u = load(inp[r * 2 * f + f + j]);
    out[k] = store<T>(g / (A(1) + std::exp(-g)) * u);
  });
}

/// dinp (+=, or = when overwrite) the gradient of swiglu_forward given dout:
/// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
template <class T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, std::int64_t rows, std::int64_t f,
                     bool overwrite = false) {
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::SwigluBackward, T*, const T*, const T*, bool,
                                   std::int64_t, std::int64_t, std::int64_t>();
    parallel_chunks(rows, rows_per_task(f), rows * f, [&](std::int64_t r0, std::int64_t r1) {
      kernel(dinp, inp, dout, overwrite, f, r0, r1);
    });
    return;
  }
  using A = compute_type_t<T>;
  parallel_for(rows * f, [&](std::int64_t k) {
    const std::int64_t r = k / f, j = k % f;
    const std::int64_t kg = r * 2 * f + j, ku = kg + f;
    const A g = load(inp[kg]), u = load(inp[ku]), d = load(dout[k]);
    const A s = A(1) / (A(1) + std::exp(-g));
    const A dg = d * u * s * (A(1) + g * (A(1) - s)), du = d * g * s;
    dinp[kg] = store<T>(overwrite ? dg : load(dinp[kg]) + dg);
    dinp[ku] = store<T>(overwrite ? du : load(dinp[ku]) + du);
  });
}

}  // namespace zero::ops::cpu
