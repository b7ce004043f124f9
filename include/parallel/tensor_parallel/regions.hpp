#pragma once
// The region operators of tensor and sequence parallelism (Megatron's mappings), each a pair:
// a forward and its adjoint, which is the backward. Activations are row-major [rows, cols] with
// rows = tokens (batch-major, B*T) and cols = features; the sequence-parallel region holds a
// contiguous 1/tp of the rows (so its collectives work on the flat leading dimension, no
// rearranging), the tensor-parallel region 1/tp of the columns.
//
//   region                forward                      backward (adjoint)
//   copy_to_tp            identity                     all-reduce (sum)
//   reduce_from_tp        all-reduce (sum)             identity
//   scatter_to_tp         keep own column block        all-gather columns
//   gather_from_tp        all-gather columns           keep own column block
//   scatter_to_sp         keep own row block           all-gather rows
//   gather_from_sp        all-gather rows              reduce-scatter rows
//   reduce_scatter_to_sp  reduce-scatter rows          all-gather rows
//
// region_forward writes its output; region_backward adds the input gradient into din (the
// layer contract), so a caller may start din from another path's gradient.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <parallel/comm/reduce_op.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// A region operator (see the file comment).
enum class Region : unsigned char {
  copy_to_tp,
  reduce_from_tp,
  scatter_to_tp,
  gather_from_tp,
  scatter_to_sp,
  gather_from_sp,
  reduce_scatter_to_sp,
};

/// Every region operator, for tests that walk them all.
inline constexpr Region all_regions[] = {Region::copy_to_tp,          Region::reduce_from_tp,
                                         Region::scatter_to_tp,       Region::gather_from_tp,
                                         Region::scatter_to_sp,       Region::gather_from_sp,
                                         Region::reduce_scatter_to_sp};

/// The operator's name ("gather_from_sp").
constexpr std::string_view name_of(Region r) {
  switch (r) {
    case Region::copy_to_tp:
      return "copy_to_tp";
    case Region::reduce_from_tp:
      return "reduce_from_tp";
    case Region::scatter_to_tp:
      return "scatter_to_tp";
    case Region::gather_from_tp:
      return "gather_from_tp";
    case Region::scatter_to_sp:
      return "scatter_to_sp";
    case Region::gather_from_sp:
      return "gather_from_sp";
    case Region::reduce_scatter_to_sp:
      return "reduce_scatter_to_sp";
  }
  return "?";
}

/// Rows and columns of a region's output for an input of rows x cols on a group of tp ranks;
/// ShapeError when a split does not divide.
struct RegionShape {
  std::int64_t rows = 0, cols = 0;
};
inline RegionShape region_output_shape(Region r, int tp, std::int64_t rows, std::int64_t cols) {
  auto split = [&](std::int64_t n, std::string_view what) {
    expect<ShapeError>(n % tp == 0, name_of(r), ": ", n, " ", what,
                       " do not split over a tensor-parallel group of ", tp);
    return n / tp;
  };
  switch (r) {
    case Region::copy_to_tp:
    case Region::reduce_from_tp:
      return {rows, cols};
    case Region::scatter_to_tp:
      return {rows, split(cols, "columns")};
    case Region::gather_from_tp:
      return {rows, cols * tp};
    case Region::scatter_to_sp:
    case Region::reduce_scatter_to_sp:
      return {split(rows, "rows"), cols};
    case Region::gather_from_sp:
      return {rows * tp, cols};
  }
  return {rows, cols};
}

