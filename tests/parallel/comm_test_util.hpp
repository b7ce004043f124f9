#pragma once
// Helpers for the collective tests: per_rank (tests/support/per_rank.hpp) runs ranks on
// LocalComm and collects what each returns, so Catch2 assertions (not thread-safe) run on the
// main thread only; closed-form expected values for rank-dependent inputs.

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <zero/core/dtype.hpp>

#include "../support/per_rank.hpp"

namespace zero::parallel::testing {

using zero::testing::per_rank;

/// Input element i of rank r: small integers, exact in every element type and in their sums
/// over 8 ranks (<= 68, so bf16's 8-bit significand and u8 hold them).
inline double input_value(int rank, std::size_t i) {
  return (rank + 1) + static_cast<double>(i % 5);
}

/// Closed form of op over ranks 0..n-1 of input_value(r, i), as element type T.
template <class T>
T expected_reduction(ReduceOp op, int n, std::size_t i) {
  const double base = static_cast<double>(i % 5);
  const double sum = n * (n + 1) / 2.0 + n * base;
  switch (op) {
    case ReduceOp::sum:
      return convert<T>(sum);
    case ReduceOp::avg:
      if constexpr (std::is_integral_v<T>) {
        return static_cast<T>(static_cast<long long>(sum) / n);
      } else {
        return convert<T>(sum / n);
      }
    case ReduceOp::max:
      return convert<T>(n + base);
    case ReduceOp::min:
      return convert<T>(1 + base);
  }
  return T{};
}

/// Elements equal bit for bit (bf16/f16 compare by bits).
template <class T>
bool same_value(T a, T b) {
  if constexpr (is_half_type<T>) {
    return a.bits == b.bits;
  } else {
    return a == b;
  }
}

/// Index of the first element where got differs from want, or -1 when they are equal.
template <class T>
long first_mismatch(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!same_value(got[i], want[i])) return static_cast<long>(i);
  }
  return -1;
}

/// Appends tail to out element by element (vector::insert of u8 trips a g++ 12 false
/// -Warray-bounds at -O3).
template <class T>
void append(std::vector<T>& out, const std::vector<T>& tail) {
  for (const T& x : tail) out.push_back(x);
}

/// rank r's input of count elements.
template <class T>
std::vector<T> make_input(int rank, std::size_t count, std::size_t offset = 0) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = convert<T>(input_value(rank, offset + i));
  return v;
}

}  // namespace zero::parallel::testing
