// nn::Sampler: greedy at temperature 0, top-k keeps only the k largest logits, the frequencies
// follow softmax(logits / temperature), and a seed gives the same draws.
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/bfloat16.hpp>
#include <zero/core/float16.hpp>
#include <zero/nn/sampler.hpp>

using zero::nn::Sampler;

TEST_CASE("Sampler at temperature 0 is argmax, ties to the smaller id", "[unit][nn]") {
  const std::array<float, 5> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  Sampler greedy(0.0, 0, 7);
  for (int i = 0; i < 3; ++i) CHECK(greedy.next(std::span<const float>(logits)) == 1);
  CHECK(greedy.draws() == 0);
}

TEST_CASE("Sampler takes bf16 and f16 logits as the model's output holds them", "[unit][nn]") {
  // static_cast<double> of a half type did not compile (its conversion to float is explicit).
  const std::array<float, 4> values = {0.25f, -1.0f, 3.0f, 3.0f};
  std::array<zero::bf16, 4> b{};
  std::array<zero::f16, 4> h{};
  for (std::size_t i = 0; i < values.size(); ++i) {
    b[i] = zero::bf16(values[i]);
    h[i] = zero::f16(values[i]);
  }
  Sampler greedy(0.0, 0, 7);
  CHECK(greedy.next(std::span<const zero::bf16>(b)) == 2);
  CHECK(greedy.next(std::span<const zero::f16>(h)) == 2);
  Sampler top1(1.0, 1, 7);  // one survivor: the draw cannot pick another
  CHECK(top1.next(std::span<const zero::bf16>(b)) == 2);
}

TEST_CASE("Sampler draws only from the top k and follows the softmax at the temperature",
          "[unit][nn]") {
  const std::array<double, 4> logits = {1.0, 3.0, 2.0, 0.0};
  const double temperature = 0.5;
  Sampler sampler(temperature, 2, 1234);
  std::array<int, 4> counts{};
  const int n = 20000;
  for (int i = 0; i < n; ++i)
    ++counts[static_cast<std::size_t>(sampler.next(std::span<const double>(logits)))];
  CHECK(counts[0] == 0);  // outside the top 2
  CHECK(counts[3] == 0);
  // p(1) / p(2) = exp((3 - 2) / 0.5) = e^2, so p(1) = e^2 / (1 + e^2) = 0.8808
  const double expected = std::exp(2.0) / (1 + std::exp(2.0));
  const double seen = static_cast<double>(counts[1]) / n;
  CHECK(std::abs(seen - expected) < 0.01);  // 4.4 sigma of a binomial at n = 20000
  // negative control: at temperature 1 the same logits give p(1) = e / (1 + e) = 0.731
  CHECK(std::abs(seen - std::exp(1.0) / (1 + std::exp(1.0))) > 0.1);
}

TEST_CASE("Sampler with the same seed draws the same tokens, another seed differs", "[unit][nn]") {
  std::vector<float> logits(257);
  for (std::size_t i = 0; i < logits.size(); ++i)
    logits[i] = static_cast<float>(std::sin(i * 0.37));
  auto draw = [&](std::uint64_t seed) {
    Sampler s(0.8, 40, seed);
    std::vector<std::int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.next(std::span<const float>(logits)));
    return out;
  };
  CHECK(draw(1) == draw(1));
  CHECK(draw(1) != draw(2));
}

TEST_CASE("Sampler rejects a negative temperature or top_k", "[unit][nn]") {
  CHECK_THROWS_AS(Sampler(-0.1, 0, 1), zero::Error);
  CHECK_THROWS_AS(Sampler(1.0, -1, 1), zero::Error);
}

TEST_CASE("Sampler gives +inf logits all the mass and refuses NaN", "[unit][nn]") {
  Sampler s(1.0, 0, 7);
  const std::vector<float> inf{0.0f, INFINITY, 1.0f};
  for (int i = 0; i < 16; ++i) CHECK(s.next(std::span<const float>(inf)) == 1);
  const std::vector<float> two_inf{INFINITY, 0.0f, INFINITY};
  for (int i = 0; i < 16; ++i) CHECK(s.next(std::span<const float>(two_inf)) != 1);
  // Every token equally (im)possible: both are drawn (before, the NaN weights fell through to
  // the last survivor every time).
  const std::vector<float> none{-INFINITY, -INFINITY};
  std::array<int, 2> drawn{};
  for (int i = 0; i < 64; ++i)
    ++drawn[static_cast<std::size_t>(s.next(std::span<const float>(none)))];
  CHECK(drawn[0] > 0);
  CHECK(drawn[1] > 0);
  const std::vector<float> nan{0.0f, NAN, 1.0f};
  CHECK_THROWS_WITH(s.next(std::span<const float>(nan)), Catch::Contains("logit 1 is NaN"));
}