namespace detail {

template <class T>
void add_into(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    dst[i] = convert<T>(convert<double>(dst[i]) + convert<double>(src[i]));
}

// Column block `block` of in [rows, cols * parts] into out [rows, cols], or added into it.
template <class T>
void take_columns(T* out, const T* in, std::int64_t rows, std::int64_t cols, int parts, int block,
                  bool add) {
  for (std::int64_t n = 0; n < rows; ++n) {
    const T* src = in + (n * parts + block) * cols;
    if (add) {
      add_into(out + n * cols, src, cols);
    } else {
      std::copy(src, src + cols, out + n * cols);
    }
  }
}

// All-gather of column blocks: out [rows, cols * tp] from every rank's in [rows, cols], or added
// into out. The collective gathers rank-major [tp][rows][cols]; the columns are rearranged here.
template <class T>
void gather_columns(const TensorParallel& tp, T* out, const T* in, std::int64_t rows,
                    std::int64_t cols, bool add) {
  const int t = tp.size();
  std::vector<T> gathered(static_cast<std::size_t>(rows * cols * t));
  tp.comm().all_gather(std::span<const T>(in, static_cast<std::size_t>(rows * cols)),
                       std::span<T>(gathered));
  for (int q = 0; q < t; ++q) {
    for (std::int64_t n = 0; n < rows; ++n) {
      const T* src = gathered.data() + (q * rows + n) * cols;
      T* dst = out + (n * t + q) * cols;
      if (add) {
        add_into(dst, src, cols);
      } else {
        std::copy(src, src + cols, dst);
      }
    }
  }
}

template <class T>
void gather_rows(const TensorParallel& tp, T* out, const T* in, std::int64_t count, bool add) {
  const auto n = static_cast<std::size_t>(count);
  if (!add) {
    tp.comm().all_gather(std::span<const T>(in, n), std::span<T>(out, n * tp.size()));
    return;
  }
  std::vector<T> gathered(n * static_cast<std::size_t>(tp.size()));
  tp.comm().all_gather(std::span<const T>(in, n), std::span<T>(gathered));
  add_into(out, gathered.data(), static_cast<std::int64_t>(gathered.size()));
}

template <class T>
void reduce_scatter_rows(const TensorParallel& tp, T* out, const T* in, std::int64_t count,
                         bool add) {
  const auto n = static_cast<std::size_t>(count);  // elements of the input
  const std::size_t part = n / static_cast<std::size_t>(tp.size());
  std::vector<T> reduced(add ? part : 0);
  T* dst = add ? reduced.data() : out;
  tp.comm()
      .reduce_scatter_async(std::span<const T>(in, n), std::span<T>(dst, part), ReduceOp::sum)
      .wait();
  if (add) add_into(out, reduced.data(), static_cast<std::int64_t>(part));
}

template <class T>
void all_reduce(const TensorParallel& tp, T* out, const T* in, std::int64_t count, bool add) {
  const auto n = static_cast<std::size_t>(count);
  if (!add) {
    if (out != in) std::copy(in, in + count, out);
    tp.comm().all_reduce(std::span<T>(out, n), ReduceOp::sum);
    return;
  }
  std::vector<T> reduced(in, in + count);
  tp.comm().all_reduce(std::span<T>(reduced), ReduceOp::sum);
  add_into(out, reduced.data(), count);
}

// out (= or +=) in, count elements.
template <class T>
void pass(T* out, const T* in, std::int64_t count, bool add) {
  if (add) {
    add_into(out, in, count);
  } else if (out != in) {
    std::copy(in, in + count, out);
  }
}

}  // namespace detail

/// out = r(in) for in [rows, cols] (out shaped by region_output_shape).
template <class T>
void region_forward(Region r, const TensorParallel& tp, const T* in, T* out, std::int64_t rows,
                    std::int64_t cols) {
  const RegionShape o = region_output_shape(r, tp.size(), rows, cols);
  const std::int64_t count = rows * cols;
  if (!tp.active()) {
    detail::pass(out, in, count, false);
    return;
  }
  switch (r) {
    case Region::copy_to_tp:
      detail::pass(out, in, count, false);
      break;
    case Region::reduce_from_tp:
      detail::all_reduce(tp, out, in, count, false);
      break;
    case Region::scatter_to_tp:
      detail::take_columns(out, in, rows, o.cols, tp.size(), tp.rank(), false);
      break;
    case Region::gather_from_tp:
      detail::gather_columns(tp, out, in, rows, cols, false);
      break;
    case Region::scatter_to_sp:
      detail::pass(out, in + tp.rank() * o.rows * cols, o.rows * cols, false);
      break;
    case Region::gather_from_sp:
      detail::gather_rows(tp, out, in, count, false);
      break;
    case Region::reduce_scatter_to_sp:
      detail::reduce_scatter_rows(tp, out, in, count, false);
      break;
  }
}

/// din += r^T(dout): the adjoint of region_forward for an input of [rows, cols] (dout shaped
/// like the forward's output, din like its input).
template <class T>
void region_backward(Region r, const TensorParallel& tp, const T* dout, T* din, std::int64_t rows,
                     std::int64_t cols) {
  const RegionShape o = region_output_shape(r, tp.size(), rows, cols);
  const std::int64_t count = rows * cols;
  if (!tp.active()) {
    detail::pass(din, dout, count, true);
    return;
  }
  switch (r) {
    case Region::copy_to_tp:
      detail::all_reduce(tp, din, dout, count, true);
      break;
    case Region::reduce_from_tp:
      detail::pass(din, dout, count, true);
      break;
    case Region::scatter_to_tp:
      detail::gather_columns(tp, din, dout, rows, o.cols, true);
      break;
    case Region::gather_from_tp:
      detail::take_columns(din, dout, rows, cols, tp.size(), tp.rank(), true);
      break;
    case Region::scatter_to_sp:
      detail::gather_rows(tp, din, dout, o.rows * cols, true);
      break;
    case Region::gather_from_sp:
      detail::reduce_scatter_rows(tp, din, dout, o.rows * cols, true);
      break;
    case Region::reduce_scatter_to_sp:
      detail::gather_rows(tp, din, dout, o.rows * cols, true);
      break;
  }
}

}  // namespace zero::parallel
