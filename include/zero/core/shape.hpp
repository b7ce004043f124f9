#pragma once
// Shape: up to max_rank extents of a dense, row-major tensor.

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>

#include <zero/core/error.hpp>

namespace zero {

/// Elements of a dense tensor of these extents: 1 for none (a scalar), 0 when any extent is 0,
/// which is checked before multiplying, as the product of the others may not fit. Throws
/// ShapeError when the product does not fit in int64.
constexpr std::int64_t numel_of(std::span<const std::int64_t> extents) {
  for (std::int64_t e : extents) {
    if (e == 0) return 0;
  }
  std::int64_t n = 1;
  for (std::int64_t e : extents) {
    if (__builtin_mul_overflow(n, e, &n)) {
      raise<ShapeError>("Shape: the product of the extents overflows int64 at extent ", e);
    }
  }
  return n;
}

/// Extents of a dense row-major tensor (last dimension contiguous), rank 0 to max_rank.
class Shape {
 public:
  static constexpr int max_rank = 6;

  constexpr Shape() = default;
  /// Builds a shape from its extents; throws ShapeError past max_rank or for a negative extent.
  Shape(std::initializer_list<std::int64_t> extents) {
    expect<ShapeError>(extents.size() <= max_rank, "Shape: rank ", extents.size(),
                       " is above the maximum of ", max_rank);
    for (std::int64_t e : extents) {
      expect<ShapeError>(e >= 0, "Shape: extent ", e, " at dimension ", rank_,
                         " is negative; expected >= 0");
      extents_[static_cast<std::size_t>(rank_++)] = e;
    }
  }

  /// The shape of the first rank extents of extents (a shape sent as numbers).
  static Shape of(const std::int64_t* extents, int rank) {
    expect<ShapeError>(rank >= 0 && rank <= max_rank, "Shape: rank ", rank, " is outside [0, ",
                       max_rank, "]");
    Shape s;
    for (int i = 0; i < rank; ++i) {
      expect<ShapeError>(extents[i] >= 0, "Shape: extent ", extents[i], " at dimension ", i,
                         " is negative; expected >= 0");
      s.extents_[static_cast<std::size_t>(i)] = extents[i];
    }
    s.rank_ = rank;
    return s;
  }

  /// Number of dimensions.
  constexpr int rank() const { return rank_; }
  /// Extent of dimension i (negative i counts from the back).
  std::int64_t operator[](int i) const {
    const int k = i < 0 ? i + rank_ : i;
    expect<ShapeError>(k >= 0 && k < rank_, "Shape: dimension ", i, " out of range for rank ",
                       rank_);
    return extents_[static_cast<std::size_t>(k)];
  }
  /// Product of the extents (1 for rank 0, 0 when any extent is 0).
  constexpr std::int64_t numel() const {
    return numel_of(std::span(extents_.data(), static_cast<std::size_t>(rank_)));
  }
  /// Elements between consecutive indices of dimension i.
  std::int64_t stride(int i) const {
    std::int64_t s = 1;
    for (int k = rank_ - 1; k > i; --k) s *= extents_[static_cast<std::size_t>(k)];
    return s;
  }
  /// The shape without its first dimension.
  Shape drop_front() const {
    expect<ShapeError>(rank_ > 0, "Shape::drop_front: the shape has rank 0");
    Shape s;
    s.rank_ = rank_ - 1;
    std::copy(extents_.begin() + 1, extents_.begin() + rank_, s.extents_.begin());
    return s;
  }
  /// The shape with dimension i (negative counts from the back) set to extent.
  Shape with_extent(int i, std::int64_t extent) const {
    const int k = i < 0 ? i + rank_ : i;
    expect<ShapeError>(k >= 0 && k < rank_, "Shape::with_extent: dimension ", i,
                       " out of range for rank ", rank_);
    expect<ShapeError>(extent >= 0, "Shape::with_extent: extent ", extent, " is negative");
    Shape s = *this;
    s.extents_[static_cast<std::size_t>(k)] = extent;
    return s;
  }

  friend constexpr bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i) {
      if (a.extents_[static_cast<std::size_t>(i)] != b.extents_[static_cast<std::size_t>(i)]) {
        return false;
      }
    }
    return true;
  }
  /// Writes "[d0, d1, ...]".
  friend std::ostream& operator<<(std::ostream& out, const Shape& s) {
    out << '[';
    for (int i = 0; i < s.rank_; ++i)
      out << (i ? ", " : "") << s.extents_[static_cast<std::size_t>(i)];
    return out << ']';
  }
  /// "[d0, d1, ...]" as a string.
  std::string to_string() const { return detail::concat(*this); }

 private:
  std::array<std::int64_t, max_rank> extents_{};
  int rank_ = 0;
};

}  // namespace zero
