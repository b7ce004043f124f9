// Token files: llm.c format (GPT-2's uint16 and Llama 3's uint32 headers) byte for byte, raw
// uint16/int32 streams, and the errors for files that do not match their format.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/data/token_file.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::data;
using zero::testing::TempDir;

namespace {
/// The bytes of the values as they are in memory (little-endian on every host zero supports).
template <class T>
std::string bytes_of(const std::vector<T>& values) {
  std::string s(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(s.data(), values.data(), s.size());
  return s;
}
/// An llm.c header as its Python writer makes it: np.zeros(256, dtype=np.int32) with
/// header[0] = 20240520, header[1] = version, header[2] = count.
std::string llmc_header(std::int32_t magic, std::int32_t version, std::int32_t count) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  return bytes_of(header);
}
}  // namespace

TEST_CASE("llm.c token files are written byte for byte and read back", "[unit][data]") {
  TempDir dir("tokens");
  const std::vector<std::int32_t> ids = {50256, 0, 1, 65535, 464, 257};
  const auto path = dir / "train.bin";
  write_token_file(path, ids);
  const std::vector<std::uint16_t> narrow(ids.begin(), ids.end());
  CHECK(zero::testing::read_file(path) == llmc_header(20240520, 1, 6) + bytes_of(narrow));

  const TokenFile tokens = TokenFile::open(path);
  CHECK(tokens.size() == 6);
  CHECK(tokens.token_bytes() == 2);
  std::vector<std::int32_t> back(6);
  tokens.copy(0, back);
  CHECK(back == ids);
  CHECK(tokens[3] == 65535);
  std::vector<std::int32_t> middle(3);
  tokens.copy(2, middle);
  CHECK(middle == std::vector<std::int32_t>{1, 65535, 464});
  CHECK_THROWS_WITH(tokens.copy(4, middle),
                    Catch::Contains("train.bin") && Catch::Contains("[4, 7) are outside its 6"));

  // Tokens past 16 bits (Llama 3's vocabulary) make a file of uint32 under Llama 3's header, as
  // llm.c's writer makes it (magic 20240801, version 7; llm.c refuses 20240520 version 2).
  const std::vector<std::int32_t> wide = {128000, 5, 70000};
  write_token_file(dir / "wide.bin", wide);
  const std::vector<std::uint32_t> wide_u(wide.begin(), wide.end());
  CHECK(zero::testing::read_file(dir / "wide.bin") ==
        llmc_header(20240801, 7, 3) + bytes_of(wide_u));
  const TokenFile wide_tokens = TokenFile::open(dir / "wide.bin");
  CHECK(wide_tokens.token_bytes() == 4);
  CHECK(wide_tokens[0] == 128000);
  // An llm.c Llama 3 shard reads (it was refused, and the hint to read it as raw_u16 split its
  // tokens), and a file zero wrote before (20240520, version 2) still does.
  zero::testing::write_file(dir / "llama3.bin", llmc_header(20240801, 7, 3) + bytes_of(wide_u));
  zero::testing::write_file(dir / "older.bin", llmc_header(20240520, 2, 3) + bytes_of(wide_u));
  for (const char* name : {"llama3.bin", "older.bin"}) {
    const TokenFile t = TokenFile::open(dir / name);
    std::vector<std::int32_t> got(3);
    t.copy(0, got);
    CHECK(got == wide);
  }

  // An empty file is valid.
  write_token_file(dir / "empty.bin", std::vector<std::int32_t>{});
  CHECK(TokenFile::open(dir / "empty.bin").size() == 0);
}

TEST_CASE("raw uint16 and int32 token streams are read when asked for", "[unit][data]") {
  TempDir dir("raw");
  const std::vector<std::uint16_t> u16 = {7, 65000, 0, 3};
  zero::testing::write_file(dir / "a.u16", bytes_of(u16));
  const TokenFile a = TokenFile::open(dir / "a.u16", TokenFormat::raw_u16);
  CHECK(a.size() == 4);
  CHECK(a[1] == 65000);

  const std::vector<std::int32_t> i32 = {100000, -1, 42};
  zero::testing::write_file(dir / "b.i32", bytes_of(i32));
  const TokenFile b = TokenFile::open(dir / "b.i32", TokenFormat::raw_i32);
  std::vector<std::int32_t> back(3);
  b.copy(0, back);
  CHECK(back == i32);

  // The writer produces the same raw layouts.
  write_token_file(dir / "c.u16", std::vector<std::int32_t>{7, 65000, 0, 3}, TokenFormat::raw_u16);
  CHECK(zero::testing::read_file(dir / "c.u16") == bytes_of(u16));
  write_token_file(dir / "c.i32", i32, TokenFormat::raw_i32);
  CHECK(zero::testing::read_file(dir / "c.i32") == bytes_of(i32));
  CHECK_THROWS_WITH(
      write_token_file(dir / "d.u16", std::vector<std::int32_t>{1, 70000}, TokenFormat::raw_u16),
      Catch::Contains("d.u16") && Catch::Contains("token 1 = 70000"));
  CHECK_FALSE(std::filesystem::exists(dir / "d.u16"));

  // A raw stream opened as llm.c is refused with a hint.
  CHECK_THROWS_WITH(TokenFile::open(dir / "a.u16"),
                    Catch::Contains("a.u16") && Catch::Contains("raw_u16 or raw_i32"));
  zero::testing::write_file(dir / "odd.u16", std::string(5, '\0'));
  CHECK_THROWS_WITH(TokenFile::open(dir / "odd.u16", TokenFormat::raw_u16),
                    Catch::Contains("odd.u16") && Catch::Contains("not a whole number"));
}

TEST_CASE("malformed llm.c token files name the file and the problem", "[unit][data]") {
  TempDir dir("bad-tokens");
  const auto path = dir / "bad.bin";
  const std::string four_tokens(8, '\x01');
  zero::testing::write_file(path, llmc_header(20240519, 1, 4) + four_tokens);
  CHECK_THROWS_AS(TokenFile::open(path), DataError);
  CHECK_THROWS_WITH(TokenFile::open(path),
                    Catch::Contains("bad.bin") && Catch::Contains("magic 20240519"));
  zero::testing::write_file(path, llmc_header(20240520, 3, 4) + four_tokens);
  CHECK_THROWS_WITH(TokenFile::open(path), Catch::Contains("version 3 is unknown"));
  zero::testing::write_file(path, llmc_header(20240801, 1, 4) + four_tokens);
  CHECK_THROWS_WITH(TokenFile::open(path), Catch::Contains("version 1 is unknown for magic "
                                                           "20240801; expected 7"));
  zero::testing::write_file(path, llmc_header(20240520, 1, 5) + four_tokens);
  CHECK_THROWS_WITH(TokenFile::open(path), Catch::Contains("bad.bin") &&
                                               Catch::Contains("promises 5 tokens") &&
                                               Catch::Contains("has 1032 bytes"));
  zero::testing::write_file(path, llmc_header(20240520, 1, 5).substr(0, 100));
  CHECK_THROWS_WITH(TokenFile::open(path), Catch::Contains("less than llm.c's 1024-byte header"));
  CHECK_THROWS_AS(TokenFile::open(dir / "missing.bin"), IoError);
}
