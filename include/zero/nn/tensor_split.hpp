#pragma once
// TensorSplit: how the parameter a rank holds is a part of a logical whole tensor. Tensor
// parallelism splits a weight along one dimension into `parts` equal parts and gives rank
// `index` one of them; a fused weight (GPT-2's c_attn, q|k|v stacked along the output rows)
// splits with a stride: the dimension is first cut into `stride` blocks (q, k, v) and every
// block is split, so rank i holds part i of each block (Megatron's `stride`).
//
// Everything that meets a parameter by element index goes through the logical index: the
// initialiser (element i of the whole tensor is a function of (seed, name, i), so each rank's
// part equals the slice of the unsplit initialisation), checkpoints (segments of logical
// tensors, so any split loads any other) and weight files. A part is a sequence of contiguous
// runs of the logical tensor; for_each_run visits them.

#include <cstdint>
#include <string>

#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>

namespace zero::nn {

/// Where a held parameter lies in its logical tensor (parts == 1: it is the whole tensor).
struct TensorSplit {
  Shape whole;     ///< the logical tensor's shape (empty when parts == 1)
  int dim = 0;     ///< the dimension split
  int parts = 1;   ///< number of parts (the tensor-parallel size)
  int index = 0;   ///< the part held
  int stride = 1;  ///< blocks along dim split separately (3 for a fused q|k|v)

  /// True when the parameter is a part of a larger tensor.
  bool is_split() const { return parts > 1; }

  /// The split of a tensor of shape whole along dim into parts, part index held, stride blocks;
  /// ShapeError naming what when the extent does not divide.
  static TensorSplit of(const Shape& whole, int dim, int parts, int index, int stride = 1) {
    expect<ShapeError>(dim >= 0 && dim < whole.rank(), "TensorSplit: dimension ", dim,
                       " of a rank-", whole.rank(), " tensor");
    expect<ShapeError>(parts >= 1 && index >= 0 && index < parts && stride >= 1,
                       "TensorSplit: part ", index, " of ", parts, " (stride ", stride, ")");
    expect<ShapeError>(whole[dim] % (static_cast<std::int64_t>(parts) * stride) == 0,
                       "TensorSplit: extent ", whole[dim], " of dimension ", dim,
                       " does not split into ", parts, " parts", stride > 1 ? " of each of " : "",
                       stride > 1 ? std::to_string(stride) + " blocks" : std::string());
    return {whole, dim, parts, index, stride};
  }

  /// The shape of the part held.
  Shape part_shape() const {
    if (!is_split()) return whole;
    return whole.with_extent(dim, whole[dim] / parts);
  }

  /// fn(logical_offset, part_offset, count) for each contiguous run of the part's elements
  /// [first, first + count) (flat, row-major), in order: element part_offset + k of the part is
  /// element logical_offset + k of the whole tensor.
  template <class Fn>
  void for_each_run(std::int64_t first, std::int64_t count, Fn&& fn) const {
    if (count <= 0) return;
    if (!is_split()) {
      fn(first, first, count);
      return;
    }
    std::int64_t inner = 1;
    for (int d = dim + 1; d < whole.rank(); ++d) inner *= whole[d];
    const std::int64_t block = whole[dim] / stride;  // logical rows of one stride block
    const std::int64_t rows = block / parts;         // rows of a block this part holds
    const std::int64_t run = rows * inner;           // elements of one contiguous run
    std::int64_t pos = first;
    const std::int64_t end = first + count;
    while (pos < end) {
      const std::int64_t run_index = pos / run, within = pos % run;
      const std::int64_t outer = run_index / stride, block_index = run_index % stride;
      const std::int64_t logical =
          (outer * whole[dim] + block_index * block + index * rows) * inner;
      const std::int64_t n = (run - within) < (end - pos) ? run - within : end - pos;
      fn(logical + within, pos, n);
      pos += n;
    }
  }
};

}  // namespace zero::nn
