#pragma once
// CounterPermutation: a pseudo-random permutation of [0, n) evaluated one index at a time, with
// no table. Shuffling a data set by it costs nothing up front and gives every rank, at any
// world size, the same order from the seed alone: sample_at(position) is a pure function.
// Construction: a balanced Feistel network over the smallest even-bit power-of-two domain
// holding n (at most 4n), with SplitMix64 as the round function, and cycle-walking to map the
// domain's permutation onto [0, n) (Black and Rogaway, "Ciphers with arbitrary finite domains").

#include <cstdint>

#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>

namespace zero::data {

/// A keyed bijection of [0, size) computed per index.
class CounterPermutation {
 public:
  /// Feistel rounds: 6 rounds of a strong round function are well past the 4 that make the
  /// construction a pseudo-random permutation; the cost is irrelevant next to reading a batch.
  static constexpr int rounds = 6;

  /// The permutation of [0, size) selected by key; size must be positive.
  CounterPermutation(std::uint64_t size, std::uint64_t key) : size_(size), key_(key) {
    expect<Error>(size > 0, "CounterPermutation: size must be positive");
    int bits = 2;
    while (bits < 64 && (std::uint64_t{1} << bits) < size) bits += 2;
    half_bits_ = bits / 2;
    half_mask_ = (std::uint64_t{1} << half_bits_) - 1;
  }

  /// Number of elements permuted.
  std::uint64_t size() const { return size_; }

  /// The image of index (in [0, size)); throws for an index outside.
  std::uint64_t operator()(std::uint64_t index) const {
    expect<Error>(index < size_, "CounterPermutation: index ", index, " is outside [0, ", size_,
                  ")");
    // Cycle-walking ends: the walk from index stays on index's cycle, which returns to index,
    // so it meets a value below size_ at the latest there. Expected steps are below 4.
    std::uint64_t x = encrypt(index);
    while (x >= size_) x = encrypt(x);
    return x;
  }

 private:
  std::uint64_t encrypt(std::uint64_t x) const {
    std::uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (int round = 0; round < rounds; ++round) {
      const std::uint64_t f = CounterRng::mix(
          key_ ^ CounterRng::mix((static_cast<std::uint64_t>(round) << 56) ^ right));
      const std::uint64_t next_right = (left ^ f) & half_mask_;
      left = right;
      right = next_right;
    }
    return (left << half_bits_) | right;
  }

  std::uint64_t size_;
  std::uint64_t key_;
  int half_bits_ = 1;
  std::uint64_t half_mask_ = 1;
};

}  // namespace zero::data
