// Streamed safetensors export: the consolidated file equals the logical tensors (f32 bitwise,
// bf16 as the rounding of each f32), names are mapped, memory stays within the chunk bound
// even for tensors larger than a chunk, and a corrupted segment aborts without an output file.
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/checkpoint/checkpoint.hpp>
#include <zero/io/safetensors_reader.hpp>

#include "../support/temp_dir.hpp"
#include "checkpoint_test_util.hpp"

using namespace zero;
using namespace zero::checkpoint;
using namespace zero::checkpoint::testing;
using Catch::Contains;
using zero::testing::TempDir;

namespace {
/// The test tensors with finite f32 values (bf16 rounding is then well defined).
std::vector<LogicalTensor> finite_tensors() {
  auto tensors = make_tensors(5, 40);
  for (auto& t : tensors) {
    if (t.spec.dtype != DType::f32) continue;
    std::vector<float> v(static_cast<std::size_t>(t.spec.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] =
          static_cast<float>(static_cast<std::int64_t>(bits_of(1, 2, i) % 20001) - 10000) / 977.0f;
    }
    if (!v.empty()) std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  }
  return tensors;
}
}  // namespace

TEST_CASE("export writes one safetensors file equal to the logical tensors", "[unit]") {
  TempDir dir("ckpt-export");
  const auto tensors = finite_tensors();
  save_with_ranks(3, dir.path(), "t", tensors, 21);
  const Reader reader(dir.path(), "t");
  const std::size_t chunk = 1000;  // bytes: far smaller than most tensors
  const auto mapping = [](std::string_view name) {
    return name.starts_with("transformer.") ? std::string(name.substr(12)) : std::string(name);
  };

  SECTION("f32 and integer tensors, mapped names") {
    const auto out = dir.path() / "model.safetensors";
    std::vector<std::string> names;
    for (const auto& t : tensors) {
      if (t.spec.dtype == DType::f32 || t.spec.dtype == DType::i64) names.push_back(t.spec.name);
    }
    const ExportResult r = export_safetensors(reader, names, out, DType::f32, mapping, {chunk});
    CHECK(r.tensors == names.size());
    CHECK(r.bytes_written == std::filesystem::file_size(out));
    CHECK(r.peak_buffer_bytes <= chunk);  // no conversion: only the staging chunk
    const io::SafetensorsReader file(out);
    CHECK(file.tensors().size() == names.size());
    for (const auto& t : tensors) {
      if (t.spec.dtype != DType::f32 && t.spec.dtype != DType::i64) continue;
      const io::TensorInfo& info = file.info(mapping(t.spec.name));
      CHECK(info.shape == t.spec.shape);
      CHECK(info.dtype == t.spec.dtype);
      std::vector<std::byte> bytes(info.bytes());
      file.read_bytes(info.name, 0, bytes);
      CHECK(same_bytes(t, 0, bytes));
    }
  }
  SECTION("bf16, selected tensors") {
    const auto out = dir.path() / "model-bf16.safetensors";
    const auto& w = tensors[0];
    const ExportResult r = export_safetensors(reader, {w.spec.name, tensors[9].spec.name}, out,
                                              DType::bf16, {}, {chunk});
    CHECK(r.tensors == 2);
    CHECK(r.peak_buffer_bytes <= chunk + chunk / 2);  // staging + its bf16 conversion
    const io::SafetensorsReader file(out);
    CHECK(file.tensors().size() == 2);
    CHECK(file.info(tensors[9].spec.name).dtype == DType::i64);  // integers keep their dtype
    const auto got = file.read_vector<bf16>(w.spec.name);
    std::vector<float> want(got.size());
    std::memcpy(want.data(), w.bytes.data(), w.bytes.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i].bits != bf16(want[i]).bits;
    CHECK(wrong == 0);
  }
  SECTION("two tensors mapped to one name are refused") {
    CHECK_THROWS_WITH(export_safetensors(reader, {}, dir.path() / "x.safetensors", DType::f32,
                                         [](std::string_view) { return std::string("same"); }),
                      Contains("'same'"));
    CHECK_FALSE(std::filesystem::exists(dir.path() / "x.safetensors"));
  }
}

