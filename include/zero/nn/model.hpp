#pragma once
// The Model concept: an ordered list of units with explicit forward and backward. The engine
// calls units in a static order (forward 0..U-1, backward U-1..0), so every rank issues the
// same collectives in the same order by construction.
// A model may also park its units (ParksPasses): move out what a unit's forward saved for its
// backward and put it back later, so a pipeline stage keeps several micro-batches in flight
// instead of recomputing their forwards.
// A model may also hold expert units (HasExpertUnits): units whose parameters are split over the
// expert-parallel group, each ep rank holding other experts (mixture of experts).

#include <any>
#include <concepts>
#include <span>
#include <utility>
#include <vector>

#include <zero/nn/context.hpp>
#include <zero/nn/param.hpp>

namespace zero::nn {

/// What the engine needs of a model.
template <class M>
concept Model = requires(M& m, const M& cm, int unit, StepContext<typename M::value_type>& ctx,
                         std::span<const ParamView<typename M::value_type>> views) {
  typename M::value_type;
  { cm.num_units() } -> std::convertible_to<int>;
  /// Parameters unit owns, in binding order.
  { cm.unit_params(unit) } -> std::same_as<std::vector<ParamSpec>>;
  /// Other units whose parameters unit reads (tied weights): they stay gathered while it runs,
  /// and their gradients are reduced only after unit's backward has accumulated into them.
  { cm.unit_uses(unit) } -> std::same_as<std::vector<int>>;
  m.bind_unit(unit, views);
  m.forward_unit(unit, ctx);
  m.backward_unit(unit, ctx);
};

/// Optional: a model whose units can park a pass. park_unit(u) moves out what unit u's last
/// forward kept for its backward (views into that pass's arena, the micro-batch's facts), and
/// resume_unit(u, saved) puts it back just before that backward; another micro-batch's forward
/// and backward may run in between. parks_unit(u) is false where some part of u cannot (a
/// user's layer that does not implement it): the engine then recomputes that pass instead.
template <class M>
concept ParksPasses = Model<M> && requires(M& m, const M& cm, int unit, std::any saved) {
  { cm.parks_unit(unit) } -> std::convertible_to<bool>;
  { m.park_unit(unit) } -> std::same_as<std::any>;
  m.resume_unit(unit, std::move(saved));
};

/// Optional: a model with expert units. unit_is_expert(u) is true where every parameter of unit u
/// belongs to this rank's experts, split over the expert-parallel group (so the ranks of that
/// group hold different values under the same names). The engine then shards the unit over the
/// expert data-parallel group (the ranks holding the same experts) instead of the data-parallel
/// group, and averages its gradient over the whole data-parallel group as DeepSpeed and Megatron
/// do (EngineGroups). Other units (the router, attention, embeddings) stay dense.
template <class M>
concept HasExpertUnits = Model<M> && requires(const M& cm, int unit) {
  { cm.unit_is_expert(unit) } -> std::convertible_to<bool>;
};

}  // namespace zero::nn
