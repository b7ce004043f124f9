#pragma once
// Precision<T>: the element type of the compute copy of the parameters, their gradients and the
// activations (f32, bf16 or f16). The master weights, the optimizer states and the gradient
// accumulators stay in fp32 whatever T is (f64 models keep an f64 master: the reference tests).

#include <type_traits>

#include <zero/core/dtype.hpp>

namespace zero {

/// Tag that every Precision<T> carries, so policy lookup can find it.
struct precision_policy {};

/// Policy tag selecting the compute precision.
template <class T>
struct Precision {
  static_assert(std::is_same_v<T, f32> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>,
                "zero::Precision<T>: T must be zero::f32, zero::bf16 or zero::f16");
  using kind = precision_policy;
  using type = T;  ///< compute element type
  /// True when gradients need a loss scale to stay representable (fp16 only).
  static constexpr bool needs_loss_scaling = std::is_same_v<T, f16>;
};

}  // namespace zero
