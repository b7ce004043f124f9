#pragma once
// Token plus learned position embedding (GPT-2's encoder):
//   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
// The backward pass scatters into wte rows; threads own channel ranges, so the order in which
// tokens add into a row is fixed and results do not depend on the thread count.

#include <cstdint>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// out [B*T, C] from tokens [B*T]; throws ShapeError for a token outside [0, V).
template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                       std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) {
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    expect<ShapeError>(tokens[i] >= 0 && tokens[i] < V, "embedding: token ", tokens[i],
                       " at position ", i, " is outside the vocabulary [0, ", V, ")");
  }
  parallel_for(B * Tn, [&](std::int64_t i) {
    const T* e = wte + static_cast<std::int64_t>(tokens[i]) * C;
    const T* p = wpe + (i % Tn) * C;
    T* o = out + i * C;
    for (std::int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
  });
}

/// Accumulates dwte and dwpe (either may be null) from dout [B*T, C].
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const std::int32_t* tokens, std::int64_t B,
                        std::int64_t Tn, std::int64_t C) {
  constexpr std::int64_t block = 64;  // channels per task
  const std::int64_t blocks = (C + block - 1) / block;
  parallel_for(blocks, [&](std::int64_t blk) {
    const std::int64_t c0 = blk * block, c1 = c0 + block < C ? c0 + block : C;
    for (std::int64_t i = 0; i < B * Tn; ++i) {
      const T* d = dout + i * C;
      if (dwte != nullptr) {
        T* g = dwte + static_cast<std::int64_t>(tokens[i]) * C;
        for (std::int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
      if (dwpe != nullptr) {
        T* g = dwpe + (i % Tn) * C;
        for (std::int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
    }
  });
}

}  // namespace zero::ops::cpu
