#pragma once
// ZeroStage<N>: which model states the engine shards over the data-parallel ranks.
//   0: nothing (DDP: all-reduce gradients)     1: optimizer states (and the fp32 master)
//   2: + gradients (reduce-scattered per unit)  3: + parameters (gathered per unit when used)

namespace zero {

/// Tag that every ZeroStage<N> carries, so policy lookup can find it.
struct zero_stage_policy {};

/// Policy tag selecting the ZeRO stage.
template <int N>
struct ZeroStage {
  static_assert(N >= 0 && N <= 3, "zero::ZeroStage<N>: N must be 0, 1, 2 or 3");
  using kind = zero_stage_policy;
  static constexpr int stage = N;
};

}  // namespace zero
