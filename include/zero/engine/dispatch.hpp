#pragma once
// zero::dispatch: programs that take the ZeRO stage from the JSON (as DeepSpeed users do) still
// get compile-time engines: dispatch instantiates Engine<Model, ZeroStage<0..3>, Fixed...> (and,
// for fp32/bf16/f16 models, Engine<Model, ZeroStage<1..3>, Offload<NVMe>, Fixed...>) and calls fn
// with std::type_identity of the one the config names.
//
//   zero::dispatch<nn::GPT<float>>(cfg, [&]<class E>(std::type_identity<E>) {
//     E engine(model, comm, cfg);
//     ...
//   });

#include <type_traits>
#include <utility>

#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>

namespace zero {

namespace detail {
/// Engine<M, ZeroStage<s>, Extra, Fixed...> (no Extra when it is void) for the config's stage s.
template <nn::Model M, class Extra, class... Fixed, class Fn>
decltype(auto) dispatch_stage(const Config& config, Fn&& fn) {
  const int stage = config.zero_optimization.stage;
  expect<ConfigError>(stage >= 0 && stage <= 3, "zero_optimization.stage: ", stage,
                      " is not a ZeRO stage; expected 0, 1, 2 or 3");
  auto with = [&]<int S>(std::integral_constant<int, S>) -> decltype(auto) {
    if constexpr (std::is_same_v<Extra, void>) {
      return fn(std::type_identity<engine::Engine<M, ZeroStage<S>, Fixed...>>{});
    } else {
      return fn(std::type_identity<engine::Engine<M, ZeroStage<S>, Extra, Fixed...>>{});
    }
  };
  if constexpr (std::is_same_v<Extra, void>) {
    if (stage == 0) return with(std::integral_constant<int, 0>{});
  } else {
    expect<ConfigError>(stage != 0, "zero_optimization.stage: 0 cannot offload (the config ",
                        "puts the optimizer or the parameters on NVMe); use stage 1, 2 or 3");
  }
  if (stage == 1) return with(std::integral_constant<int, 1>{});
  if (stage == 2) return with(std::integral_constant<int, 2>{});
  return with(std::integral_constant<int, 3>{});
}
}  // namespace detail

/// Calls fn(std::type_identity<Engine<M, ZeroStage<s>, Fixed...>>{}) for the config's stage s.
/// When Fixed names no Offload policy, the model trains in fp32 or lower, and the config puts
/// the optimizer or the parameters on NVMe, the engine gets Offload<NVMe> as well (stages 1-3).
template <nn::Model M, class... Fixed, class Fn>
decltype(auto) dispatch(const Config& config, Fn&& fn) {
  constexpr bool may_offload = count_policies<offload_policy, Fixed...> == 0 &&
                               !std::is_same_v<typename M::value_type, double>;
  if constexpr (may_offload) {
    const auto& z = config.zero_optimization;
    if (z.offload_optimizer.device == OffloadDevice::nvme ||
        z.offload_param.device == OffloadDevice::nvme) {
      return detail::dispatch_stage<M, Offload<NVMe>, Fixed...>(config, std::forward<Fn>(fn));
    }
  }
  return detail::dispatch_stage<M, void, Fixed...>(config, std::forward<Fn>(fn));
}

}  // namespace zero