TEST_CASE("export of a corrupted checkpoint fails and leaves no output file", "[unit]") {
  TempDir dir("ckpt-export-bad");
  const auto tensors = finite_tensors();
  save_with_ranks(2, dir.path(), "t", tensors, 4);
  std::string shard;
  std::uint64_t at = 0;
  {
    const Reader reader(dir.path(), "t");
    const SegmentRecord& s = reader.tensor(tensors[3].spec.name).segments.back();
    shard = reader.index().files[static_cast<std::size_t>(s.file)].name;
    at = s.byte_end - 1;
  }
  {
    std::fstream f(dir.path() / "t" / shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(c);
  }
  const Reader reader(dir.path(), "t");
  const auto out = dir.path() / "model.safetensors";
  CHECK_THROWS_WITH(export_safetensors(reader, {}, out, DType::bf16, {}, {4096}),
                    Contains("CRC32C") && Contains(tensors[3].spec.name) && Contains(shard));
  CHECK_FALSE(std::filesystem::exists(out));
}

TEST_CASE("a square tensor selected for transposition is written transposed", "[unit]") {
  // Its transposed shape equals its stored one (GPT-2's [C, C] attn.c_proj.weight): the export
  // once told the two apart by shape and wrote it as stored.
  TempDir dir("ckpt-export-square");
  const std::int64_t n = 6;
  LogicalTensor square{{"h.0.attn.c_proj.weight", DType::f32, {n, n}}, {}};
  std::vector<float> stored(static_cast<std::size_t>(n * n));
  for (std::size_t i = 0; i < stored.size(); ++i) stored[i] = static_cast<float>(i);
  square.bytes.resize(stored.size() * sizeof(float));
  std::memcpy(square.bytes.data(), stored.data(), square.bytes.size());
  save_with_ranks(2, dir.path(), "t", {square}, 4);
  const Reader reader(dir.path(), "t");
  const auto out = dir.path() / "t.safetensors";
  ExportOptions options;
  options.transpose = [](std::string_view) { return true; };
  export_safetensors(reader, {}, out, DType::f32, {}, options);
  const auto got =
      io::SafetensorsReader(out).read_vector<float>(square.spec.name, io::DTypeRule::convert);
  std::size_t wrong = 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    for (std::size_t c = 0; c < static_cast<std::size_t>(n); ++c) {
      wrong +=
          got[c * static_cast<std::size_t>(n) + r] != stored[r * static_cast<std::size_t>(n) + c];
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("export keeps the leading rows of a padded embedding", "[unit]") {
  // At tp 2 the byte vocabulary (257 tokens) is stored as 258 rows: the export wrote [258, C],
  // which Hugging Face and load_gpt2_weights refuse, and nothing could trim it.
  TempDir dir("ckpt-export-rows");
  const std::int64_t rows = 7, cols = 5;
  LogicalTensor wte{{"transformer.wte.weight", DType::f32, {rows, cols}}, {}};
  std::vector<float> stored(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < stored.size(); ++i) stored[i] = static_cast<float>(i) * 0.5f;
  wte.bytes.resize(stored.size() * sizeof(float));
  std::memcpy(wte.bytes.data(), stored.data(), wte.bytes.size());
  save_with_ranks(3, dir.path(), "t", {wte}, 4);  // in three ranks' segments
  const Reader reader(dir.path(), "t");
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const std::size_t chunk : {std::size_t{12}, std::size_t{1} << 20}) {
      INFO(name_of(dtype) << ", chunk " << chunk);
      const auto out = dir.path() / "rows.safetensors";
      ExportOptions options;
      options.chunk_bytes = chunk;
      options.leading_rows = [](std::string_view name) -> std::optional<std::int64_t> {
        if (name.ends_with("wte.weight")) return 6;
        return std::nullopt;
      };
      export_safetensors(reader, {}, out, dtype, {}, options);
      const io::SafetensorsReader file(out);
      CHECK(file.info(wte.spec.name).shape == std::vector<std::int64_t>{6, cols});
      const auto got = file.read_vector<float>(wte.spec.name, io::DTypeRule::convert);
      REQUIRE(got.size() == static_cast<std::size_t>(6 * cols));
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        wrong += got[i] != (dtype == DType::f32 ? stored[i] : float(bf16(stored[i])));
      }
      CHECK(wrong == 0);
    }
  }
  ExportOptions bad;
  bad.leading_rows = [](std::string_view) -> std::optional<std::int64_t> { return 8; };
  CHECK_THROWS_WITH(
      export_safetensors(reader, {}, dir.path() / "bad.safetensors", DType::f32, {}, bad),
      Contains("cannot keep its first 8 rows") && Contains("transformer.wte.weight"));
  CHECK_FALSE(std::filesystem::exists(dir.path() / "bad.safetensors"));
}

