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
//
// Given a model template and the precisions a program supports, dispatch also picks the
// compute type from fp16.enabled / bf16.enabled (each precision listed multiplies the engines
// instantiated, so a program lists only those it runs); E::model_type is then the model to build:
//
//   zero::dispatch<nn::GPT, zero::Precisions<float, bf16>>(cfg, [&]<class E>(std::type_identity<E>)
//   {
//     typename E::model_type model(gpt_config);
//     ...
//   });

#include <string>
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
                        "puts the optimizer or the parameters on ",
                        name_of(offload_device_of<typename Extra::where>),
                        "); use stage 1, 2 or 3");
  }
  if (stage == 1) return with(std::integral_constant<int, 1>{});
  if (stage == 2) return with(std::integral_constant<int, 2>{});
  return with(std::integral_constant<int, 3>{});
}
}  // namespace detail

/// Calls fn(std::type_identity<Engine<M, ZeroStage<s>, Fixed...>>{}) for the config's stage s.
/// When Fixed names no Offload policy, the model trains in fp32 or lower, and the config puts
/// the optimizer or the parameters on NVMe, the engine gets Offload<NVMe> as well (stages 1-3;
/// a ConfigError when Fixed computes on a device);
/// when it puts them on the cpu and Fixed computes on a device (Compute<Cuda>), Offload<CPU>
/// (on the host, where the states already live, it needs none).
template <nn::Model M, class... Fixed, class Fn>
decltype(auto) dispatch(const Config& config, Fn&& fn) {
  constexpr bool may_offload = count_policies<offload_policy, Fixed...> == 0 &&
                               !std::is_same_v<typename M::value_type, double>;
  using device = typename find_policy_t<compute_policy, Compute<Host>, Fixed...>::device;
  if constexpr (may_offload) {
    const auto& z = config.zero_optimization;
    const auto asks = [&](OffloadDevice d) {
      return z.offload_optimizer.device == d || z.offload_param.device == d;
    };
    if (asks(OffloadDevice::nvme)) {
      if constexpr (std::is_same_v<device, Host>) {
        return detail::dispatch_stage<M, Offload<NVMe>, Fixed...>(config, std::forward<Fn>(fn));
      } else {
        raise<ConfigError>(
            "zero_optimization.offload_optimizer/offload_param.device: nvme swaps the states of "
            "a host engine; on a device engine use cpu (Offload<CPU>) or none");
      }
    }
    if constexpr (!std::is_same_v<device, Host>) {
      if (asks(OffloadDevice::cpu)) {
        return detail::dispatch_stage<M, Offload<CPU>, Fixed...>(config, std::forward<Fn>(fn));
      }
    }
  }
  return detail::dispatch_stage<M, void, Fixed...>(config, std::forward<Fn>(fn));
}

/// The compute types a program instantiates engines for (the first serves "auto").
template <class... Ts>
struct Precisions {};

namespace detail {
/// The engines of compute type T: ModelOf<T>, with Precision<T> unless T is f32 (the default).
template <template <class> class ModelOf, class T, class... Fixed, class Fn>
decltype(auto) dispatch_as(const Config& config, Fn&& fn) {
  if constexpr (std::is_same_v<T, float>) {
    return dispatch<ModelOf<T>, Fixed...>(config, std::forward<Fn>(fn));
  } else {
    return dispatch<ModelOf<T>, Precision<T>, Fixed...>(config, std::forward<Fn>(fn));
  }
}

/// Tries T, then Rest..., for the compute type want; ConfigError naming key when none is it.
template <template <class> class ModelOf, class... Fixed, class Fn, class T, class... Rest>
decltype(auto) dispatch_precision(const Config& config, DType want, const char* key,
                                  const std::string& listed, Fn&& fn, std::type_identity<T>,
                                  std::type_identity<Rest>... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    expect<ConfigError>(want == dtype_of<T>, key, ": the config asks for ", name_of(want),
                        " but this program instantiates engines for ", listed, " only");
    return dispatch_as<ModelOf, T, Fixed...>(config, std::forward<Fn>(fn));
  } else {
    if (want == dtype_of<T>) return dispatch_as<ModelOf, T, Fixed...>(config, std::forward<Fn>(fn));
    return dispatch_precision<ModelOf, Fixed...>(config, want, key, listed, std::forward<Fn>(fn),
                                                 rest...);
  }
}
}  // namespace detail

/// Calls fn(std::type_identity<Engine<ModelOf<T>, ZeroStage<s>, [Precision<T>,] Fixed...>>{}) for
/// the config's stage s and compute type T: f16 when fp16.enabled, bf16 when bf16.enabled, f32
/// when neither is true (both "auto": the first of Ts). ConfigError when T is not among Ts.
template <template <class> class ModelOf, class Ps, class... Fixed, class Fn>
decltype(auto) dispatch(const Config& config, Fn&& fn) {
  return [&]<class... Ts>(Precisions<Ts...>) -> decltype(auto) {
    static_assert(sizeof...(Ts) > 0, "zero::dispatch: Precisions<...> lists no compute type");
    std::string listed;
    for (DType d : {dtype_of<Ts>...})
      listed += (listed.empty() ? "" : ", ") + std::string(name_of(d));
    const bool fp16 = config.fp16.enabled.value_or(false);
    const bool bf16_on = config.bf16_enabled.value_or(false);
    const bool all_auto = !config.fp16.enabled && !config.bf16_enabled;
    const DType first[] = {dtype_of<Ts>...};
    const DType want = all_auto ? first[0] : fp16 ? DType::f16 : bf16_on ? DType::bf16 : DType::f32;
    const char* key = fp16      ? "fp16.enabled"
                      : bf16_on ? "bf16.enabled"
                                : "fp16.enabled/bf16.enabled";
    return detail::dispatch_precision<ModelOf, Fixed...>(
        config, want, key, listed, std::forward<Fn>(fn), std::type_identity<Ts>{}...);
  }(Ps{});
}

}  // namespace zero
