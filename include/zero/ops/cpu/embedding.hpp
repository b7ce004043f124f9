#pragma once
// Token plus learned position embedding (GPT-2's encoder):
//   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
// The backward pass scatters into wte rows. Positions are grouped by token (in position order)
// and threads own channel ranges, so each gradient element adds its contributions in a fixed
// order whatever the thread count, and is loaded and stored once: half types accumulate a row's
// contributions in float and round once.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out [B*T, C] from tokens [B*T]; wpe may be null (no positions: the layer library's plain
/// Embedding). Throws ShapeError for a token outside [0, V).
template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                       std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) {
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    expect<ShapeError>(tokens[i] >= 0 && tokens[i] < V, "embedding: token ", tokens[i],
                       " at position ", i, " is outside the vocabulary [0, ", V, ")");
  }
  parallel_for(B * Tn, [&](std::int64_t i) {
    const T* e = wte + static_cast<std::int64_t>(tokens[i]) * C;
    T* o = out + i * C;
    if (wpe == nullptr) {
      for (std::int64_t c = 0; c < C; ++c) o[c] = e[c];
      return;
    }
    const T* p = wpe + (i % Tn) * C;
    for (std::int64_t c = 0; c < C; ++c) o[c] = store<T>(load(e[c]) + load(p[c]));
  });
}

/// Accumulates dwte and dwpe (either may be null; tokens may be null without dwte) from
/// dout [B*T, C].
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const std::int32_t* tokens, std::int64_t B,
                        std::int64_t Tn, std::int64_t C) {
  using A = compute_type_t<T>;
  const std::int64_t N = B * Tn;
  // Positions sorted by token, stable: each token's positions stay in increasing order. Only
  // the token table needs them (tokens may be null when dwte is).
  std::vector<std::int64_t> order;
  if (dwte != nullptr) {
    order.resize(static_cast<std::size_t>(N));
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t a, std::int64_t b) { return tokens[a] < tokens[b]; });
  }
  constexpr std::int64_t block = 64;  // channels per task
  const std::int64_t blocks = (C + block - 1) / block;
  parallel_for(blocks, [&](std::int64_t blk) {
    const std::int64_t c0 = blk * block, c1 = c0 + block < C ? c0 + block : C;
    A acc[block];
    // Adds the rows dout[positions] into g[c0, c1) in the order given, rounding once.
    auto add_rows = [&](T* g, auto&& positions) {
      for (std::int64_t c = c0; c < c1; ++c) acc[c - c0] = load(g[c]);
      positions([&](std::int64_t i) {
        const T* d = dout + i * C;
        for (std::int64_t c = c0; c < c1; ++c) acc[c - c0] += load(d[c]);
      });
      for (std::int64_t c = c0; c < c1; ++c) g[c] = store<T>(acc[c - c0]);
    };
    if (dwte != nullptr) {
      for (std::int64_t first = 0; first < N;) {
        const std::int32_t token = tokens[order[static_cast<std::size_t>(first)]];
        std::int64_t last = first;
        while (last < N && tokens[order[static_cast<std::size_t>(last)]] == token) ++last;
        add_rows(dwte + static_cast<std::int64_t>(token) * C, [&](auto&& visit) {
          for (std::int64_t j = first; j < last; ++j) visit(order[static_cast<std::size_t>(j)]);
        });
        first = last;
      }
    }
    if (dwpe != nullptr) {
      for (std::int64_t t = 0; t < Tn; ++t) {
        add_rows(dwpe + t * C, [&](auto&& visit) {
          for (std::int64_t b = 0; b < B; ++b) visit(b * Tn + t);
        });
      }
    }
  });
}

}  // namespace zero::ops::cpu