TEST_CASE("a recorded table's padding is dropped from the table and its optimizer states",
          "[unit]") {
  // A run at tp 2 stores 257 tokens as 258 rows and records 257 rows in use: the export keeps
  // 257 rows of the master and of every state ("<parameter>/exp_avg"), which a limit by the
  // tensor's own name left padded; a parameter without a record keeps all its rows.
  TempDir dir("ckpt-export-in-use");
  const std::int64_t rows = 7, in_use = 5, cols = 3;
  auto table = [&](const std::string& name, float base) {
    LogicalTensor t{{name, DType::f32, {rows, cols}}, {}};
    std::vector<float> v(static_cast<std::size_t>(rows * cols));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<float>(i);
    const auto* first = reinterpret_cast<const std::byte*>(v.data());
    t.bytes.assign(first, first + v.size() * sizeof(float));
    return t;
  };
  const std::vector<LogicalTensor> tensors = {
      table("transformer.wte.weight", 0.0f), table("transformer.wte.weight/exp_avg", 100.0f),
      table("transformer.wte.weight/exp_avg_sq", 200.0f), table("other.weight", 300.0f),
      table("other.weight/exp_avg", 400.0f)};
  const nlohmann::json engine = {{rows_in_use_key, {{"transformer.wte.weight", in_use}}}};
  save_with_ranks(2, dir.path(), "t", tensors, 9, engine);
  const Reader reader(dir.path(), "t");
  CHECK(parameter_of("transformer.wte.weight/exp_avg") == "transformer.wte.weight");
  CHECK(parameter_of("transformer.wte.weight") == "transformer.wte.weight");
  ExportOptions options;
  options.leading_rows = recorded_rows_limit(reader);
  const auto out = dir.path() / "in_use.safetensors";
  export_safetensors(reader, reader.names(), out, DType::f32, {}, options);
  const io::SafetensorsReader file(out);
  for (const LogicalTensor& t : tensors) {
    INFO(t.spec.name);
    const bool padded = t.spec.name.starts_with("transformer.wte.weight");
    const std::int64_t kept = padded ? in_use : rows;
    CHECK(file.info(t.spec.name).shape == std::vector<std::int64_t>{kept, cols});
    const auto got = file.read_vector<float>(t.spec.name, io::DTypeRule::exact);
    REQUIRE(got.size() == static_cast<std::size_t>(kept * cols));
    CHECK(std::memcmp(got.data(), t.bytes.data(), got.size() * sizeof(float)) == 0);
  }
  // Without the record nothing is trimmed.
  save_with_ranks(2, dir.path(), "plain", tensors, 9);
  const Reader plain(dir.path(), "plain");
  CHECK_FALSE(recorded_rows_limit(plain)("transformer.wte.weight/exp_avg").has_value());
  CHECK(recorded_rows_limit(reader)("transformer.wte.weight/exp_avg") == in_use);
  CHECK_FALSE(recorded_rows_limit(reader)("other.weight").has_value());
}

TEST_CASE("export writes selected 2-D tensors transposed, in bounded blocks", "[unit]") {
  TempDir dir("ckpt-export-t");
  const auto tensors = finite_tensors();
  save_with_ranks(3, dir.path(), "t", tensors, 8);
  const Reader reader(dir.path(), "t");
  const auto& w = tensors[0];  // [7, 200] f32
  const auto rows = static_cast<std::size_t>(w.spec.shape[0]);
  const auto cols = static_cast<std::size_t>(w.spec.shape[1]);
  std::vector<float> stored(rows * cols);
  std::memcpy(stored.data(), w.bytes.data(), w.bytes.size());
  for (const DType dtype : {DType::f32, DType::bf16}) {
    const auto out = dir.path() / "t.safetensors";
    ExportOptions options;
    options.chunk_bytes = rows * 4 * 3;  // three output rows per block
    options.transpose = [&](std::string_view name) { return name == w.spec.name; };
    const ExportResult r =
        export_safetensors(reader, {w.spec.name, tensors[2].spec.name}, out, dtype, {}, options);
    CHECK(r.tensors == 2);
    const io::SafetensorsReader file(out);
    CHECK(file.info(w.spec.name).shape ==
          std::vector<std::int64_t>{w.spec.shape[1], w.spec.shape[0]});
    CHECK(file.info(tensors[2].spec.name).shape == tensors[2].spec.shape);
    const auto got = file.read_vector<float>(w.spec.name, io::DTypeRule::convert);
    std::size_t wrong = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      for (std::size_t r = 0; r < rows; ++r) {
        const float want = stored[r * cols + c];
        const float expect = dtype == DType::bf16 ? static_cast<float>(bf16(want)) : want;
        wrong += got[c * rows + r] != expect;
      }
    }
    CHECK(wrong == 0);
    std::filesystem::remove(out);
  }
  ExportOptions bad;
  bad.transpose = [](std::string_view) { return true; };
  CHECK_THROWS_WITH(
      export_safetensors(reader, {tensors[5].spec.name}, dir.path() / "b", DType::f32, {}, bad),
      Contains("only 2-D tensors transpose") && Contains(tensors[5].spec.name));
}
