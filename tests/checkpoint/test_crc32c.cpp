// CRC32C: the RFC 3720 (iSCSI) test vectors and other published values, for both the
// table-driven and the hardware path; chaining equals one pass; both paths agree on every
// length and alignment.
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/checkpoint/crc32c.hpp>

using zero::checkpoint::crc32c;
using zero::checkpoint::crc32c_hardware_available;
using zero::checkpoint::crc32c_portable;

namespace {
std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> b(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) b[i] = static_cast<std::byte>(s[i]);
  return b;
}
std::vector<std::byte> filled(std::size_t n, auto value_of) {
  std::vector<std::byte> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>(value_of(i));
  return b;
}
}  // namespace

TEST_CASE("crc32c matches published test vectors on both paths", "[unit]") {
  struct Vector {
    std::vector<std::byte> data;
    std::uint32_t crc;
  };
  const std::vector<Vector> vectors = {
      {{}, 0x00000000U},
      {bytes_of("123456789"), 0xE3069283U},
      {bytes_of("The quick brown fox jumps over the lazy dog"), 0x22620404U},
      {filled(32, [](std::size_t) { return 0x00; }), 0x8A9136AAU},      // RFC 3720 B.4
      {filled(32, [](std::size_t) { return 0xFF; }), 0x62A8AB43U},      // RFC 3720 B.4
      {filled(32, [](std::size_t i) { return i; }), 0x46DD794EU},       // RFC 3720 B.4
      {filled(32, [](std::size_t i) { return 31 - i; }), 0x113FDB5CU},  // RFC 3720 B.4
  };
  for (const auto& v : vectors) {
    CHECK(crc32c_portable(v.data) == v.crc);
    CHECK(crc32c(v.data) == v.crc);
  }
  // A wrong expectation must fail: one flipped bit changes the checksum.
  auto flipped = bytes_of("123456789");
  flipped[4] ^= std::byte{1};
  CHECK(crc32c(flipped) != 0xE3069283U);
}

TEST_CASE("crc32c chains and both paths agree on every length and alignment", "[unit]") {
  std::mt19937 rng(42);
  std::vector<std::byte> data(4096 + 16);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  INFO("hardware CRC32C available: " << crc32c_hardware_available());
  for (std::size_t start = 0; start < 9; ++start) {
    for (std::size_t len : {0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 1000, 4096}) {
      const std::span<const std::byte> s(data.data() + start, len);
      const std::uint32_t whole = crc32c_portable(s);
      REQUIRE(crc32c(s) == whole);
      const std::size_t cut = len / 3;
      REQUIRE(crc32c(s.subspan(cut), crc32c(s.first(cut))) == whole);
      REQUIRE(crc32c_portable(s.subspan(cut), crc32c_portable(s.first(cut))) == whole);
    }
  }
}
