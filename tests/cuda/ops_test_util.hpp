#pragma once
// Helpers of the [cuda] kernel tests: device copies of host vectors, random inputs, and the
// comparison rules every kernel test uses against its host twin.
//   f32:       |got - ref| <= rel * (|ref| + mean|ref|)       (rel 1e-5 unless a test says why)
//   bf16/f16:  |got - ref| <= ulps * ulp(|ref| + mean|ref|)    (2 ulps unless a test says why)
// The tensor's mean magnitude in both bounds keeps values that cancel to near zero (a sum of
// terms of either sign computed in another order) from demanding a relative accuracy the inputs
// never had; everything else is held to the stated relative bound.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <zero/core/buffer.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/dtype.hpp>

#include "../support/worse.hpp"

namespace zero::test {

/// Sets an environment variable for a scope, and unsets it at the end of the scope (a failed
/// check must not leave it to the cases after it).
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  const char* name;
};

/// A device copy of a host vector (at least one element, so pointers are never null).
template <class T>
class DeviceVector {
 public:
  explicit DeviceVector(std::size_t n) : size_(n), buf_(std::max<std::size_t>(n, 1)) {}
  explicit DeviceVector(const std::vector<T>& h) : DeviceVector(h.size()) { upload(h); }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == size_);
    ZERO_CUDA_CHECK(
        cudaMemcpy(buf_.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(size_);
    ZERO_CUDA_CHECK(cudaMemcpy(h.data(), buf_.data(), size_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  T* get() { return buf_.data(); }
  const T* get() const { return buf_.data(); }
  std::size_t size() const { return size_; }

 private:
  std::size_t size_;
  Buffer<T, Cuda> buf_;
};

/// n values uniform in [lo, hi), rounded to T, from seed.
template <class T>
std::vector<T> random_vector(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = convert<T>(dist(gen));
  return v;
}

/// The value of x as float.
template <class T>
float as_float(T x) {
  return convert<float>(x);
}

/// The spacing of T's values at magnitude x (one ulp).
template <class T>
double ulp_at(double x) {
  constexpr int mantissa = std::is_same_v<T, bf16> ? 7 : 10;
  constexpr int min_exponent = std::is_same_v<T, bf16> ? -126 : -14;
  const int e =
      x > 0 ? std::max(static_cast<int>(std::floor(std::log2(x))), min_exponent) : min_exponent;
  return std::ldexp(1.0, e - mantissa);
}

/// Compares got to ref element by element under the rules above; rel is used for f32, ulps for
/// the 16-bit types. magnitude_floor raises the mean magnitude that every bound includes, for
/// results that cancel far below their inputs' size. Reports the first mismatches and CHECKs
/// that there are none.
template <class T>
void check_close(const std::vector<T>& got, const std::vector<T>& ref, const std::string& what,
                 double rel = 1e-5, double ulps = 2.0, double magnitude_floor = 0.0) {
  REQUIRE(got.size() == ref.size());
  double mean_abs = 0.0;
  for (const T& r : ref) mean_abs += std::fabs(as_float(r));
  mean_abs = ref.empty() ? 0.0 : mean_abs / static_cast<double>(ref.size());
  mean_abs = std::max(mean_abs, magnitude_floor);
  std::size_t bad = 0;
  std::string first;
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = as_float(got[i]), r = as_float(ref[i]);
    const double scale = std::fabs(r) + mean_abs;
    const double bound = std::is_same_v<T, float> ? rel * scale : ulps * ulp_at<T>(scale);
    const double diff = std::fabs(g - r);
    const bool ok = diff <= bound || (std::isnan(g) && std::isnan(r)) || g == r;
    if (!ok) {
      if (bad < 5) {
        first += " [" + std::to_string(i) + "] got " + std::to_string(g) + " want " +
                 std::to_string(r) + ";";
      }
      ++bad;
    }
    if (bound > 0) worst = zero::testing::worse(worst, diff / bound);
  }
  INFO(what << ": " << bad << " of " << ref.size() << " outside the bound (worst at " << worst
            << " of the bound):" << first);
  CHECK(bad == 0);
}

/// True when a and b hold the same bits.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace zero::test
