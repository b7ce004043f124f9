#pragma once
// EnginePolicies<Model, Policies...>: the engine's policy set with defaults for absent tags and
// the combinations that cannot work rejected at compile time with a readable message.
//   ZeroStage<0>, Precision<f32>, Offload<None>, Compute<Host> are the defaults. An f64 model is
//   the reference configuration: it keeps an f64 master and takes no Precision tag.

#include <type_traits>

#include <zero/core/dtype.hpp>
#include <zero/policies/compute.hpp>
#include <zero/policies/offload.hpp>
#include <zero/policies/policy_list.hpp>
#include <zero/policies/precision.hpp>
#include <zero/policies/zero_stage.hpp>

namespace zero::engine {

/// The resolved policies of Engine<Model, Policies...>.
/// True when Kind is one of the policy kinds the engine reads.
template <class Kind>
inline constexpr bool engine_policy_kind =
    std::is_same_v<Kind, zero_stage_policy> || std::is_same_v<Kind, precision_policy> ||
    std::is_same_v<Kind, offload_policy> || std::is_same_v<Kind, compute_policy>;

namespace detail {
template <class P>
constexpr bool known_engine_policy() {
  if constexpr (PolicyTag<P>) {
    return engine_policy_kind<typename P::kind>;
  } else {
    return true;  // find_policy reports a type that is not a policy tag at all
  }
}
}  // namespace detail

template <class Model, class... Policies>
struct EnginePolicies {
  static_assert((detail::known_engine_policy<Policies>() && ...),
                "zero::Engine: a policy tag has a kind the engine does not know (expected "
                "ZeroStage<N>, Precision<T>, Offload<Where> or Compute<Device>); it would be "
                "ignored, so it is an error");
  using value_type = typename Model::value_type;
  static constexpr bool reference_model = std::is_same_v<value_type, double>;

  using stage_policy = find_policy_t<zero_stage_policy, ZeroStage<0>, Policies...>;
  using precision_policy_t = find_policy_t<precision_policy, Precision<f32>, Policies...>;
  using offload_policy_t = find_policy_t<offload_policy, Offload<None>, Policies...>;
  using compute_policy_t = find_policy_t<compute_policy, Compute<Host>, Policies...>;

  static constexpr int stage = stage_policy::stage;
  using precision = typename precision_policy_t::type;  ///< f32, bf16 or f16
  using offload = typename offload_policy_t::where;     ///< None, CPU or NVMe
  using compute = typename compute_policy_t::device;    ///< Host or Cuda
  /// Element type of the master weights, optimizer states and gradient accumulators.
  using master_type = std::conditional_t<reference_model, double, float>;

  static_assert(std::is_same_v<precision, value_type> ||
                    (reference_model && count_policies<zero::precision_policy, Policies...> == 0),
                "zero::Engine: Precision<T> must match the model's value_type (nn::GPT<bf16> "
                "computes with Precision<bf16>); an f64 reference model takes no Precision tag");
  // Compute<Device> resolves to a backend (backend.hpp); a device without one stops there.
  static_assert(!std::is_same_v<offload, CPU> || !std::is_same_v<compute, Host>,
                "zero::Engine: Offload<CPU> moves optimizer state from the GPU to host memory; "
                "with Compute<Host> it already lives there, so use Offload<None>");
  static_assert(std::is_same_v<offload, None> || stage >= 1,
                "zero::Engine: offloading needs ZeroStage<1> or higher (optimizer states are "
                "partitioned before they are offloaded), as in DeepSpeed");
  static_assert(!std::is_same_v<offload, NVMe> || !reference_model,
                "zero::Engine: Offload<NVMe> swaps fp32 optimizer states; an f64 model has none");
  static_assert(!std::is_same_v<offload, NVMe> || std::is_same_v<compute, Host>,
                "zero::Engine: Offload<NVMe> runs on Compute<Host> only: its swap buffers and "
                "host optimizer read the gradient shard in host memory, which Compute<Cuda> "
                "keeps on the device; on a GPU use Offload<CPU>");
};

}  // namespace zero::engine
