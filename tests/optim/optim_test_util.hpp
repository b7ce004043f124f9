#pragma once
// Shared helpers of the optimizer tests: deterministic data with awkward values, bitwise
// comparison that treats any two NaNs as equal (NaN payloads are not specified by IEEE).

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/core/rng.hpp>

namespace optim_test {

// Normal(0, scale) values from a counter RNG, with zeros, signed zeros and denormals sprinkled
// in at fixed positions when awkward is true.
inline std::vector<float> make_data(std::size_t n, std::uint64_t seed, double scale,
                                    bool awkward = true) {
  zero::CounterRng rng(seed);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(scale * rng.normal(i));
    if (awkward) {
      switch (i % 23) {
        case 3:
          out[i] = 0.0f;
          break;
        case 7:
          out[i] = -0.0f;
          break;
        case 11:
          out[i] = 1.5e-40f;
          break;  // denormal
        case 13:
          out[i] = -3.0e-39f;
          break;  // denormal
        case 17:
          out[i] = 1e-30f;
          break;
        default:
          break;
      }
    }
  }
  return out;
}

// Non-negative data (second moments).
inline std::vector<float> make_positive(std::size_t n, std::uint64_t seed, double scale) {
  auto v = make_data(n, seed, scale);
  for (float& x : v) x = std::fabs(x);
  return v;
}

template <class T>
std::vector<T> convert_all(const std::vector<float>& in) {
  std::vector<T> out(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = T(in[i]);
  return out;
}

// Number of positions where the bit patterns differ (two NaNs count as equal).
inline std::size_t count_bit_differences(const float* a, const float* b, std::size_t n) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) ++bad;
  }
  return bad;
}

// The same for 16-bit patterns of format bf16 (exponent 0xff) or f16 (exponent 0x1f).
inline std::size_t count_bit_differences16(const std::uint16_t* a, const std::uint16_t* b,
                                           std::size_t n, bool is_bf16) {
  const auto is_nan = [&](std::uint16_t x) {
    return is_bf16 ? (x & 0x7fffu) > 0x7f80u : (x & 0x7fffu) > 0x7c00u;
  };
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (is_nan(a[i]) && is_nan(b[i])) continue;
    if (a[i] != b[i]) ++bad;
  }
  return bad;
}

}  // namespace optim_test
