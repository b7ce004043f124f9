// Philox4x32-10 against Random123's known answers, and the property that matters for
// initialisation: a parameter's values depend on (seed, name, index) alone, so any split of the
// index range over ranks or threads reproduces the single-process values exactly.
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/buffer.hpp>
#include <zero/core/rng.hpp>

using namespace zero;

TEST_CASE("Philox4x32-10 matches Random123's known-answer vectors", "[unit][rng]") {
  using C = Philox4x32::Counter;
  using K = Philox4x32::Key;
  CHECK(Philox4x32::generate(C{0, 0, 0, 0}, K{0, 0}) ==
        C{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(Philox4x32::generate(C{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                             K{0xffffffff, 0xffffffff}) ==
        C{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(Philox4x32::generate(C{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                             K{0xa4093822, 0x299f31d0}) ==
        C{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
  STATIC_REQUIRE(Philox4x32::generate(C{0, 0, 0, 0}, K{0, 0})[0] == 0x6627e8d5);  // constexpr
}

TEST_CASE("Initialisation is the same for any split over ranks and threads", "[unit][rng]") {
  const CounterRng rng(CounterRng::key_for(1234, "transformer.h.0.attn.c_attn.weight"));
  const std::int64_t n = 10007;  // not a multiple of any rank count below
  Buffer<float> whole(n);
  fill_normal(whole.view(), rng, 0, 0.0, 0.02);
  for (int ranks : {2, 3, 4, 8}) {
    Buffer<float> parts(n);
    std::vector<std::thread> threads;
    const std::int64_t chunk = (n + ranks - 1) / ranks;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        const std::int64_t begin = std::min<std::int64_t>(n, r * chunk);
        const std::int64_t end = std::min<std::int64_t>(n, begin + chunk);
        fill_normal(parts.view().slice(begin, end - begin), rng, begin, 0.0, 0.02);
      });
    }
    for (auto& t : threads) t.join();
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(parts.view().at(i) == whole.view().at(i));
  }
}

TEST_CASE("Streams differ by name and seed and have the right moments", "[unit][rng]") {
  const auto a = CounterRng::key_for(1, "wte");
  CHECK(a != CounterRng::key_for(1, "wpe"));
  CHECK(a != CounterRng::key_for(2, "wte"));
  CHECK(a == CounterRng::key_for(1, "wte"));
  const CounterRng rng(a);
  const int n = 400000;
  double sum = 0, sum_sq = 0, usum = 0;
  double umin = 1, umax = 0;
  for (int i = 0; i < n; ++i) {
    const double z = rng.normal(static_cast<std::uint64_t>(i));
    sum += z;
    sum_sq += z * z;
    const double u = rng.uniform(static_cast<std::uint64_t>(i));
    usum += u;
    umin = std::min(umin, u);
    umax = std::max(umax, u);
  }
  // Standard errors: mean 1/sqrt(n) = 0.0016, variance sqrt(2/n) = 0.0022; allow 5 sigma.
  CHECK(std::fabs(sum / n) < 0.008);
  CHECK(std::fabs(sum_sq / n - 1.0) < 0.011);
  CHECK(std::fabs(usum / n - 0.5) < 0.003);
  CHECK(umin >= 0.0);
  CHECK(umax < 1.0);
  Buffer<double> u(1000);
  fill_uniform(u.view(), rng, 0, -3.0, -1.0);
  for (double v : u.view()) {
    REQUIRE(v >= -3.0);
    REQUIRE(v < -1.0);
  }
}
