#pragma once
// Element types: the runtime tag DType, the compile-time mapping between C++ types and tags,
// and conversions between any two element types through float or double.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include <zero/core/bfloat16.hpp>
#include <zero/core/error.hpp>
#include <zero/core/float16.hpp>

namespace zero {

using f64 = double;  ///< Reference precision for exactness tests.
using f32 = float;   ///< Master weights, optimizer states, accumulation.

/// Runtime tag of an element type.
enum class DType : std::uint8_t { f64, f32, bf16, f16, i64, i32, u16, u8 };

/// All tags, in declaration order.
inline constexpr DType all_dtypes[] = {DType::f64, DType::f32, DType::bf16, DType::f16,
                                       DType::i64, DType::i32, DType::u16,  DType::u8};

/// Bytes per element of dtype.
constexpr std::size_t size_of(DType dtype) {
  switch (dtype) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
    case DType::u16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

/// Lower-case name ("f32", "bf16", ...).
constexpr std::string_view name_of(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return "f64";
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i64:
      return "i64";
    case DType::i32:
      return "i32";
    case DType::u16:
      return "u16";
    case DType::u8:
      return "u8";
  }
  return "?";
}

/// True for the floating-point tags.
constexpr bool is_floating(DType dtype) {
  return dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16;
}

/// Parses a dtype name; accepts zero's names and the usual aliases (fp32, float32, bfloat16,
/// fp16, half, float16, ...). Throws ConfigError naming the text and the accepted names.
inline DType parse_dtype(std::string_view text) {
  for (DType d : all_dtypes) {
    if (text == name_of(d)) return d;
  }
  if (text == "fp64" || text == "float64" || text == "double") return DType::f64;
  if (text == "fp32" || text == "float32" || text == "float") return DType::f32;
  if (text == "bfloat16" || text == "bf16") return DType::bf16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::f16;
  if (text == "int64") return DType::i64;
  if (text == "int32") return DType::i32;
  raise<ConfigError>("unknown dtype '", std::string(text),
                     "': expected one of f64, f32, bf16, f16, i64, i32, u16, u8 "
                     "(or fp32, float32, bfloat16, fp16, half, ...)");
}

/// The tag of the C++ element type T.
template <class T>
inline constexpr DType dtype_of = [] {
  static_assert(sizeof(T) == 0, "zero::dtype_of<T>: T is not a zero element type");
  return DType::u8;
}();
template <>
inline constexpr DType dtype_of<double> = DType::f64;
template <>
inline constexpr DType dtype_of<float> = DType::f32;
template <>
inline constexpr DType dtype_of<bf16> = DType::bf16;
template <>
inline constexpr DType dtype_of<f16> = DType::f16;
template <>
inline constexpr DType dtype_of<std::int64_t> = DType::i64;
template <>
inline constexpr DType dtype_of<std::int32_t> = DType::i32;
template <>
inline constexpr DType dtype_of<std::uint16_t> = DType::u16;
template <>
inline constexpr DType dtype_of<std::uint8_t> = DType::u8;

/// True for the 16-bit float storage types whose arithmetic happens in float.
template <class T>
inline constexpr bool is_half_type = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

/// Element type that arithmetic on T is done in: float for bf16/f16, T otherwise.
template <class T>
using compute_type_t = std::conditional_t<is_half_type<T>, float, T>;

/// value rounded to a float toward zero, its last bit set when inexact ("round to odd"): a
/// second rounding of the result to a type with at most 22 significant bits then equals one
/// rounding of value (a double rounded to nearest float and then to bf16 can land on a tie and
/// go the wrong way: 1 + 2^-8 + 2^-30).
ZERO_HOST_DEVICE constexpr float round_to_odd_float(double value) {
  const float nearest = static_cast<float>(value);
  if (!(nearest - nearest == 0.0f) || static_cast<double>(nearest) == value) return nearest;
  auto bits = std::bit_cast<std::uint32_t>(nearest);
  const double magnitude = nearest < 0.0f ? -static_cast<double>(nearest) : nearest;
  if (magnitude > (value < 0.0 ? -value : value)) --bits;  // the float on zero's side
  return std::bit_cast<float>(bits | 1u);
}

/// Converts between element types; half types go through float with round-to-nearest-even
/// (from double through round_to_odd_float, so the result is rounded once).
template <class To, class From>
ZERO_HOST_DEVICE constexpr To convert(From value) {
  if constexpr (std::is_same_v<To, From>) {
    return value;
  } else if constexpr (is_half_type<From>) {
    return convert<To>(static_cast<float>(value));
  } else if constexpr (is_half_type<To> && std::is_same_v<From, double>) {
    return To(round_to_odd_float(value));
  } else if constexpr (is_half_type<To>) {
    return To(static_cast<float>(value));
  } else {
    return static_cast<To>(value);
  }
}

/// Calls fn with a value-initialised object of the C++ type behind dtype (for dispatch).
template <class Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f64:
      return fn(double{});
    case DType::f32:
      return fn(float{});
    case DType::bf16:
      return fn(bf16{});
    case DType::f16:
      return fn(f16{});
    case DType::i64:
      return fn(std::int64_t{});
    case DType::i32:
      return fn(std::int32_t{});
    case DType::u16:
      return fn(std::uint16_t{});
    case DType::u8:
      return fn(std::uint8_t{});
  }
  raise<Error>("visit_dtype: invalid dtype tag ", static_cast<int>(dtype));
}

}  // namespace zero
