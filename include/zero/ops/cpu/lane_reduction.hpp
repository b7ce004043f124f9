#pragma once
// Reductions for the dispatched host kernels (isa_dispatch.hpp) whose bits do not depend on the
// vector width. Two shapes:
//  - along a row (reduce_row): element i goes to partial i % reduction_lanes, each partial folds
//    its elements in increasing i, and the partials are combined in a fixed tree. The 16
//    partials are one AVX-512 vector, two AVX2 vectors or 16 scalars, so every path does the same
//    operations in the same order.
//  - down columns (reduce_columns): each column is one lane and folds the rows in order, so
//    the vector width only decides how many columns run side by side.
// The step and merge functions take the Ops type as their first argument (an empty tag), so the
// same lambda serves the vector lanes and the scalar tail.

#include <array>
#include <cstdint>

#include <optim/cpu/vector_ops.hpp>

namespace zero::ops::cpu {

/// Partial results of a row reduction, whatever the vector width.
inline constexpr int reduction_lanes = 16;

/// Folds step over [0, n) into reduction_lanes partials started at init and returns them merged:
/// acc = step(ops, acc, i) folds the ops-width elements at i into acc (a vector of ops lanes),
/// merge(a, b) combines two partials (floats).
template <class O, class Step, class Merge>
inline float reduce_row(std::int64_t n, float init, Step&& step, Merge&& merge) {
  static_assert(reduction_lanes % O::width == 0, "a vector width divides reduction_lanes");
  constexpr int vectors = reduction_lanes / O::width;
  typename O::V acc[vectors];
  for (int j = 0; j < vectors; ++j) acc[j] = O::set1(init);
  std::int64_t i = 0;
  for (; i + reduction_lanes <= n; i += reduction_lanes) {
    for (int j = 0; j < vectors; ++j) acc[j] = step(O{}, acc[j], i + j * O::width);
  }
  float lanes[reduction_lanes];
  for (int j = 0; j < vectors; ++j) O::store(lanes + j * O::width, acc[j]);
  for (; i < n; ++i) {
    float& lane = lanes[i % reduction_lanes];
    lane = step(optim::ScalarHostOps{}, lane, i);
  }
  for (int half = reduction_lanes / 2; half > 0; half /= 2) {
    for (int j = 0; j < half; ++j) lanes[j] = merge(lanes[j], lanes[j + half]);
  }
  return lanes[0];
}

/// Columns a reduce_columns call keeps in registers at once (a multiple of every width).
inline constexpr std::int64_t column_group = 32;

namespace detail {

template <class O, int Accs, int Vectors, class Start, class Step, class Finish>
inline void reduce_column_group(std::int64_t c, std::int64_t rows, Start& start, Step& step,
                                Finish& finish) {
  std::array<typename O::V, Accs> acc[Vectors];
  for (int j = 0; j < Vectors; ++j) acc[j] = start(O{}, c + j * O::width);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < Vectors; ++j) step(O{}, acc[j], r, c + j * O::width);
  }
  for (int j = 0; j < Vectors; ++j) finish(O{}, acc[j], c + j * O::width);
}

}  // namespace detail

/// Column reductions over columns [c0, c1) and rows [0, rows), Accs accumulators per column:
/// acc = start(ops, c) (a std::array of Accs vectors for the ops-width columns at c), then
/// step(ops, acc, r, c) for r = 0, 1, ..., rows - 1, then finish(ops, acc, c).
template <class O, int Accs, class Start, class Step, class Finish>
inline void reduce_columns(std::int64_t c0, std::int64_t c1, std::int64_t rows, Start&& start,
                           Step&& step, Finish&& finish) {
  std::int64_t c = c0;
  for (; c + column_group <= c1; c += column_group) {
    detail::reduce_column_group<O, Accs, column_group / O::width>(c, rows, start, step, finish);
  }
  for (; c + O::width <= c1; c += O::width) {
    detail::reduce_column_group<O, Accs, 1>(c, rows, start, step, finish);
  }
  for (; c < c1; ++c) {
    detail::reduce_column_group<optim::ScalarHostOps, Accs, 1>(c, rows, start, step, finish);
  }
}

}  // namespace zero::ops::cpu
