#pragma once
// Token plus learned position embedding (GPT-2's encoder):
//   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
// The backward pass scatters into wte rows. Positions are grouped by token (in position order)
// and threads own channel ranges, so each gradient element adds its contributions in a fixed
// order whatever the thread count, and is loaded and stored once: half types accumulate a row's
// contributions in float and round once. float, bf16 and f16 run the dispatched kernels
// (isa_dispatch.hpp): the row adds are vectors, and the backward's channels are vector lanes,
// each adding its rows in the same order, so every ISA gives the same bits.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/lane_reduction.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

struct EmbeddingForward {
  template <class O, class T>
  static void run(T* out, const std::int32_t* tokens, const T* wte, const T* wpe, std::int64_t Tn,
                  std::int64_t C, std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const T* e = wte + static_cast<std::int64_t>(tokens[i]) * C;
      T* o = out + i * C;
      if (wpe == nullptr) {
        std::memcpy(o, e, static_cast<std::size_t>(C) * sizeof(T));
        continue;
      }
      const T* p = wpe + (i % Tn) * C;
      const auto add_at = [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        store_lanes<P>(o + c, P::add(load_lanes<P>(e + c), load_lanes<P>(p + c)));
      };
      std::int64_t c = 0;
      for (; c + O::width <= C; c += O::width) add_at(O{}, c);
      for (; c < C; ++c) add_at(optim::ScalarHostOps{}, c);
    }
  }
};

// Adds the rows of dout listed in rows[0, count) (or, with rows null, first + k stride) into
// g's channels [c0, c1), each channel in the order given, rounding once.
template <class O, class T>
inline void embedding_add_rows(T* g, const T* dout, std::int64_t C, std::int64_t c0,
                               std::int64_t c1, const std::int64_t* rows, std::int64_t count,
                               std::int64_t first, std::int64_t stride) {
  reduce_columns<O, 1>(
      c0, c1, count,
      [&](auto ops, std::int64_t c) {
        using P = decltype(ops);
        return std::array<typename P::V, 1>{load_lanes<P>(g + c)};
      },
      [&](auto ops, auto& acc, std::int64_t k, std::int64_t c) {
        using P = decltype(ops);
        const std::int64_t row = rows != nullptr ? rows[k] : first + k * stride;
        acc[0] = P::add(acc[0], load_lanes<P>(dout + row * C + c));
      },
      [&](auto ops, const auto& acc, std::int64_t c) {
        using P = decltype(ops);
        store_lanes<P>(g + c, acc[0]);
      });
}

struct EmbeddingBackward {
  // Channels [c0, c1) of dwte (the positions in order, grouped by token) and dwpe.
  template <class O, class T>
  static void run(T* dwte, T* dwpe, const T* dout, const std::int32_t* tokens,
                  const std::int64_t* order, std::int64_t B, std::int64_t Tn, std::int64_t C,
                  std::int64_t c0, std::int64_t c1) {
    const std::int64_t N = B * Tn;
    if (dwte != nullptr) {
      for (std::int64_t first = 0; first < N;) {
        const std::int32_t token = tokens[order[first]];
        std::int64_t last = first;
        while (last < N && tokens[order[last]] == token) ++last;
        embedding_add_rows<O>(dwte + static_cast<std::int64_t>(token) * C, dout, C, c0, c1,
                              order + first, last - first, 0, 0);
        first = last;
      }
    }
    if (dwpe != nullptr) {
      for (std::int64_t t = 0; t < Tn; ++t) {
        embedding_add_rows<O>(dwpe + t * C, dout, C, c0, c1, nullptr, B, t, Tn);
      }
    }
  }
};

}  // namespace detail

/// out [B*T, C] from tokens [B*T]; wpe may be null (no positions: the layer library's plain
/// Embedding). Throws ShapeError for a token outside [0, V).
template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                       std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) {
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    expect<ShapeError>(tokens[i] >= 0 && tokens[i] < V, "embedding: token ", tokens[i],
                       " at position ", i, " is outside the vocabulary [0, ", V, ")");
  }
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<detail::EmbeddingForward, T*, const std::int32_t*, const T*, const T*,
                   std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
    const std::int64_t rows = std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(1, C));
    parallel_chunks(B * Tn, rows, B * Tn * C, [&](std::int64_t i0, std::int64_t i1) {
      kernel(out, tokens, wte, wpe, Tn, C, i0, i1);
    });
    return;
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
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::EmbeddingBackward, T*, T*, const T*, const std::int32_t*,
                                   const std::int64_t*, std::int64_t, std::int64_t, std::int64_t,
                                   std::int64_t, std::int64_t>();
    parallel_chunks(C, 64, N * C, [&](std::int64_t c0, std::int64_t c1) {
      kernel(dwte, dwpe, dout, tokens, order.data(), B, Tn, C, c0, c1);
    });
    return;
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
