#pragma once
// FlopCount: the multiply-accumulates and floating-point operations of one forward, as a layer
// reports them for the flops profiler (zero::profile). The conventions follow DeepSpeed's flops
// profiler so the figures compare: a matrix product of m x k by k x n is m*k*n MACs and twice
// that in FLOPs (bias adds are not counted), causal attention counts only the unmasked
// (lower-triangle) scores, LayerNorm is 5 FLOPs per element, RMSNorm 4, and activations,
// softmax, dropout, residual and position adds 1 per element. Embedding look-ups, reshapes and
// inputs are free. The backward is counted as twice the forward, as DeepSpeed does.

#include <cstdint>

#include <zero/core/shape.hpp>

namespace zero::nn {

/// MACs and FLOPs of one forward (or a sum of them).
struct FlopCount {
  std::int64_t macs = 0;   ///< multiply-accumulates of matrix products
  std::int64_t flops = 0;  ///< every floating-point operation (2 per MAC, plus elementwise)

  /// Adds other's counts to these.
  FlopCount& operator+=(const FlopCount& other) {
    macs += other.macs;
    flops += other.flops;
    return *this;
  }
  /// Two counts are equal when both fields are.
  bool operator==(const FlopCount&) const = default;
};

/// A matrix product of rows x in by in x out: rows*in*out MACs, 2 FLOPs each.
inline FlopCount matmul_flops(std::int64_t rows, std::int64_t in, std::int64_t out) {
  const std::int64_t macs = rows * in * out;
  return {macs, 2 * macs};
}
/// per_element FLOPs on each of elements values (no MACs).
inline FlopCount elementwise_flops(std::int64_t elements, std::int64_t per_element = 1) {
  return {0, elements * per_element};
}

/// What a layer's forward saw, for counting its FLOPs afterwards.
struct FlopInput {
  Shape input;               ///< the activation entering the layer (rank 0: an input layer)
  std::int64_t batch = 0;    ///< micro-batch rows B
  std::int64_t seq_len = 0;  ///< sequence length T
};

}  // namespace zero::nn
