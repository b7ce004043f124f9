#pragma once
// What a rank hands to a save: the logical tensors of the checkpoint (name, dtype, shape, the
// same on every rank that declares them) and the segments of them it holds: a contiguous run of
// the flattened tensor (element offset, count) with its data. In ZeRO terms a segment is one
// engine::ShardSegment of a rank's flat shard: the part of one parameter (or one optimizer
// state of it, named "<param>/exp_avg") that falls into the rank's slice. A streamed save
// (save.hpp) declares its segments first as SegmentShapes (no data) and hands each one's data
// over only while it is written, so a rank's state need not be in memory at once.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/core/shape.hpp>
#include <zero/io/safetensors_header.hpp>

namespace zero::checkpoint {

/// A logical tensor of a checkpoint.
struct TensorSpec {
  std::string name;                 ///< Unique name, e.g. "transformer.h.0.attn.c_attn.weight".
  DType dtype = DType::f32;         ///< Element type stored (segments must carry this dtype).
  std::vector<std::int64_t> shape;  ///< Logical extents (row-major); rank 0 is a scalar.

  /// Number of elements of the flattened tensor.
  std::int64_t numel() const { return numel_of(shape); }
  /// Two specs agree when name, dtype and shape are equal.
  bool operator==(const TensorSpec&) const = default;
};

/// A contiguous run of a logical tensor held by this rank: elements [offset, offset + count())
/// of the flattened tensor, whose bytes are data (in the tensor's dtype, host memory).
struct Segment {
  std::string name;                 ///< The logical tensor.
  std::int64_t offset = 0;          ///< First element within the flattened tensor.
  DType dtype = DType::f32;         ///< Element type of data.
  std::span<const std::byte> data;  ///< The elements' bytes; must stay valid during the save.

  /// Number of elements.
  std::int64_t count() const { return static_cast<std::int64_t>(data.size() / size_of(dtype)); }
};

/// A segment declared before its data: tensor name, first element, element type and count.
struct SegmentShape {
  std::string name;
  std::int64_t offset = 0;
  DType dtype = DType::f32;
  std::int64_t count = 0;

  bool operator==(const SegmentShape&) const = default;
};

/// True when every extent of shape is >= 0 and the tensor's bytes in dtype fit in int64 (a
/// zero extent makes it empty whatever the others are), so numel() and byte counts may be
/// computed without overflow.
inline bool shape_fits(std::span<const std::int64_t> shape, DType dtype) {
  bool empty = false;
  for (std::int64_t e : shape) {
    if (e < 0) return false;
    empty = empty || e == 0;
  }
  if (empty) return true;
  auto bytes = static_cast<std::int64_t>(size_of(dtype));
  for (std::int64_t e : shape) {
    if (__builtin_mul_overflow(bytes, e, &bytes)) return false;
  }
  return true;
}

/// "[offset, offset + count)" for messages, the end written as a sum where it would pass int64
/// (a message about a bad range must not overflow computing it).
inline std::string element_range(std::int64_t offset, std::int64_t count) {
  std::int64_t end = 0;
  if (__builtin_add_overflow(offset, count, &end)) {
    return "[" + std::to_string(offset) + ", " + std::to_string(offset) + " + " +
           std::to_string(count) + ")";
  }
  return "[" + std::to_string(offset) + ", " + std::to_string(end) + ")";
}

/// The shape of segment s (its data left out).
inline SegmentShape shape_of(const Segment& s) {
  return {s.name, s.offset, s.dtype, s.count()};
}

/// A segment of tensor name starting at element offset, viewing elements.
template <class T>
Segment segment_of(std::string name, std::int64_t offset, std::span<const T> elements) {
  return {std::move(name), offset, dtype_of<std::remove_const_t<T>>, std::as_bytes(elements)};
}

/// A segment of tensor name starting at element offset, viewing elements.
template <class T>
Segment segment_of(std::string name, std::int64_t offset, std::span<T> elements) {
  return segment_of(std::move(name), offset, std::span<const T>(elements));
}

/// A segment of tensor name starting at element offset, viewing a vector's elements.
template <class T>
Segment segment_of(std::string name, std::int64_t offset, const std::vector<T>& elements) {
  return segment_of(std::move(name), offset, std::span<const T>(elements));
}

}  // namespace zero::checkpoint
