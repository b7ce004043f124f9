#pragma once
// zero::dispatch: programs that take the ZeRO stage from the JSON (as DeepSpeed users do) still
// get compile-time engines: dispatch instantiates Engine<Model, ZeroStage<0..3>, Fixed...> and
// calls fn with std::type_identity of the one the config names.
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

/// Calls fn(std::type_identity<Engine<M, ZeroStage<s>, Fixed...>>{}) for the config's stage s.
template <nn::Model M, class... Fixed, class Fn>
decltype(auto) dispatch(const Config& config, Fn&& fn) {
  switch (config.zero_optimization.stage) {
    case 0: return fn(std::type_identity<engine::Engine<M, ZeroStage<0>, Fixed...>>{});
    case 1: return fn(std::type_identity<engine::Engine<M, ZeroStage<1>, Fixed...>>{});
    case 2: return fn(std::type_identity<engine::Engine<M, ZeroStage<2>, Fixed...>>{});
    case 3: return fn(std::type_identity<engine::Engine<M, ZeroStage<3>, Fixed...>>{});
    default:
      raise<ConfigError>("zero_optimization.stage: ", config.zero_optimization.stage,
                         " is not a ZeRO stage; expected 0, 1, 2 or 3");
  }
}

}  // namespace zero
