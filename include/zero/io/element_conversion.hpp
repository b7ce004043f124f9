#pragma once
// Bulk conversion between element types given as runtime tags, for readers and writers that
// store one dtype and hand out another (a bf16 file read into f32 master weights, f32 master
// weights exported as bf16). Floating types convert among themselves and integer types among
// themselves; mixing the two is refused because it silently truncates or rounds, and so is an
// integer that does not fit its new type (a token id 70000 read as u16).

#include <bit>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::io {

static_assert(std::endian::native == std::endian::little,
              "zero::io reads and writes little-endian files by copying bytes; a big-endian host "
              "would need byte swapping");

/// What a read does when the file's dtype differs from the caller's element type.
enum class DTypeRule {
  exact,    ///< Refuse: the caller expected exactly the file's dtype.
  convert,  ///< Convert float<->float (round-to-nearest-even when narrowing) or integer<->integer
            ///< (every value must fit the new type).
};

/// Elements converted per staging chunk: bounds the extra memory of a converting read or write.
inline constexpr std::size_t conversion_chunk_elems = std::size_t{1} << 16;

/// True when elements of dtype from may be converted to dtype to (same dtype, float to float, or
/// integer to integer).
constexpr bool can_convert(DType from, DType to) {
  return from == to || is_floating(from) == is_floating(to);
}

namespace detail {
/// ShapeError when integer value does not fit To (nothing for other types); a function of its
/// own, not an `if constexpr` inside the generic lambdas below, whose discarded branch nvcc's
/// front end still checks.
template <class To, class From>
void expect_fits(From value, std::string_view context) {
  if constexpr (std::is_integral_v<From> && std::is_integral_v<To>) {
    expect<ShapeError>(std::in_range<To>(value), context, context.empty() ? "" : ": ",
                       "cannot convert the ", name_of(dtype_of<From>), " value ",
                       std::to_string(value), " to ", name_of(dtype_of<To>),
                       ": it is out of range");
  } else {
    (void)value;
    (void)context;
  }
}
}  // namespace detail

/// Converts count elements of dtype from at src into dtype to at dst (no overlap). Throws
/// ShapeError if the pair cannot be converted or an integer does not fit dtype to; context (the
/// file and tensor) starts the message.
inline void convert_elements(DType from, const void* src, DType to, void* dst, std::size_t count,
                             std::string_view context = {}) {
  expect<ShapeError>(can_convert(from, to), "cannot convert ", name_of(from), " elements to ",
                     name_of(to), ": only float<->float and integer<->integer conversions exist");
  if (from == to) {
    if (count != 0) std::memcpy(dst, src, count * size_of(from));
    return;
  }
  visit_dtype(from, [&](auto from_tag) {
    using From = decltype(from_tag);
    visit_dtype(to, [&](auto to_tag) {
      using To = decltype(to_tag);
      const auto* in = static_cast<const std::byte*>(src);
      auto* out = static_cast<std::byte*>(dst);
      // memcpy per element: the file's bytes need not be aligned for From.
      for (std::size_t i = 0; i < count; ++i) {
        From value;
        std::memcpy(&value, in + i * sizeof(From), sizeof(From));
        detail::expect_fits<To>(value, context);
        const To converted = convert<To>(value);
        std::memcpy(out + i * sizeof(To), &converted, sizeof(To));
      }
    });
  });
}

}  // namespace zero::io
