#pragma once
// ReLU, SiLU (x * sigmoid(x)) and SwiGLU (silu(gate) * up) for the layer library; GELU lives
// in gelu.hpp. Like every host
// kernel they load to the compute type, compute there and round once per stored element, and
// the backward passes accumulate into dinp so a caller can sum gradients from several users.

#include <cmath>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

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

/// SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020; Llama's MLP): rows of
/// [gate (f) | up (f)] give out[r, j] = silu(gate[r, j]) * up[r, j], rows of f.
template <class T>
void swiglu_forward(T* out, const T* inp, std::int64_t rows, std::int64_t f) {
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
