#pragma once
// GELU, tanh approximation (GPT-2):  y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// float, bf16 and f16 storage compute in float through the dispatched kernels
// (isa_dispatch.hpp), using 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)):
//   y = x s,  y' = s + 2 x s^2 e sqrt(2/pi) (1 + 3 * 0.044715 x^2),  s = 1 / (1 + e),  e = e^(-2u),
// which has no cancellation for large |u| (tanh near -1) and needs one exp (vector_math.hpp);
// every ISA gives the same bits, half types are rounded once per element. double keeps the
// tanh formula with std::tanh (the reference).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>
#include <zero/ops/cpu/vector_math.hpp>
#include <zero/ops/gelu_tanh.hpp>

namespace zero::ops::cpu {

namespace detail {

// s = 1 / (1 + e^(-2u)) for x; also x^2 and e = e^(-2u) (the backward reuses them).
template <class O>
inline typename O::V gelu_sigmoid(const typename O::V& x, typename O::V& x2, typename O::V& e) {
  x2 = O::mul(x, x);
  const auto inner = O::fma(O::set1(gelu_c), O::mul(x2, x), x);
  e = vmath::exp<O>(O::mul(O::set1(-2.0f * gelu_s), inner));
  return O::div(O::set1(1.0f), O::add(O::set1(1.0f), e));
}

template <class O, class T>
inline void gelu_forward_at(T* out, const T* inp, std::int64_t i) {
  typename O::V x2, e;
  const auto x = load_lanes<O>(inp + i);
  store_lanes<O>(out + i, O::mul(x, gelu_sigmoid<O>(x, x2, e)));
}

template <class O, class T>
inline void gelu_backward_at(T* dinp, const T* inp, const T* dout, bool overwrite, std::int64_t i) {
  typename O::V x2, e;
  const auto x = load_lanes<O>(inp + i);
  const auto s = gelu_sigmoid<O>(x, x2, e);
  const auto slope =
      O::mul(O::set1(2.0f * gelu_s), O::fma(O::set1(3.0f * gelu_c), x2, O::set1(1.0f)));
  // s (1 - s) as s^2 e: 1 - s = e s, without the cancellation of 1 - s where s is near 1.
  const auto grad = O::fma(O::mul(O::mul(x, s), O::mul(s, e)), slope, s);
  const auto start = overwrite ? O::set1(0.0f) : load_lanes<O>(dinp + i);
  store_lanes<O>(dinp + i, O::fma(grad, load_lanes<O>(dout + i), start));
}

struct GeluForward {
  template <class O, class T>
  static void run(T* out, const T* inp, std::int64_t begin, std::int64_t end) {
    std::int64_t i = begin;
    for (; i + O::width <= end; i += O::width) gelu_forward_at<O>(out, inp, i);
    for (; i < end; ++i) gelu_forward_at<optim::ScalarHostOps>(out, inp, i);
  }
};

struct GeluBackward {
  template <class O, class T>
  static void run(T* dinp, const T* inp, const T* dout, bool overwrite, std::int64_t begin,
                  std::int64_t end) {
    std::int64_t i = begin;
    for (; i + O::width <= end; i += O::width) gelu_backward_at<O>(dinp, inp, dout, overwrite, i);
    for (; i < end; ++i) gelu_backward_at<optim::ScalarHostOps>(dinp, inp, dout, overwrite, i);
  }
};

}  // namespace detail

/// out[i] = gelu(inp[i]) for n elements.
template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n) {
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::GeluForward, T*, const T*, std::int64_t, std::int64_t>();
    parallel_for((n + elementwise_chunk - 1) / elementwise_chunk, [&](std::int64_t c) {
      kernel(out, inp, c * elementwise_chunk, std::min(n, (c + 1) * elementwise_chunk));
    });
  } else {
    using A = compute_type_t<T>;
    const A s = std::sqrt(A(2) / std::numbers::pi_v<A>);
    parallel_for(n, [&](std::int64_t i) {
      const A x = load(inp[i]);
      out[i] = store<T>(A(0.5) * x * (A(1) + std::tanh(s * (x + A(0.044715) * x * x * x))));
    });
  }
}

/// dinp[i] += gelu'(inp[i]) * dout[i]; overwrite writes dinp instead (the values of adding
/// into zeros).
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n, bool overwrite = false) {
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::GeluBackward, T*, const T*, const T*, bool, std::int64_t,
                                   std::int64_t>();
    parallel_for((n + elementwise_chunk - 1) / elementwise_chunk, [&](std::int64_t c) {
      kernel(dinp, inp, dout, overwrite, c * elementwise_chunk,
             std::min(n, (c + 1) * elementwise_chunk));
    });
  } else {
    using A = compute_type_t<T>;
    const A s = std::sqrt(A(2) / std::numbers::pi_v<A>);
    parallel_for(n, [&](std::int64_t i) {
      const A x = load(inp[i]);
      const A u = s * (x + A(0.044715) * x * x * x);
      const A th = std::tanh(u);
      const A sech2 = A(1) - th * th;
      const A grad =
          A(0.5) * (A(1) + th) + A(0.5) * x * sech2 * s * (A(1) + A(3) * A(0.044715) * x * x);
      dinp[i] = store<T>((overwrite ? A(0) : load(dinp[i])) + grad * load(dout[i]));
    });
  }
}

}  // namespace zero::ops::cpu
