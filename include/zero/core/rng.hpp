#pragma once
// Counter-based random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC'11; the Random123 library's known-answer vectors are tested).
// A value depends only on (key, counter), never on who computes it, so a parameter initialised
// from (seed, name, element index) is the same at any rank count and thread count: each rank
// fills only the slice it owns and the whole equals a single-process initialisation.

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

#include <zero/core/dtype.hpp>
#include <zero/core/macros.hpp>
#include <zero/core/tensor.hpp>

namespace zero {

/// The Philox4x32 bijection with 10 rounds.
struct Philox4x32 {
  using Counter = std::array<std::uint32_t, 4>;
  using Key = std::array<std::uint32_t, 2>;

  /// Four random words for counter under key.
  ZERO_HOST_DEVICE static constexpr Counter generate(Counter counter, Key key) {
    constexpr std::uint32_t multiplier0 = 0xD2511F53u;
    constexpr std::uint32_t multiplier1 = 0xCD9E8D57u;
    constexpr std::uint32_t weyl0 = 0x9E3779B9u;  // golden ratio
    constexpr std::uint32_t weyl1 = 0xBB67AE85u;  // sqrt(3) - 1
    for (int round = 0; round < 10; ++round) {
      if (round > 0) {
        key[0] += weyl0;
        key[1] += weyl1;
      }
      const std::uint64_t product0 = std::uint64_t{multiplier0} * counter[0];
      const std::uint64_t product1 = std::uint64_t{multiplier1} * counter[2];
      counter = {static_cast<std::uint32_t>(product1 >> 32) ^ counter[1] ^ key[0],
                 static_cast<std::uint32_t>(product1),
                 static_cast<std::uint32_t>(product0 >> 32) ^ counter[3] ^ key[1],
                 static_cast<std::uint32_t>(product0)};
    }
    return counter;
  }
};

/// A stream of random numbers addressed by a 64-bit element index under a 64-bit key.
class CounterRng {
 public:
  constexpr explicit CounterRng(std::uint64_t key) : key_(key) {}

  /// The key for a named tensor under a global seed (64-bit FNV-1a of the name, mixed with the
  /// seed by SplitMix64), so every parameter has its own stream.
  static constexpr std::uint64_t key_for(std::uint64_t seed, std::string_view name) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (char c : name) {
      h ^= static_cast<unsigned char>(c);
      h *= 0x100000001b3ull;
    }
    return mix(h ^ mix(seed));
  }
  /// The stream of a dropout site: its name under the site's own seed, with the run's seed
  /// (nn::StepContext::seed) folded in by an odd multiplier, so another run seed draws other
  /// masks; run seed 0 keeps the stream of key_for(site_seed, name).
  static constexpr CounterRng dropout_site(std::uint64_t run_seed, std::uint64_t site_seed,
                                           std::string_view name) {
    return CounterRng(key_for(site_seed ^ (run_seed * 0x9e3779b97f4a7c15ull), name));
  }
  /// SplitMix64's finaliser: a bijective 64-bit mix.
  static constexpr std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }

  constexpr std::uint64_t key() const { return key_; }

  /// Four random words for element index (the same index gives the same words). sub selects one
  /// of 2^32 independent streams per index (dropout masks use it for the layer or step).
  ZERO_HOST_DEVICE constexpr Philox4x32::Counter words(std::uint64_t index,
                                                       std::uint32_t sub = 0) const {
    return Philox4x32::generate(
        {static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32), sub, 0u},
        {static_cast<std::uint32_t>(key_), static_cast<std::uint32_t>(key_ >> 32)});
  }
  /// Uniform double in [0, 1) with 53 random bits, for element index.
  double uniform(std::uint64_t index) const {
    const auto w = words(index);
    const std::uint64_t bits = (std::uint64_t{w[0]} << 21) ^ (std::uint64_t{w[1]} >> 11);
    return static_cast<double>(bits & ((1ull << 53) - 1)) * 0x1p-53;
  }
  /// Standard normal double for element index (Box-Muller on two 53-bit uniforms).
  double normal(std::uint64_t index) const {
    const auto w = words(index);
    const std::uint64_t a = ((std::uint64_t{w[0]} << 32) | w[1]) >> 11;
    const std::uint64_t b = ((std::uint64_t{w[2]} << 32) | w[3]) >> 11;
    const double u1 = (static_cast<double>(a) + 1.0) * 0x1p-53;  // (0, 1]: log is finite
    const double u2 = static_cast<double>(b) * 0x1p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t key_;
};

/// Fills a host tensor holding elements [first_index, first_index + numel) of a named
/// parameter with normal(mean, stddev) values; any split of the index range over ranks or
/// threads gives the same values as one fill of the whole.
template <class T>
void fill_normal(Tensor<T> out, const CounterRng& rng, std::int64_t first_index, double mean,
                 double stddev) {
  T* data = out.span().data();
  const std::int64_t n = out.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    data[i] = convert<T>(mean + stddev * rng.normal(static_cast<std::uint64_t>(first_index + i)));
  }
}

/// Fills a host tensor holding elements [first_index, first_index + numel) with uniform values
/// in [low, high]: the draw is below high, but rounding low + (high - low) * u to double and then
/// to T can reach high (for bf16 in [0, 1), about 1 draw in 500); split-invariant like
/// fill_normal.
template <class T>
void fill_uniform(Tensor<T> out, const CounterRng& rng, std::int64_t first_index, double low,
                  double high) {
  T* data = out.span().data();
  const std::int64_t n = out.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    data[i] =
        convert<T>(low + (high - low) * rng.uniform(static_cast<std::uint64_t>(first_index + i)));
  }
}

}  // namespace zero
