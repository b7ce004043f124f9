// bf16 and f16 conversions: to-float exhaustively over all 65,536 bit patterns against a
// reference built from the format's fields with ldexp; from-float against a brute-force
// nearest-value search (ties to even) over the sorted table of all representable values.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/dtype.hpp>

namespace {

struct Format {
  int exponent_bits;
  int mantissa_bits;
};
constexpr Format bf16_format{8, 7};
constexpr Format f16_format{5, 10};

// Value of a 16-bit pattern computed from its fields, in double (exact for both formats).
double reference_to_double(std::uint16_t bits, Format f) {
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const int max_exp = (1 << f.exponent_bits) - 1;
  const bool negative = (bits >> 15) & 1;
  const int exponent = (bits >> f.mantissa_bits) & max_exp;
  const int mantissa = bits & ((1 << f.mantissa_bits) - 1);
  double magnitude;
  if (exponent == max_exp) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, 1 - bias - f.mantissa_bits);
  } else {
    magnitude = std::ldexp(mantissa + (1 << f.mantissa_bits), exponent - bias - f.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

// Sorted non-negative representable values with their bit patterns; the last entry stands for
// infinity at the value the next exponent would start at, so overflow follows round-to-nearest.
struct Table {
  std::vector<double> values;
  std::vector<std::uint16_t> bits;
};

Table build_table(Format f) {
  Table t;
  const std::uint16_t inf_bits =
      static_cast<std::uint16_t>(((1 << f.exponent_bits) - 1) << f.mantissa_bits);
  for (std::uint32_t b = 0; b < inf_bits; ++b) {
    t.values.push_back(reference_to_double(static_cast<std::uint16_t>(b), f));
    t.bits.push_back(static_cast<std::uint16_t>(b));
  }
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  t.values.push_back(std::ldexp(1.0, bias + 1));
  t.bits.push_back(inf_bits);
  return t;
}

// Nearest representable value to x, ties to the even pattern, by search in the table.
std::uint16_t reference_from_float(float x, const Table& t) {
  if (std::isnan(x)) return 0xffff;  // any NaN; checked separately
  const double a = std::fabs(static_cast<double>(x));
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(x) || a >= t.values.back()) return sign | t.bits.back();
  const auto it = std::upper_bound(t.values.begin(), t.values.end(), a);
  const std::size_t hi = static_cast<std::size_t>(it - t.values.begin());
  const std::size_t lo = hi - 1;
  const double dlo = a - t.values[lo];
  const double dhi = t.values[hi] - a;
  std::size_t pick;
  if (dlo < dhi) {
    pick = lo;
  } else if (dhi < dlo) {
    pick = hi;
  } else {
    pick = (t.bits[lo] & 1) == 0 ? lo : hi;
  }
  return sign | t.bits[pick];
}

template <class Half>
void check_from_float(float x, const Table& t) {
  const std::uint16_t got = Half::round_nearest_even(x);
  if (std::isnan(x)) {
    INFO("x = NaN " << std::bit_cast<std::uint32_t>(x));
    CHECK(std::isnan(Half::to_float(got)));
    CHECK((got >> 15) == (std::bit_cast<std::uint32_t>(x) >> 31));
    return;
  }
  const std::uint16_t want = reference_from_float(x, t);
  if (got != want) {
    INFO("x = " << x << " (0x" << std::hex << std::bit_cast<std::uint32_t>(x) << ") got 0x" << got
                << " want 0x" << want);
    CHECK(got == want);
  }
}

// Midpoints between consecutive representable values (exact in float for both formats), the
// floats just beside them, and the representable values themselves.
std::vector<float> structured_values(const Table& t) {
  std::vector<float> xs;
  for (std::size_t i = 0; i + 1 < t.values.size(); ++i) {
    const auto v = static_cast<float>(t.values[i]);
    const auto mid = static_cast<float>((t.values[i] + t.values[i + 1]) / 2);
    REQUIRE(static_cast<double>(mid) == (t.values[i] + t.values[i + 1]) / 2);
    for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  return xs;
}

template <class Half>
void check_conversions(Format f) {
  const Table table = build_table(f);

  SECTION("to float: all 65,536 bit patterns") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float got = Half::to_float(bits);
      const double want = reference_to_double(bits, f);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got));
        REQUIRE(std::signbit(got) == std::signbit(want));
      } else {
        REQUIRE(static_cast<double>(got) == want);
        REQUIRE(std::signbit(got) == std::signbit(want));
      }
    }
  }
  SECTION("from float: round trip of every representable value") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float x = Half::to_float(bits);
      if (!std::isnan(x)) REQUIRE(Half::round_nearest_even(x) == bits);
    }
  }
  SECTION("from float: ties, neighbours of ties and specials against the reference") {
    for (float x : structured_values(table)) check_from_float<Half>(x, table);
    for (float x :
         {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::max(),
          std::numeric_limits<float>::lowest(), std::numeric_limits<float>::min(),
          std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
          std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xff800001u)}) {
      check_from_float<Half>(x, table);
    }
  }
  SECTION("from float: 2 million random bit patterns and values near the format's range") {
    std::mt19937_64 gen(42);
    for (int i = 0; i < 1000000; ++i) {
      check_from_float<Half>(std::bit_cast<float>(static_cast<std::uint32_t>(gen())), table);
    }
    const double top = std::min(table.values.back(), 0.99 * std::numeric_limits<float>::max());
    std::uniform_real_distribution<double> near(-top * 1.01, top * 1.01);
    for (int i = 0; i < 1000000; ++i) check_from_float<Half>(static_cast<float>(near(gen)), table);
  }
}

}  // namespace

