#pragma once
// CRC32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78, initial and final value
// 0xFFFFFFFF): the checksum of every checkpoint segment. Chosen over CRC32 (zlib) because x86
// has an instruction for it (SSE4.2 `crc32`), which checksums at several GB/s, so verifying a
// checkpoint costs little beside reading it; the table-driven slicing-by-8 path is the portable
// fallback and the reference the hardware path is tested against. Both give the same values
// (RFC 3720 test vectors in tests/checkpoint/test_crc32c.cpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace zero::checkpoint {

namespace detail {

/// The eight slicing-by-8 tables; table 0 is the classic byte-at-a-time table.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc32c_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) ? (c >> 1) ^ 0x82F63B78U : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t i = 0; i < 256; ++i) {
      t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFU];
    }
  }
  return t;
}

/// Computed at compile time: a constant, not mutable global state.
inline constexpr auto crc32c_tables = make_crc32c_tables();

#if defined(__x86_64__) && defined(__GNUC__)
/// The SSE4.2 path on the raw (pre-inverted) state; compiled for SSE4.2 regardless of the
/// build's -march, called only after a run-time CPU check.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_raw_sse42(std::uint32_t state,
                                                                        const unsigned char* p,
                                                                        std::size_t n) {
  std::uint64_t s = state;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    s = __builtin_ia32_crc32di(s, word);
  }
  auto s32 = static_cast<std::uint32_t>(s);
  for (; n > 0; --n, ++p) s32 = __builtin_ia32_crc32qi(s32, *p);
  return s32;
}
#endif

/// The table-driven path on the raw state: eight bytes per step through eight tables.
inline std::uint32_t crc32c_raw_portable(std::uint32_t state, const unsigned char* p,
                                         std::size_t n) {
  const auto& t = crc32c_tables;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian host (checked in io/element_conversion.hpp)
    word ^= state;
    state = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
            t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
            t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
  }
  for (; n > 0; --n, ++p) state = t[0][(state ^ *p) & 0xFFU] ^ (state >> 8);
  return state;
}

}  // namespace detail

/// True when this CPU has the CRC32C instruction (then crc32c uses it).
inline bool crc32c_hardware_available() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

/// CRC32C of bytes continuing from crc, the checksum of the bytes before them (0 to start):
/// crc32c(b, crc32c(a)) == crc32c(a followed by b). Table-driven, never the instruction.
inline std::uint32_t crc32c_portable(std::span<const std::byte> bytes, std::uint32_t crc = 0) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  return ~detail::crc32c_raw_portable(~crc, p, bytes.size());
}

/// CRC32C of bytes continuing from crc (0 to start), with the CPU instruction when available.
inline std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
#if defined(__x86_64__) && defined(__GNUC__)
  if (crc32c_hardware_available()) return ~detail::crc32c_raw_sse42(~crc, p, bytes.size());
#endif
  return ~detail::crc32c_raw_portable(~crc, p, bytes.size());
}

}  // namespace zero::checkpoint
