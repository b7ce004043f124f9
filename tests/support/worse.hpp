#pragma once
// The larger of two error figures where a NaN wins: std::max(worst, NaN) keeps worst, so a NaN
// element, or a whole NaN result, would pass a comparison with a bound unseen. Once worst is NaN
// it stays NaN, and `worst <= bound` is false.
#include <cmath>

namespace zero::testing {

inline double worse(double worst, double value) {
  if (std::isnan(worst)) return worst;
  return std::isnan(value) || value > worst ? value : worst;
}

}  // namespace zero::testing