TEST_CASE("bf16 conversions are exact and round to nearest even", "[unit][dtype]") {
  check_conversions<zero::bf16>(bf16_format);
}

TEST_CASE("f16 conversions are exact and round to nearest even", "[unit][dtype]") {
  check_conversions<zero::f16>(f16_format);
}

TEST_CASE("f16 boundary values", "[unit][dtype]") {
  using zero::f16;
  CHECK(f16::round_nearest_even(65504.0f) == 0x7bff);
  CHECK(f16::round_nearest_even(65519.99f) == 0x7bff);
  CHECK(f16::round_nearest_even(65520.0f) == 0x7c00);    // tie goes to even: infinity
  CHECK(f16::round_nearest_even(0x1p-24f) == 0x0001);    // smallest subnormal
  CHECK(f16::round_nearest_even(0x1p-25f) == 0x0000);    // tie to even: zero
  CHECK(f16::round_nearest_even(0x1.8p-24f) == 0x0002);  // 1.5 ulps: tie to even (2)
  CHECK(f16::round_nearest_even(-0x1p-26f) == 0x8000);   // keeps the sign of zero
  CHECK(f16::to_float(0x3c00) == 1.0f);
  CHECK(static_cast<float>(f16(0.1f)) == 0.0999755859375f);
}

TEST_CASE("bf16 boundary values", "[unit][dtype]") {
  using zero::bf16;
  CHECK(bf16::round_nearest_even(1.0f) == 0x3f80);
  CHECK(bf16::round_nearest_even(std::bit_cast<float>(0x3f808000u)) == 0x3f80);  // tie, even
  CHECK(bf16::round_nearest_even(std::bit_cast<float>(0x3f818000u)) == 0x3f82);  // tie, odd up
  CHECK(bf16::round_nearest_even(std::numeric_limits<float>::max()) == 0x7f80);  // overflow
  CHECK(bf16::round_nearest_even(std::bit_cast<float>(0x00008000u)) == 0x0000);  // denormal tie
  CHECK(bf16::round_nearest_even(std::bit_cast<float>(0x00018000u)) == 0x0002);
  CHECK((bf16::round_nearest_even(std::bit_cast<float>(0x7f800001u)) & 0x7fc0) == 0x7fc0);
}

TEST_CASE("bf16 stochastic rounding is unbiased and exact on representable values",
          "[unit][dtype]") {
  using zero::bf16;
  std::mt19937 gen(7);
  const float x = 1.0f + 0x1p-9f;  // a quarter of the way from 1 to the next bf16 (1 + 2^-7)
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) sum += bf16::to_float(bf16::round_stochastic(x, gen()));
  CHECK(std::fabs(sum / n - x) < 2e-5);
  for (int i = 0; i < 1000; ++i) {
    CHECK(bf16::round_stochastic(1.5f, gen()) == bf16::round_nearest_even(1.5f));
  }
  CHECK(bf16::round_stochastic(INFINITY, 0xffff) == 0x7f80);
}

TEST_CASE("dtype tags, names and conversions", "[unit][dtype]") {
  using namespace zero;
  STATIC_REQUIRE(dtype_of<float> == DType::f32);
  STATIC_REQUIRE(dtype_of<bf16> == DType::bf16);
  STATIC_REQUIRE(size_of(DType::f16) == 2);
  STATIC_REQUIRE(std::is_same_v<compute_type_t<bf16>, float>);
  for (DType d : all_dtypes) CHECK(parse_dtype(name_of(d)) == d);
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK(parse_dtype("fp16") == DType::f16);
  CHECK_THROWS_AS(parse_dtype("fp8"), ConfigError);
  CHECK_THROWS_WITH(parse_dtype("fp8"), Catch::Contains("'fp8'") && Catch::Contains("bf16"));
  CHECK(convert<float>(bf16(2.5f)) == 2.5f);
  CHECK(convert<double>(f16(-0.5f)) == -0.5);
  CHECK(convert<bf16>(3.0).bits == bf16(3.0f).bits);
  CHECK(visit_dtype(DType::i32, [](auto v) { return sizeof(v); }) == 4);
}

TEST_CASE("f16 from float: every float of magnitude up to 2^17", "[slow][dtype]") {
  const Table table = build_table(f16_format);
  // Float exponents 0 .. 143 cover subnormal floats, every f16 value and past the overflow point.
  for (std::uint32_t bits = 0; bits < (144u << 23); bits += 1) {
    const float x = std::bit_cast<float>(bits);
    const std::uint16_t want = reference_from_float(x, table);
    if (zero::f16::round_nearest_even(x) != want) {
      FAIL("x = " << x << " bits 0x" << std::hex << bits);
    }
  }
}
