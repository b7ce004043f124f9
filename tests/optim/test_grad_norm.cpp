// The one-pass gradient statistics: sum of squares against a long-double reference, identical
// bits on every ISA and thread count, the inf/NaN flag wherever the bad element sits, and
// DeepSpeed's clip coefficient.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include <optim/grad_norm.hpp>

#include "optim_test_util.hpp"

namespace {
using namespace zero::optim;
using zero::bf16;
using zero::f16;

std::vector<Isa> all_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

template <class T>
long double reference_sum(const std::vector<T>& g) {
  long double s = 0.0L;
  for (const T& x : g) {
    const long double v = zero::convert<float>(x);
    s += v * v;
  }
  return s;
}
}  // namespace

TEST_CASE("grad_stats: sum of squares is accurate and bitwise stable", "[unit][optim]") {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{8192},
                        std::size_t{3 * 8192 + 21}}) {
    const auto g = optim_test::make_data(n, 77, 3.0);
    const auto gb = optim_test::convert_all<bf16>(g);
    const auto gh = optim_test::convert_all<f16>(g);
    const GradStats ref32 = grad_stats<float>(g, {Isa::scalar, 1});
    const GradStats refb = grad_stats<bf16>(gb, {Isa::scalar, 1});
    const GradStats refh = grad_stats<f16>(gh, {Isa::scalar, 1});
    CHECK(ref32.finite);
    CHECK(std::fabs(ref32.sum_sq - static_cast<double>(reference_sum(g))) <=
          1e-13 * (1.0 + ref32.sum_sq));
    CHECK(std::fabs(refb.sum_sq - static_cast<double>(reference_sum(gb))) <=
          1e-13 * (1.0 + refb.sum_sq));
    CHECK(std::fabs(refh.sum_sq - static_cast<double>(reference_sum(gh))) <=
          1e-13 * (1.0 + refh.sum_sq));
    for (Isa isa : all_isas()) {
      for (int threads : {1, 2, 3}) {
        INFO("n " << n << " isa " << name_of(isa) << " threads " << threads);
        CHECK(grad_stats<float>(g, {isa, threads}).sum_sq == ref32.sum_sq);
        CHECK(grad_stats<bf16>(gb, {isa, threads}).sum_sq == refb.sum_sq);
        CHECK(grad_stats<f16>(gh, {isa, threads}).sum_sq == refh.sum_sq);
      }
    }
  }
}

TEST_CASE("grad_stats: detects Inf and NaN anywhere, in every format", "[unit][optim]") {
  const std::size_t n = 2 * 8192 + 19;
  for (std::size_t where : {std::size_t{0}, std::size_t{5}, std::size_t{8200}, n - 1}) {
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      auto g = optim_test::make_data(n, 3, 1.0);
      g[where] = bad;
      const auto gb = optim_test::convert_all<bf16>(g);
      const auto gh = optim_test::convert_all<f16>(g);
      for (Isa isa : all_isas()) {
        INFO("position " << where << " value " << bad << " isa " << name_of(isa));
        CHECK_FALSE(grad_stats<float>(g, {isa, 2}).finite);
        CHECK_FALSE(grad_stats<bf16>(gb, {isa, 2}).finite);
        CHECK_FALSE(grad_stats<f16>(gh, {isa, 2}).finite);
      }
    }
  }
  // The largest finite values do not overflow the double accumulation.
  std::vector<float> big(1000, std::numeric_limits<float>::max());
  CHECK(grad_stats<float>(big).finite);
  // A value that overflows only when converted to f16 is caught in the f16 gradient.
  std::vector<f16> h(10, f16(1.0f));
  h[4] = f16(70000.0f);
  CHECK_FALSE(grad_stats<f16>(h).finite);
}

TEST_CASE("Global norm and DeepSpeed's clip coefficient", "[unit][optim]") {
  GradStats a{9.0, true}, b{16.0, true};
  a += b;
  CHECK(global_norm(a) == 5.0);
  CHECK(global_norm(a, 2.0) == 2.5);  // stats of loss-scaled gradients, unscaled
  CHECK(clip_coefficient(5.0, 1.0) == Approx(1.0 / (5.0 + 1e-6)).epsilon(1e-15));
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(5.0, 0.0) == 1.0);  // gradient_clipping 0: off
  CHECK(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0) == 1.0);
  GradStats bad{1.0, false};
  a += bad;
  CHECK_FALSE(a.finite);
}
