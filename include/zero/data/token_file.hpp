#pragma once
// Token files: a flat stream of token ids on disk, memory-mapped so that any rank reads any
// window without loading the file. The default format is llm.c's (so its prepared data sets
// work unchanged): a header of 256 little-endian int32 (magic, version, token count, the rest
// zero), then the tokens: uint16 under GPT-2's header (magic 20240520, version 1) or uint32 under
// Llama 3's (magic 20240801, version 7); files of uint32 that zero wrote before it used Llama 3's
// header (20240520, version 2) still read. Headerless streams of little-endian uint16 or int32
// are accepted when asked for explicitly.
// docs/data.md describes the format.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/io/file.hpp>

namespace zero::data {

/// A token file or token stream is malformed or does not fit the requested use.
class DataError : public IoError {
 public:
  using IoError::IoError;
};

/// How the tokens of a file are laid out.
enum class TokenFormat {
  llmc,     ///< llm.c: 256-int32 header (magic, version, count), then uint16 or uint32 tokens.
  raw_u16,  ///< No header: little-endian uint16 tokens to the end of the file.
  raw_i32,  ///< No header: little-endian int32 tokens to the end of the file.
};

/// The llm.c header's magic number (its first int32) for uint16 tokens (GPT-2's, version 1).
inline constexpr std::int32_t llmc_magic = 20240520;
/// The llm.c header's magic number for uint32 tokens (Llama 3's, version 7).
inline constexpr std::int32_t llmc_magic_u32 = 20240801;
/// The llm.c header's version for uint32 tokens.
inline constexpr std::int32_t llmc_version_u32 = 7;
/// int32 entries in an llm.c header.
inline constexpr std::size_t llmc_header_ints = 256;
/// Bytes in an llm.c header.
inline constexpr std::size_t llmc_header_bytes = llmc_header_ints * sizeof(std::int32_t);

/// A read-only sequence of token ids, mapped from a file or held in memory.
class TokenFile {
 public:
  /// Maps path as format; throws IoError if it cannot be read and DataError (naming the file and
  /// what is wrong) for a bad magic, version, count or size.
  static TokenFile open(const std::filesystem::path& path, TokenFormat format = TokenFormat::llmc) {
    TokenFile tokens;
    tokens.map_.emplace(path);
    const io::MappedFile& map = *tokens.map_;
    const std::string file = path.string();
    const std::byte* bytes = map.data();
    const std::uint64_t size = map.size();
    if (format == TokenFormat::llmc) {
      expect<DataError>(size >= llmc_header_bytes, "token file '", file, "' has ", size,
                        " bytes, less than llm.c's ", llmc_header_bytes,
                        "-byte header (a raw token stream? open it as raw_u16 or raw_i32)");
      std::int32_t header[3];
      std::memcpy(header, bytes, sizeof(header));
      expect<DataError>(header[0] == llmc_magic || header[0] == llmc_magic_u32, "token file '",
                        file, "': magic ", header[0], " is not llm.c's ", llmc_magic,
                        " (uint16 tokens) or ", llmc_magic_u32,
                        " (uint32 tokens) (a raw token stream? open it as raw_u16 or raw_i32)");
      const bool u16 = header[0] == llmc_magic && header[1] == 1;
      const bool u32 = (header[0] == llmc_magic_u32 && header[1] == llmc_version_u32) ||
                       (header[0] == llmc_magic && header[1] == 2);  // zero's earlier uint32 files
      expect<DataError>(u16 || u32, "token file '", file, "': version ", header[1],
                        " is unknown for magic ", header[0], "; expected ",
                        header[0] == llmc_magic ? "1 (uint16 tokens)" : "7 (uint32 tokens)");
      expect<DataError>(header[2] >= 0, "token file '", file, "': token count ", header[2],
                        " is negative");
      tokens.width_ = u16 ? 2 : 4;
      tokens.count_ = header[2];
      const std::uint64_t expected =
          llmc_header_bytes + static_cast<std::uint64_t>(tokens.count_) * tokens.width_;
      expect<DataError>(size == expected, "token file '", file, "': the header promises ",
                        tokens.count_, " tokens of ", tokens.width_, " bytes (", expected,
                        " bytes in all) but the file has ", size, " bytes");
      tokens.tokens_ = bytes + llmc_header_bytes;
    } else {
      tokens.width_ = format == TokenFormat::raw_u16 ? 2 : 4;
      tokens.signed_ = format == TokenFormat::raw_i32;
      expect<DataError>(size % static_cast<std::uint64_t>(tokens.width_) == 0, "token file '", file,
                        "': ", size, " bytes is not a whole number of ", tokens.width_,
                        "-byte tokens");
      tokens.count_ = static_cast<std::int64_t>(size / static_cast<std::uint64_t>(tokens.width_));
      tokens.tokens_ = bytes;
    }
    tokens.name_ = file;
    return tokens;
  }

