#pragma once
// Elementwise kernels: residual add, accumulate (and, through dropout.hpp, dropout with a
// counter-based mask). Half types are loaded to float, added there and rounded once.

#include <cstdint>

#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out = a + b over n elements.
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n) {
  parallel_for(n, [&](std::int64_t i) { out[i] = store<T>(load(a[i]) + load(b[i])); });
}

/// acc += x over n elements.
template <class T>
void accumulate(T* acc, const T* x, std::int64_t n) {
  parallel_for(n, [&](std::int64_t i) { acc[i] = store<T>(load(acc[i]) + load(x[i])); });
}

}  // namespace zero::ops::cpu
