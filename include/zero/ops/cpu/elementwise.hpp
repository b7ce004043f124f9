#pragma once
// Elementwise kernels: residual add, accumulate, dropout with a counter-based mask.

#include <cstdint>

#include <zero/core/rng.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out = a + b over n elements.
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n) {
  parallel_for(n, [&](std::int64_t i) { out[i] = a[i] + b[i]; });
}

/// acc += x over n elements.
template <class T>
void accumulate(T* acc, const T* x, std::int64_t n) {
  parallel_for(n, [&](std::int64_t i) { acc[i] += x[i]; });
}

/// Inverted dropout: out = inp * keep / (1 - p) with keep drawn from (rng, stream, index), so a
/// recomputed forward (activation checkpointing) draws the same mask.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, double p, const CounterRng& rng,
                     std::uint32_t stream) {
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  const auto threshold = static_cast<std::uint32_t>(p * 4294967296.0);
  parallel_for(n, [&](std::int64_t i) {
    const bool keep = rng.words(static_cast<std::uint64_t>(i), stream)[0] >= threshold;
    out[i] = keep ? inp[i] * scale : T(0);
  });
}

/// dinp += dout * mask / (1 - p), the mask redrawn from the same (rng, stream).
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, double p, const CounterRng& rng,
                      std::uint32_t stream) {
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  const auto threshold = static_cast<std::uint32_t>(p * 4294967296.0);
  parallel_for(n, [&](std::int64_t i) {
    const bool keep = rng.words(static_cast<std::uint64_t>(i), stream)[0] >= threshold;
    if (keep) dinp[i] += dout[i] * scale;
  });
}

}  // namespace zero::ops::cpu
