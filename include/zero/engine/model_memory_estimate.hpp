#pragma once
// The memory estimator's input for the units a model gives one rank, before any engine exists:
// the units an Engine<M, ZeroStage<stage>> over that rank's groups would allocate, each padded
// as its UnitPartition pads it and sharded over its own group (an expert unit over the expert
// data-parallel group), with the engine's options (stage 3's persistent and gathered units,
// pending reductions, hybrid sharding's and hpZ's groups, LoCo's kept errors). The engine's own
// memory_estimate_input() counts its units through the same MemoryEstimateInput::add_unit and
// apply_options, so the two agree by construction; tests/engine/test_model_memory_estimate.cpp
// checks both against memory_report().
//
// A model split over tensor, pipeline or expert parallelism is sized without its groups by
// building it over shape-only groups (parallel::TensorParallel::shape_only,
// parallel::ExpertParallel::shape_only: a model's layers hold no parameter memory of their own,
// so this is cheap even for billions of parameters), and a pipeline rank's part by its
// StageModel over the same partition PipelineEngine makes (parallel::pipeline::partition_model):
//
//   nn::GPT<float> model(cfg, parallel::TensorParallel::shape_only(tp, 0));
//   const auto part = parallel::pipeline::partition_model(model, "parameters", pp, 1);
//   parallel::pipeline::StageModel<nn::GPT<float>> stage0(model, part, 0, pp);
//   auto in = engine::model_estimate_input(stage0, 3, engine::shard_groups_of(grid, options),
//                                          options);
//   const engine::MemoryEstimate e = engine::estimate_model_states(in);

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <parallel/topology.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/memory_estimator.hpp>
#include <zero/engine/partition.hpp>
#include <zero/engine/unit_storage.hpp>
#include <zero/nn/model.hpp>

