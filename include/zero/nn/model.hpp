#pragma once
// The Model concept: an ordered list of units with explicit forward and backward. The engine
// calls units in a static order (forward 0..U-1, backward U-1..0), so every rank issues the
// same collectives in the same order by construction.

#include <concepts>
#include <span>
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

}  // namespace zero::nn
