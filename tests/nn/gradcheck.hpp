#pragma once
// Central finite differences in f64 for gradient checks.
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "../support/worse.hpp"

namespace zero::testing {

/// Random values in [-scale, scale] from a fixed seed.
inline std::vector<double> random_vector(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

/// Largest relative error between analytic[i] and the central difference of loss() in x[i]
/// (x is perturbed in place and restored), with the error relative to max(|a|, |n|, floor).
inline double max_gradient_error(std::vector<double>& x, const std::vector<double>& analytic,
                                 const std::function<double()>& loss, double eps = 1e-5,
                                 double floor = 1e-3) {
  REQUIRE(x.size() == analytic.size());
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * eps);
    const double scale = std::max({std::fabs(numeric), std::fabs(analytic[i]), floor});
    worst = zero::testing::worse(worst, std::fabs(numeric - analytic[i]) / scale);
  }
  return worst;
}

/// sum_i out[i] * weights[i]: a scalar whose gradient with respect to out is weights.
inline double weighted_sum(const std::vector<double>& out, const std::vector<double>& weights) {
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * weights[i];
  return s;
}

}  // namespace zero::testing
