#pragma once
// Policy lookup: Engine<Model, Policies...> takes policy tags in any order; each tag names its
// kind (`using kind = zero_stage_policy;` ...). find_policy_t<Kind, Default, Policies...> is the
// one tag of that kind, or Default when none is given. Two tags of one kind, or a type that is
// not a policy, are compile errors with a message that says so.

#include <type_traits>

namespace zero {

/// True when P is a policy tag (it declares its kind).
template <class P>
concept PolicyTag = requires {
  typename P::kind;
};

/// Number of Policies whose kind is Kind.
template <class Kind, class... Policies>
inline constexpr int count_policies = (0 + ... +
                                       (std::is_same_v<typename Policies::kind, Kind> ? 1 : 0));

namespace detail {

template <class Kind, class Default, class... Policies>
struct find_policy {
  using type = Default;
};
template <class Kind, class Default, class First, class... Rest>
struct find_policy<Kind, Default, First, Rest...> {
  using type = std::conditional_t<std::is_same_v<typename First::kind, Kind>, First,
                                  typename find_policy<Kind, Default, Rest...>::type>;
};

}  // namespace detail

/// The policy of kind Kind among Policies, or Default.
template <class Kind, class Default, class... Policies>
struct find_policy {
  static_assert((PolicyTag<Policies> && ...),
                "zero::Engine: every argument after the model must be a policy tag "
                "(ZeroStage<N>, Precision<T>, Offload<Where>, Compute<Device>)");
  static_assert(count_policies<Kind, Policies...> <= 1,
                "zero::Engine: a policy kind is given twice (e.g. two ZeroStage<> tags)");
  using type = typename detail::find_policy<Kind, Default, Policies...>::type;
};
/// The policy of kind Kind among Policies, or Default.
template <class Kind, class Default, class... Policies>
using find_policy_t = typename find_policy<Kind, Default, Policies...>::type;

}  // namespace zero
