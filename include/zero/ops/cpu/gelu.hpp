#pragma once
// GELU, tanh approximation (GPT-2):  y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

#include <cmath>
#include <cstdint>
#include <numbers>

#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out[i] = gelu(inp[i]) for n elements.
template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n) {
  const T s = std::sqrt(T(2) / std::numbers::pi_v<T>);
  parallel_for(n, [&](std::int64_t i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(s * (x + T(0.044715) * x * x * x)));
  });
}

/// dinp[i] += gelu'(inp[i]) * dout[i].
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {
  const T s = std::sqrt(T(2) / std::numbers::pi_v<T>);
  parallel_for(n, [&](std::int64_t i) {
    const T x = inp[i];
    const T u = s * (x + T(0.044715) * x * x * x);
    const T th = std::tanh(u);
    const T sech2 = T(1) - th * th;
    const T grad =
        T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * s * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] += grad * dout[i];
  });
}

}  // namespace zero::ops::cpu
