#pragma once
// GELU, tanh approximation (GPT-2):  y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// Half types are computed in float and rounded once per element.

#include <cmath>
#include <cstdint>
#include <numbers>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out[i] = gelu(inp[i]) for n elements.
template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n) {
  using A = compute_type_t<T>;
  const A s = std::sqrt(A(2) / std::numbers::pi_v<A>);
  parallel_for(n, [&](std::int64_t i) {
    const A x = load(inp[i]);
    out[i] = store<T>(A(0.5) * x * (A(1) + std::tanh(s * (x + A(0.044715) * x * x * x))));
  });
}

/// dinp[i] += gelu'(inp[i]) * dout[i].
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {
  using A = compute_type_t<T>;
  const A s = std::sqrt(A(2) / std::numbers::pi_v<A>);
  parallel_for(n, [&](std::int64_t i) {
    const A x = load(inp[i]);
    const A u = s * (x + A(0.044715) * x * x * x);
    const A th = std::tanh(u);
    const A sech2 = A(1) - th * th;
    const A grad =
        A(0.5) * (A(1) + th) + A(0.5) * x * sech2 * s * (A(1) + A(3) * A(0.044715) * x * x);
    dinp[i] = store<T>(load(dinp[i]) + grad * load(dout[i]));
  });
}

}  // namespace zero::ops::cpu