namespace zero::engine {

/// The sizes of the groups ZeRO shards a rank's units over (EngineGroups' rules, by size).
struct ShardGroups {
  int dense = 1;    ///< dense units: the data-parallel group (ep x dp, x cp under Ulysses)
  int experts = 1;  ///< expert units: the expert data-parallel group (dp, x cp)
  /// Stage 3 under hpZ: the secondary groups a unit's backward gathers from (0: none, as when
  /// the group is no larger than hpz_size).
  int dense_secondary = 0, experts_secondary = 0;
};

/// The shard groups of a rank in grid (tp x cp x ep x dp x pp) under options' hybrid sharding
/// (shard_size) or hpZ (hpz_size), as EngineGroups splits them. ConfigError naming the option
/// when its size does not divide a group it splits, or when both are set.
inline ShardGroups shard_groups_of(const parallel::GridSizes& grid, const EngineOptions& options) {
  ShardGroups g;
  g.experts = grid.dp * grid.cp;
  g.dense = g.experts * grid.ep;
  const auto divides = [](int size, int group, const char* option, const char* role) {
    expect<ConfigError>(size > 0 && group % size == 0, option, " ", size, " must divide the ",
                        group, " ranks of the ", role, " group ZeRO shards over");
  };
  expect<ConfigError>(options.shard_size == 0 || options.hpz_size <= 1,
                      "hpz_size (ZeRO++ hpZ) and shard_size (hybrid sharding, mics_shard_size) "
                      "both keep gathers inside groups of ranks; set one");
  if (options.shard_size > 0) {
    const char* option = "shard_size (zero_optimization.mics_shard_size)";
    divides(options.shard_size, g.dense, option, "dp");
    g.dense = options.shard_size;
    if (grid.ep > 1) {
      divides(options.shard_size, g.experts, option, "expert-dp");
      g.experts = options.shard_size;
    }
  }
  if (options.hpz_size > 1) {
    const char* option = "hpz_size (zero_optimization.zero_hpz_partition_size)";
    divides(options.hpz_size, g.dense, option, "dp");
    if (options.hpz_size < g.dense) g.dense_secondary = options.hpz_size;
    if (grid.ep > 1 && g.experts > options.hpz_size) {
      divides(options.hpz_size, g.experts, option, "expert-dp");
      g.experts_secondary = options.hpz_size;
    }
  }
  if (grid.ep == 1) {  // no expert data-parallel group: expert units shard as dense ones
    g.experts = g.dense;
    g.experts_secondary = g.dense_secondary;
  }
  return g;
}

/// Sets what the engine's options decide beyond the units themselves: stage 3's gathered units
/// (from in.largest_unit_params and `units`), stages 2-3's pending reductions, and
/// Offload<CPU>'s delayed update and device gradient accumulator. Call after the units.
inline void apply_options(MemoryEstimateInput& in, const EngineOptions& options, int units) {
  in.live_units = in.stage == 3 ? stage3_live_units(in.largest_unit_params, units,
                                                    options.prefetch_elems, options.max_live_elems)
                                : 1;
  in.pending_reductions = in.stage >= 2 ? options.max_pending_reductions : 0;
  in.delayed_update = options.delayed_param_update;
  in.device_grad_accumulator = options.accumulate_grads_on_device;
}

/// The estimator's input for model's units on one rank at ZeRO stage `stage`, sharded over
/// groups (see the file comment). The precision, master type, optimizer-state bytes and
/// offload keep their defaults (bf16, f32, Adam's 8, none): set them on the result. Under ZeRO++
/// LoCo (options.loco) each unit's kept errors are counted as UnitExchange keeps them: its whole
/// gradient's runs block-wise int8, and under hpZ's two hops its partial sums' runs too.
template <nn::Model M>
MemoryEstimateInput model_estimate_input(const M& model, int stage, const ShardGroups& groups,
                                         const EngineOptions& options) {
  expect<ConfigError>(stage >= 0 && stage <= 3, "model_estimate_input: stage ", stage,
                      " is not 0-3");
  expect<ConfigError>(groups.dense >= 1 && groups.experts >= 1,
                      "model_estimate_input: group sizes must be positive");
  MemoryEstimateInput in;
  in.stage = stage;
  in.gpus_per_node = groups.dense;
  const int units = model.num_units();
  std::vector<UnitPartition> parts;
  std::vector<bool> expert(static_cast<std::size_t>(units), false);
  std::vector<std::int64_t> shards;
  for (int u = 0; u < units; ++u) {
    if constexpr (nn::HasExpertUnits<M>)
      expert[static_cast<std::size_t>(u)] = model.unit_is_expert(u);
    const int group = expert[static_cast<std::size_t>(u)] ? groups.experts : groups.dense;
    parts.emplace_back(model.unit_params(u), group, options.shard_alignment);
    shards.push_back(parts.back().shard_numel());
  }
  // Offload<CPU>'s offload_ratio keeps the last units' states on the device (the engine's rule).
  const std::vector<bool> kept = units_kept_on_device(shards, options.offload_ratio);
  for (int u = 0; u < units; ++u) {
    const auto i = static_cast<std::size_t>(u);
    const UnitPartition& p = parts[i];
    const int group = expert[i] ? groups.experts : groups.dense;
    const bool persistent = stage < 3 || p.numel() <= options.persistence_threshold;
    const int secondary = expert[i] ? groups.experts_secondary : groups.dense_secondary;
    in.add_unit(p.padded_numel(), group, persistent, secondary, kept[i]);
    if (options.loco) {
      // qgZ's second hop runs across the secondary groups (EngineGroups::secondary_within).
      const int across = secondary > 0 && options.quantized_gradients ? group / secondary : 0;
      in.kept_error_bytes += static_cast<double>(loco_kept_error_bytes(p.shard_numel(), group) +
                                                 loco_kept_error_bytes(p.shard_numel(), across));
    }
  }
  apply_options(in, options, units);
  return in;
}

}  // namespace zero::engine
