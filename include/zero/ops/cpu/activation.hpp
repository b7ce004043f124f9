#pragma once
// ReLU and SiLU (x * sigmoid(x)) for the layer library; GELU lives in gelu.hpp. Like every host
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

}  // namespace zero::ops::cpu
