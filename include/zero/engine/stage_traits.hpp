#pragma once
// StageTraits<S>: what ZeRO stage S means for the engine's flow, as named facts. The engine
// tests these names instead of stage numbers, so each branch says why it exists:
//
//   stage | whole params kept | master+states | gradients                      | params
//   0     | yes               | whole         | whole, all-reduced at boundary  | whole
//   1     | yes               | sharded       | whole, reduce-scattered at bdry | whole,
//   re-gathered 2     | yes               | sharded       | sharded every micro-step        |
//   whole, re-gathered 3     | no                | sharded       | sharded every micro-step |
//   gathered per use

namespace zero::engine {

/// Named facts about ZeRO stage S (0-3).
template <int S>
struct StageTraits {
  static_assert(S >= 0 && S <= 3, "zero::engine::StageTraits<S>: S must be 0, 1, 2 or 3");
  static constexpr int stage = S;
  /// Every rank keeps every unit's whole parameters between steps (stages 0-2).
  static constexpr bool holds_whole_params = S <= 2;
  /// Each rank keeps only its slice of the fp32 master and optimizer states (stages 1-3).
  static constexpr bool shards_optimizer_states = S >= 1;
  /// Gradients are reduced into this rank's fp32 shard and the whole gradient is released
  /// (stages 2-3); otherwise a whole gradient accumulator lives across micro-steps.
  static constexpr bool shards_grads = S >= 2;
  /// Gradients are reduced after every micro-step's backward (stages 2-3), not only on the
  /// accumulation boundary.
  static constexpr bool reduces_every_micro_step = S >= 2;
  /// The reduction is an all-reduce of the whole gradient (stage 0); stages 1-3 reduce-scatter.
  static constexpr bool all_reduces_grads = S == 0;
  /// A unit's parameters are all-gathered before each use and released after it (stage 3).
  static constexpr bool gathers_before_use = S == 3;
  /// After an update each unit's parameters are all-gathered from the updated slices (stages
  /// 1-2, and at stage 3 the units kept gathered for the whole run).
  static constexpr bool regathers_after_update = S >= 1;
};

}  // namespace zero::engine
