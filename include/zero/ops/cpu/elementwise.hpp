#pragma once
// Elementwise kernels: residual add, accumulate (and, through dropout.hpp, dropout with a
// counter-based mask). Half types are loaded to float, added there and rounded once; float,
// bf16 and f16 run the dispatched kernels (isa_dispatch.hpp), double a plain loop.

#include <cstdint>

#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

struct AddKernel {
  template <class O, class T>
  static void run(T* out, const T* a, const T* b, std::int64_t begin, std::int64_t end) {
    const auto add_at = [&](auto ops, std::int64_t i) {
      using P = decltype(ops);
      store_lanes<P>(out + i, P::add(load_lanes<P>(a + i), load_lanes<P>(b + i)));
    };
    std::int64_t i = begin;
    for (; i + O::width <= end; i += O::width) add_at(O{}, i);
    for (; i < end; ++i) add_at(optim::ScalarHostOps{}, i);
  }
};

}  // namespace detail

/// out = a + b over n elements (out may alias a or b).
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n) {
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<detail::AddKernel, T*, const T*, const T*, std::int64_t, std::int64_t>();
    parallel_chunks(n, elementwise_chunk, n,
                    [&](std::int64_t begin, std::int64_t end) { kernel(out, a, b, begin, end); });
  } else {
    parallel_for(n, [&](std::int64_t i) { out[i] = store<T>(load(a[i]) + load(b[i])); });
  }
}

/// acc += x over n elements.
template <class T>
void accumulate(T* acc, const T* x, std::int64_t n) {
  add(acc, acc, x, n);
}

/// out[n, c] = x[n, c] + rows[n % R, c] for N rows of C (out may alias x): a position table of
/// R = T rows added to B sequences of T rows.
template <class T>
void add_periodic_rows(T* out, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                       std::int64_t C) {
  parallel_for(N, [&](std::int64_t n) {
    const T* r = rows + (n % R) * C;
    for (std::int64_t c = 0; c < C; ++c) {
      out[n * C + c] = store<T>(load(x[n * C + c]) + load(r[c]));
    }
  });
}

}  // namespace zero::ops::cpu
