// The dispatched host kernels (ops/cpu/isa_dispatch.hpp): every vector path the CPU has gives
// the scalar path's bits on odd sizes (tails, several chunks), every path is within a few ulp of
// the double reference, and the float kernels do not depend on the thread count.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/vector_math.hpp>
#include "gradcheck.hpp"

using namespace zero::ops::cpu;
using zero::bf16;
using zero::testing::random_vector;

namespace {

// The vector ISAs this CPU and build run (none on other architectures or at -O0).
std::vector<Isa> vector_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (zero::optim::cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

// Runs fn under isa and restores the previous one.
template <class Fn>
auto with_isa(Isa isa, Fn&& fn) {
  const Isa before = set_host_isa(isa);
  struct Restore {
    Isa isa;
    ~Restore() { set_host_isa(isa); }
  } restore{before};
  return fn();
}

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = zero::convert<T>(static_cast<float>(v[i]));
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Forward and backward of GELU on x (dout fixed, dinp starting from start) under the current ISA.
template <class T>
std::vector<T> gelu_both(const std::vector<T>& x, const std::vector<T>& dout,
                         const std::vector<T>& start) {
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<T> out(x.size()), dinp = start;
  gelu_forward(out.data(), x.data(), n);
  gelu_backward(dinp.data(), x.data(), dout.data(), n);
  out.insert(out.end(), dinp.begin(), dinp.end());
  return out;
}

}  // namespace

TEST_CASE("exp over the op vocabulary: every ISA the same bits, within 2 ulp", "[unit][ops]") {
  std::vector<float> x;
  for (float v = -90.0f; v <= 90.0f; v += 0.0137f) x.push_back(v);
  std::vector<float> scalar(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    scalar[i] = vmath::exp<zero::optim::ScalarHostOps>(x[i]);
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(static_cast<double>(std::clamp(x[i], -87.0f, 88.0f)));
    INFO("x = " << x[i]);
    REQUIRE(std::abs(scalar[i] - ref) <= 2 * std::abs(ref) * 1.2e-7);
  }
  // The vector paths through GELU's forward: the same exp in every lane (checked by bits below).
}

TEST_CASE("gelu: every ISA gives the scalar path's bits, f32 / bf16, odd sizes", "[unit][ops]") {
  for (std::int64_t n : {1, 7, 15, 17, 33, 4095, 4097, 3 * 4096 + 5}) {
    const auto xd = random_vector(static_cast<std::size_t>(n), 21, 6.0);
    const auto gd = random_vector(static_cast<std::size_t>(n), 22);
    const auto sd = random_vector(static_cast<std::size_t>(n), 23);
    const auto x32 = as<float>(xd), g32 = as<float>(gd), s32 = as<float>(sd);
    const auto x16 = as<bf16>(xd), g16 = as<bf16>(gd), s16 = as<bf16>(sd);
    const auto ref32 = with_isa(Isa::scalar, [&] { return gelu_both(x32, g32, s32); });
    const auto ref16 = with_isa(Isa::scalar, [&] { return gelu_both(x16, g16, s16); });
    for (Isa isa : vector_isas()) {
      INFO("n " << n << " isa " << zero::optim::name_of(isa));
      CHECK(same_bits(with_isa(isa, [&] { return gelu_both(x32, g32, s32); }), ref32));
      CHECK(same_bits(with_isa(isa, [&] { return gelu_both(x16, g16, s16); }), ref16));
    }
  }
}

TEST_CASE("gelu f32 is within a few ulp of the double formula, large |x| included", "[unit][ops]") {
  std::vector<double> xd;
  for (double v = -12.0; v <= 12.0; v += 0.00731) xd.push_back(v);
  const auto n = static_cast<std::int64_t>(xd.size());
  const std::vector<double> ones(xd.size(), 1.0), zeros(xd.size(), 0.0);
  std::vector<double> yd(xd.size()), dd(xd.size(), 0.0);
  gelu_forward(yd.data(), xd.data(), n);
  gelu_backward(dd.data(), xd.data(), ones.data(), n);
  const auto x32 = as<float>(xd);
  const auto both = gelu_both(x32, as<float>(ones), as<float>(zeros));
  for (std::size_t i = 0; i < xd.size(); ++i) {
    INFO("x = " << xd[i]);
    // Relative to the value, with an absolute floor where y or y' pass through zero.
    CHECK(std::abs(both[i] - yd[i]) <= 4e-7 * std::abs(yd[i]) + 1e-7);
    CHECK(std::abs(both[xd.size() + i] - dd[i]) <= 4e-7 * std::abs(dd[i]) + 4e-7);
  }
}