  /// Tokens held in memory (tests, generated data); name appears in error messages.
  static TokenFile from_tokens(std::vector<std::int32_t> ids, std::string name = "<memory>") {
    TokenFile tokens;
    tokens.owned_ = std::move(ids);
    tokens.width_ = 4;
    tokens.signed_ = true;
    tokens.count_ = static_cast<std::int64_t>(tokens.owned_.size());
    tokens.tokens_ = reinterpret_cast<const std::byte*>(tokens.owned_.data());
    tokens.name_ = std::move(name);
    return tokens;
  }

  TokenFile(TokenFile&&) noexcept = default;
  TokenFile& operator=(TokenFile&&) = delete;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  /// Number of tokens.
  std::int64_t size() const { return count_; }
  /// Bytes per stored token (2 or 4).
  int token_bytes() const { return width_; }
  /// The file's path, or the name given to in-memory tokens.
  const std::string& name() const { return name_; }

  /// Token i (bounds-checked).
  std::int32_t operator[](std::int64_t i) const {
    expect<DataError>(i >= 0 && i < count_, "token file '", name_, "': token ", i,
                      " is outside its ", count_, " tokens");
    return load(i);
  }

  /// Copies tokens [first, first + out.size()) into out as int32; throws DataError naming the
  /// file if the range is outside it or a uint32 token does not fit int32.
  void copy(std::int64_t first, std::span<std::int32_t> out) const {
    const auto count = static_cast<std::int64_t>(out.size());
    expect<DataError>(first >= 0 && first <= count_ && count <= count_ - first, "token file '",
                      name_, "': tokens [", first, ", ", first + count, ") are outside its ",
                      count_, " tokens");
    for (std::int64_t i = 0; i < count; ++i) out[static_cast<std::size_t>(i)] = load(first + i);
  }

 private:
  TokenFile() = default;

  /// Token i, unchecked; memcpy because the mapping gives no alignment guarantee for raw files.
  std::int32_t load(std::int64_t i) const {
    const std::byte* p = tokens_ + static_cast<std::size_t>(i) * static_cast<std::size_t>(width_);
    if (width_ == 2) {
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    if (signed_) {
      std::int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    expect<DataError>(v <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()),
                      "token file '", name_, "': token ", i, " = ", v, " does not fit int32");
    return static_cast<std::int32_t>(v);
  }

  std::optional<io::MappedFile> map_;
  std::vector<std::int32_t> owned_;
  const std::byte* tokens_ = nullptr;
  std::int64_t count_ = 0;
  int width_ = 2;
  bool signed_ = false;
  std::string name_;
};

/// Writes tokens to path atomically in format. llmc writes GPT-2's header and uint16 tokens when
/// every token fits 16 bits and Llama 3's header and uint32 tokens otherwise, as llm.c's
/// writer does; raw_u16 refuses tokens outside [0, 65535].
/// Throws DataError naming the file and the first offending token.
inline void write_token_file(const std::filesystem::path& path, std::span<const std::int32_t> ids,
                             TokenFormat format = TokenFormat::llmc) {
  const std::string file = path.string();
  bool fits_u16 = true, non_negative = true;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    fits_u16 = fits_u16 && ids[i] >= 0 && ids[i] <= 0xFFFF;
    non_negative = non_negative && ids[i] >= 0;
    if (format == TokenFormat::raw_u16 && !fits_u16) {
      raise<DataError>("token file '", file, "': token ", i, " = ", ids[i],
                       " does not fit the raw_u16 format");
    }
    if (format == TokenFormat::llmc && !non_negative) {
      raise<DataError>("token file '", file, "': token ", i, " = ", ids[i],
                       " is negative; llm.c files hold unsigned tokens");
    }
  }
  io::AtomicFile out(path);
  const bool narrow = format == TokenFormat::raw_u16 || (format == TokenFormat::llmc && fits_u16);
  if (format == TokenFormat::llmc) {
    expect<DataError>(
        ids.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
        "token file '", file, "': ", ids.size(),
        " tokens exceed what llm.c's int32 count holds; split the data");
    std::int32_t header[llmc_header_ints] = {};
    header[0] = narrow ? llmc_magic : llmc_magic_u32;
    header[1] = narrow ? 1 : llmc_version_u32;
    header[2] = static_cast<std::int32_t>(ids.size());
    out.write(header, sizeof(header));
  }
  // Chunks keep memory bounded for large streams.
  constexpr std::size_t chunk = 1 << 16;
  std::vector<std::uint16_t> narrow_chunk;
  for (std::size_t done = 0; done < ids.size(); done += chunk) {
    const std::size_t n = std::min(chunk, ids.size() - done);
    if (narrow) {
      narrow_chunk.assign(ids.begin() + static_cast<std::ptrdiff_t>(done),
                          ids.begin() + static_cast<std::ptrdiff_t>(done + n));
      out.write(narrow_chunk.data(), n * sizeof(std::uint16_t));
    } else {
      out.write(ids.data() + done, n * sizeof(std::int32_t));
    }
  }
  out.commit();
}

}  // namespace zero::data
