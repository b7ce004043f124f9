#pragma once
// Sampler: picks the next token from a row of logits by temperature and top-k sampling, seeded so
// the same run prints the same text. Greedy decoding (argmax) of a small, briefly trained model
// falls into loops ("the the the"); sampling from the k most likely tokens at a temperature
// below 1 shows what the model learnt (word shapes, spacing, punctuation) without the loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>

namespace zero::nn {

/// Temperature / top-k sampling of token ids from logits, reproducible from a seed.
class Sampler {
 public:
  /// temperature 0 means greedy (argmax); top_k 0 means every token.
  Sampler(double temperature, int top_k, std::uint64_t seed)
      : temperature_(temperature), top_k_(top_k), rng_(CounterRng::key_for(seed, "sampler")) {
    expect<Error>(temperature >= 0 && std::isfinite(temperature), "Sampler: temperature ",
                  temperature, " must be finite and >= 0 (0 = greedy)");
    expect<Error>(top_k >= 0, "Sampler: top_k ", top_k, " must be >= 0 (0 = all tokens)");
  }

  /// The next token id from logits (one row, one entry per token); each call draws a new number.
  /// A NaN logit is an Error (a diverged model); +inf logits share all the probability.
  template <class T>
  std::int32_t next(std::span<const T> logits) {
    expect<Error>(!logits.empty(), "Sampler::next: no logits");
    for (std::size_t i = 0; i < logits.size(); ++i) {
      expect<Error>(!std::isnan(convert<double>(logits[i])), "Sampler::next: logit ", i,
                    " is NaN (has the model diverged?)");
    }
    std::vector<std::int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    auto larger = [&](std::int32_t a, std::int32_t b) {
      const auto la = convert<double>(logits[static_cast<std::size_t>(a)]);
      const auto lb = convert<double>(logits[static_cast<std::size_t>(b)]);
      return la > lb || (la == lb && a < b);  // ties to the smaller id, as argmax does
    };
    if (temperature_ == 0) return *std::min_element(ids.begin(), ids.end(), larger);
    const std::size_t k =
        top_k_ == 0 ? ids.size() : std::min(ids.size(), static_cast<std::size_t>(top_k_));
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), larger);
    ids.resize(k);
    // softmax over the k survivors, shifted by the largest logit so exp cannot overflow
    // (an infinite largest logit: the tokens equal to it share the mass evenly)
    const double top = convert<double>(logits[static_cast<std::size_t>(ids[0])]);
    std::vector<double> weight(k);
    double sum = 0;
    for (std::size_t i = 0; i < k; ++i) {
      const auto l = convert<double>(logits[static_cast<std::size_t>(ids[i])]);
      weight[i] = std::isinf(top) ? (l == top ? 1.0 : 0.0) : std::exp((l - top) / temperature_);
      sum += weight[i];
    }
    double u = rng_.uniform(draws_++) * sum;
    for (std::size_t i = 0; i < k; ++i) {
      if (u < weight[i]) return ids[i];
      u -= weight[i];
    }
    return ids[k - 1];  // u landed on the rounding error past the last weight
  }
  /// Numbers drawn so far.
  std::uint64_t draws() const { return draws_; }

 private:
  double temperature_;
  int top_k_;
  CounterRng rng_;
  std::uint64_t draws_ = 0;
};

}  // namespace zero::nn
