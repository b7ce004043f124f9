#pragma once
// The constants of GELU's tanh approximation (GPT-2), shared by the host kernels
// (zero/ops/cpu/gelu.hpp) and the device kernels (zero/ops/cuda/gelu.cuh), so both evaluate
//   y = 0.5 x (1 + tanh(gelu_s (x + gelu_c x^3)))
// with the same float constants.

namespace zero::ops {

/// sqrt(2 / pi), rounded to float (0x3F4C422A; std::sqrt(2.0f / pi_v<float>) is an ulp below).
inline constexpr float gelu_s = 0.7978845608028654f;
/// The cubic term's coefficient.
inline constexpr float gelu_c = 0.044715f;

}  // namespace zero::ops
