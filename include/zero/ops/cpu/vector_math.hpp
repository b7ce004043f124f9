#pragma once
// Transcendental functions over an Ops type (optim/cpu/vector_ops.hpp), written once for every
// lane width from the vocabulary's correctly rounded operations, so the scalar, AVX2 and AVX-512
// kernels that use them get the same bits (ops/cpu/isa_dispatch.hpp).

namespace zero::ops::cpu::vmath {

/// e^x, within 2 ulp of the exact value for x in [-87, 88] (Cephes' expf: x = n ln2 + r with
/// |r| <= ln2/2, a degree-7 polynomial for e^r, then the exponent n); x is clamped to that range,
/// and a NaN stays NaN (the clamp's min and max return their second operand, x, for a NaN x: a
/// NaN logit or score reaches its row's sum instead of passing as e^88).
template <class O, class V>
inline V exp(const V& in) {
  const V x = O::max(O::set1(-87.0f), O::min(O::set1(88.0f), in));
  const V n = O::round_nearest(O::mul(x, O::set1(1.44269504088896341f)));
  V r = O::fnma(n, O::set1(0.693359375f), x);  // ln2 split in two: the first part is exact
  r = O::fnma(n, O::set1(-2.12194440e-4f), r);
  V p = O::fma(O::set1(1.9875691500e-4f), r, O::set1(1.3981999507e-3f));
  p = O::fma(p, r, O::set1(8.3334519073e-3f));
  p = O::fma(p, r, O::set1(4.1665795894e-2f));
  p = O::fma(p, r, O::set1(1.6666665459e-1f));
  p = O::fma(p, r, O::set1(5.0000001201e-1f));
  p = O::fma(p, O::mul(r, r), r);
  return O::scale_pow2(O::add(p, O::set1(1.0f)), n);
}

}  // namespace zero::ops::cpu::vmath
