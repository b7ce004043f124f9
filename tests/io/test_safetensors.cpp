// safetensors: round trips for every dtype and odd shapes, range reads, dtype conversion,
// streamed and atomic writing, and one hand-made file per malformation.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/io/safetensors.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::io;
using zero::testing::TempDir;

namespace {

/// Deterministic, distinct-per-element bytes for a tensor of dtype: value i is i*0.37 - 3 for
/// floats (so bf16/f16 see fractions and negatives) and i*7 - 5 for integers (wrapped for u8/u16).
std::vector<std::byte> sample_bytes(DType dtype, std::int64_t numel) {
  std::vector<std::byte> bytes(static_cast<std::size_t>(numel) * size_of(dtype));
  visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t i = 0; i < numel; ++i) {
      T value;
      if constexpr (is_half_type<T> || std::is_floating_point_v<T>) {
        value = convert<T>(static_cast<double>(i) * 0.37 - 3.0);
      } else {
        value = static_cast<T>(i * 7 - 5);
      }
      std::memcpy(bytes.data() + static_cast<std::size_t>(i) * sizeof(T), &value, sizeof(T));
    }
  });
  return bytes;
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

/// A little-endian 8-byte header length followed by header and data: a hand-made file.
std::string craft(const std::string& header, const std::string& data = "") {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[static_cast<std::size_t>(i)] = static_cast<char>(header.size() >> (8 * i));
  return bytes + header + data;
}

}  // namespace

TEST_CASE("safetensors round-trips every dtype and odd shapes", "[unit][safetensors]") {
  TempDir dir("st-roundtrip");
  const std::vector<std::vector<std::int64_t>> shapes = {
      {}, {0}, {1}, {7}, {3, 5}, {3, 0, 2}, {2, 3, 5, 1}, {1, 2, 1, 2, 1, 2, 1}};
  std::vector<TensorDecl> decls;
  std::vector<std::vector<std::byte>> data;
  for (DType dtype : all_dtypes) {
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      decls.emplace_back(std::string(name_of(dtype)) + ".shape" + std::to_string(s), dtype,
                         shapes[s]);
      data.push_back(sample_bytes(dtype, numel_of(shapes[s])));
    }
  }
  const auto path = dir / "model.safetensors";
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "42"}};
  {
    SafetensorsWriter writer(path, decls, metadata);
    for (std::size_t i = 0; i < decls.size(); ++i) writer.write_bytes(decls[i].name, data[i]);
    CHECK(writer.next_tensor().empty());
    CHECK_FALSE(std::filesystem::exists(path));  // nothing under the final name before commit
    writer.commit();
  }
  REQUIRE(std::filesystem::exists(path));
  // Only the final file remains: the temporary was renamed, not copied.
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()),
                      std::filesystem::directory_iterator()) == 1);

  const std::string raw = zero::testing::read_file(path);
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, raw.data(), 8);
  CHECK(header_bytes % 8 == 0);  // padded so the data start 8-byte aligned
  CHECK(raw[8] == '{');

  SafetensorsReader reader(path);
  CHECK(reader.metadata() == metadata);
  REQUIRE(reader.tensors().size() == decls.size());
  for (std::size_t i = 0; i < decls.size(); ++i) {
    INFO(decls[i].name);
    const TensorInfo& info = reader.info(decls[i].name);
    CHECK(info.dtype == decls[i].dtype);
    CHECK(info.shape == decls[i].shape);
    CHECK(info.bytes() == data[i].size());
    std::vector<std::byte> back(data[i].size());
    reader.read_bytes(decls[i].name, 0, back);
    CHECK(back == data[i]);
  }
  // Typed reads of a rank-0 and a 2-D tensor.
  CHECK(reader.read_vector<double>("f64.shape0") == std::vector<double>{-3.0});
  std::vector<float> f(15);
  reader.read("f32.shape4", Tensor<float>(f.data(), Shape{3, 5}));
  CHECK(f[14] == convert<float>(14 * 0.37 - 3.0));
  CHECK(reader.read_vector<std::int32_t>("i32.shape3")[6] == 37);
  CHECK(reader.read_vector<std::uint8_t>("u8.shape5").empty());
}

TEST_CASE("safetensors writes the reference layout byte for byte", "[unit][safetensors]") {
  // What the reference implementation writes for {"a": f32 [1, 2]} with no metadata: compact
  // JSON, padded with spaces to a multiple of 8, then the raw little-endian data.
  TempDir dir("st-bytes");
  const auto path = dir / "a.safetensors";
  SafetensorsWriter writer(path, {TensorDecl("a", DType::f32, std::vector<std::int64_t>{2})});
  const float values[] = {1.0f, 2.0f};
  writer.write("a", Tensor<const float>(values, Shape{2}));
  writer.commit();
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string expected_header = header + std::string((8 - header.size() % 8) % 8, ' ');
  std::string data(8, '\0');
  std::memcpy(data.data(), values, 8);
  CHECK(zero::testing::read_file(path) == craft(expected_header, data));
}

TEST_CASE("safetensors range reads equal the slice of a full read", "[unit][safetensors]") {
  TempDir dir("st-range");
  const auto path = dir / "r.safetensors";
  const auto f32 = sample_bytes(DType::f32, 13 * 17);
  const auto b16 = sample_bytes(DType::bf16, 13 * 17);
  {
    SafetensorsWriter writer(path, {TensorDecl("w", DType::f32, Shape{13, 17}),
                                    TensorDecl("h", DType::bf16, Shape{13, 17})});
    writer.write_bytes("w", f32);
    writer.write_bytes("h", b16);
    writer.commit();
  }
  SafetensorsReader reader(path);
  const auto full = reader.read_vector<float>("w");
  const auto full_converted = reader.read_vector<float>("h", DTypeRule::convert);
  for (std::int64_t first : {0, 1, 16, 17, 100, 220}) {
    for (std::int64_t count : {0, 1, 5, 17, 21}) {
      if (first + count > 13 * 17) continue;
      std::vector<float> part(static_cast<std::size_t>(count));
      reader.read_elements("w", first, Tensor<float>(part.data(), Shape{count}));
      CHECK(std::equal(part.begin(), part.end(), full.begin() + first));
      reader.read_elements("h", first, Tensor<float>(part.data(), Shape{count}),
                           DTypeRule::convert);
      CHECK(std::equal(part.begin(), part.end(), full_converted.begin() + first));
    }
  }
  // The last element alone, and the whole tensor as shards of 4 ranks (uneven last shard).
  std::vector<float> shards(13 * 17);
  for (int rank = 0; rank < 4; ++rank) {
    const std::int64_t per = (13 * 17 + 3) / 4;
    const std::int64_t first = rank * per, count = std::min<std::int64_t>(per, 13 * 17 - first);
    reader.read_elements("w", first, Tensor<float>(shards.data() + first, Shape{count}));
  }
  CHECK(shards == full);
  std::vector<float> one(1);
  CHECK_THROWS_WITH(reader.read_elements("w", 13 * 17, Tensor<float>(one.data(), Shape{1})),
                    Catch::Contains("r.safetensors") && Catch::Contains("'w'") &&
                        Catch::Contains("outside its 221 elements"));
  std::vector<std::byte> bytes(3);
  reader.read_bytes("w", 6, bytes);
  CHECK(std::memcmp(bytes.data(), f32.data() + 6, 3) == 0);
}

TEST_CASE("safetensors converts dtypes on read and write only when asked", "[unit][safetensors]") {
  TempDir dir("st-convert");
  const auto path = dir / "c.safetensors";
  std::vector<float> master = {0.1f, -2.5f, 3.14159f, 1e-3f, 65504.0f, 7.0f};
  std::vector<std::int64_t> ids = {1, -2, 70000};
  {
    SafetensorsWriter writer(
        path, {TensorDecl("bf", DType::bf16, Shape{2, 3}), TensorDecl("f", DType::f32, Shape{6}),
               TensorDecl("ids", DType::i32, Shape{3})});
    const Tensor<const float> m(master.data(), Shape{2, 3});
    CHECK_THROWS_WITH(writer.write("bf", m), Catch::Contains("c.safetensors") &&
                                                 Catch::Contains("'bf'") &&
                                                 Catch::Contains("DTypeRule::convert"));
    writer.write("bf", m, DTypeRule::convert);  // f32 master exported as bf16
    writer.write("f", Tensor<const float>(master.data(), Shape{6}));
    CHECK_THROWS_WITH(
        writer.write("ids", Tensor<const float>(master.data(), Shape{3}), DTypeRule::convert),
        Catch::Contains("cannot convert"));
    writer.write("ids", Tensor<const std::int64_t>(ids.data(), Shape{3}), DTypeRule::convert);
    writer.commit();
  }
  SafetensorsReader reader(path);
  const auto bf = reader.read_vector<bf16>("bf");
  for (std::size_t i = 0; i < master.size(); ++i) CHECK(bf[i] == bf16(master[i]));
  const auto widened = reader.read_vector<float>("bf", DTypeRule::convert);
  for (std::size_t i = 0; i < master.size(); ++i) CHECK(widened[i] == static_cast<float>(bf[i]));
  const auto as_f16 = reader.read_vector<f16>("f", DTypeRule::convert);
  for (std::size_t i = 0; i < master.size(); ++i) CHECK(as_f16[i] == f16(master[i]));
  const auto as_f64 = reader.read_vector<double>("f", DTypeRule::convert);
  CHECK(as_f64[2] == static_cast<double>(master[2]));
  CHECK(reader.read_vector<std::int64_t>("ids", DTypeRule::convert) == ids);
  CHECK_THROWS_WITH(reader.read_vector<std::uint16_t>("ids", DTypeRule::convert),
                    Catch::Contains("c.safetensors") && Catch::Contains("'ids'") &&
                        Catch::Contains("i32 value -2 to u16: it is out of range"));

  CHECK_THROWS_WITH(reader.read_vector<float>("bf"),
                    Catch::Contains("c.safetensors") && Catch::Contains("'bf'") &&
                        Catch::Contains("stored as BF16 but f32 was requested"));
  CHECK_THROWS_WITH(reader.read_vector<std::int32_t>("f", DTypeRule::convert),
                    Catch::Contains("'f'") && Catch::Contains("cannot convert F32 to i32"));
}

TEST_CASE("safetensors writer streams in pieces, in order, atomically", "[unit][safetensors]") {
  TempDir dir("st-stream");
  const auto path = dir / "s.safetensors";
  std::vector<double> a(10), b(4);
  for (int i = 0; i < 10; ++i) a[static_cast<std::size_t>(i)] = i * 1.5;
  for (int i = 0; i < 4; ++i) b[static_cast<std::size_t>(i)] = -i;
  {
    SafetensorsWriter writer(path, {TensorDecl("a", DType::f64, Shape{2, 5}),
                                    TensorDecl("empty", DType::f64, Shape{0, 3}),
                                    TensorDecl("b", DType::f64, Shape{4})});
    CHECK(writer.next_tensor() == "a");
    CHECK_THROWS_WITH(writer.write("b", Tensor<const double>(b.data(), Shape{4})),
                      Catch::Contains("s.safetensors") && Catch::Contains("'b'") &&
                          Catch::Contains("declaration order") && Catch::Contains("'a'"));
    CHECK_THROWS_WITH(writer.write("nope", Tensor<const double>(b.data(), Shape{1})),
                      Catch::Contains("'nope' was not declared"));
    writer.write("a", Tensor<const double>(a.data(), Shape{3}));  // a unit's shard at a time
    writer.write("a", Tensor<const double>(a.data() + 3, Shape{7}));
    CHECK(writer.next_tensor() == "b");  // the empty tensor needs no data
    writer.write("empty", Tensor<const double>(nullptr, Shape{0}));
    CHECK_THROWS_WITH(writer.commit(), Catch::Contains("before tensor 'b'"));
    writer.write("b", Tensor<const double>(b.data(), Shape{2}));
    CHECK_THROWS_WITH(writer.write("b", Tensor<const double>(b.data(), Shape{3})),
                      Catch::Contains("would overflow its 32 bytes"));
    writer.write("b", Tensor<const double>(b.data() + 2, Shape{2}));
    writer.commit();
  }
  SafetensorsReader reader(path);
  CHECK(reader.read_vector<double>("a") == a);
  CHECK(reader.read_vector<double>("b") == b);
  CHECK(reader.read_vector<double>("empty").empty());

  // An abandoned writer leaves neither the final file nor its temporary behind.
  {
    SafetensorsWriter writer(dir / "abandoned.safetensors",
                             {TensorDecl("a", DType::f64, Shape{2, 5})});
    writer.write("a", Tensor<const double>(a.data(), Shape{3}));
  }
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()),
                      std::filesystem::directory_iterator()) == 1);
  // Declarations are checked before anything is written.
  CHECK_THROWS_WITH(
      SafetensorsWriter(dir / "d.safetensors", {TensorDecl("x", DType::f32, Shape{1}),
                                                TensorDecl("x", DType::f32, Shape{2})}),
      Catch::Contains("d.safetensors") && Catch::Contains("'x' is declared twice"));
  CHECK_THROWS_WITH(
      SafetensorsWriter(dir / "d.safetensors", {TensorDecl("__metadata__", DType::f32, Shape{1})}),
      Catch::Contains("reserved"));
  // Bad declarations are refused before any file (temporary or final) is created.
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()),
                      std::filesystem::directory_iterator()) == 1);
}

TEST_CASE("safetensors rejects each kind of malformed file, naming file and tensor",
          "[unit][safetensors]") {
  TempDir dir("st-bad");
  const auto path = dir / "bad.safetensors";
  const auto open_with = [&](const std::string& bytes) {
    zero::testing::write_file(path, bytes);
    SafetensorsReader reader(path);
  };
  // Appends instead of operator+ chains: g++ 12 at -O3 warns falsely (-Wrestrict) on those.
  const auto header_of = [](std::initializer_list<std::pair<std::string, std::string>> entries) {
    std::string h = "{";
    for (const auto& [name, fields] : entries) {
      if (h.size() > 1) h += ',';
      h.append("\"").append(name).append("\":{").append(fields).append("}");
    }
    return h.append("}");
  };
  const std::string eight(8, '\x01');  // data for one f32 [2] tensor

  SECTION("too short for the length field") {
    CHECK_THROWS_WITH(open_with("abc"),
                      Catch::Contains("bad.safetensors") && Catch::Contains("at least the 8-byte"));
  }
  SECTION("header length larger than the file") {
    std::string bytes = craft(R"({"a":{}})");
    bytes[0] = static_cast<char>(200);
    CHECK_THROWS_WITH(open_with(bytes), Catch::Contains("bad.safetensors") &&
                                            Catch::Contains("header length 200 is larger"));
  }
  SECTION("absurd header length") {
    std::string bytes = craft(R"({})");
    bytes[7] = 0x40;  // 2^62
    CHECK_THROWS_AS(open_with(bytes), CheckpointError);
    CHECK_THROWS_WITH(open_with(bytes),
                      Catch::Contains("bad.safetensors") && Catch::Contains("exceeds the limit"));
  }
  SECTION("not JSON") {
    CHECK_THROWS_WITH(open_with(craft(R"({"a": {"dtype": "F32",)")),
                      Catch::Contains("bad.safetensors") && Catch::Contains("not valid JSON"));
    CHECK_THROWS_WITH(open_with(craft("[1, 2]   ")), Catch::Contains("does not start with '{'"));
  }
  SECTION("unknown dtype") {
    const std::string h =
        header_of({{"layer.w", R"("dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2])"}});
    CHECK_THROWS_WITH(open_with(craft(h, "xx")),
                      Catch::Contains("bad.safetensors") && Catch::Contains("'layer.w'") &&
                          Catch::Contains("unknown or unsupported dtype 'F8_E4M3'"));
  }
  SECTION("offsets past the end of the data") {
    const std::string h = header_of({{"w", R"("dtype":"F32","shape":[4],"data_offsets":[0,16])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)),
                      Catch::Contains("bad.safetensors") && Catch::Contains("'w'") &&
                          Catch::Contains("reach past the data section's 8 bytes"));
  }
  SECTION("overlapping tensors") {
    const std::string h = header_of({{"w", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"},
                                     {"v", R"("dtype":"F32","shape":[1],"data_offsets":[4,8])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)),
                      Catch::Contains("bad.safetensors") && Catch::Contains("overlap"));
  }
  SECTION("a name listed twice") {
    // The last entry alone tiles the data, so no offset check can see the first.
    const std::string h = header_of({{"w", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])"},
                                     {"w", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)),
                      Catch::Contains("'w'") && Catch::Contains("lists the name twice"));
  }
  SECTION("a gap between tensors") {
    const std::string h = header_of({{"w", R"("dtype":"F32","shape":[1],"data_offsets":[4,8])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)),
                      Catch::Contains("'w'") && Catch::Contains("leave a gap"));
  }
  SECTION("trailing bytes") {
    const std::string h = header_of({{"w", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)),
                      Catch::Contains("bad.safetensors") && Catch::Contains("trailing bytes"));
  }
  SECTION("byte count that does not match shape and dtype") {
    const std::string h = header_of({{"w", R"("dtype":"F16","shape":[3],"data_offsets":[0,8])"}});
    CHECK_THROWS_WITH(open_with(craft(h, eight)), Catch::Contains("'w'") &&
                                                      Catch::Contains("needs 6 bytes") &&
                                                      Catch::Contains("hold 8"));
  }
  SECTION("malformed entries") {
    const auto with = [&](const std::string& fields) {
      return open_with(craft(header_of({{"w", fields}}), eight));
    };
    CHECK_THROWS_WITH(with(R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])"),
                      Catch::Contains("'w'") && Catch::Contains("not a non-negative integer"));
    CHECK_THROWS_WITH(with(R"("dtype":"F32","shape":[2])"),
                      Catch::Contains("'w'") && Catch::Contains("no \"data_offsets\""));
    CHECK_THROWS_WITH(with(R"("dtype":"F32","shape":[2],"data_offsets":[8,0])"),
                      Catch::Contains("'w'") && Catch::Contains("end before they begin"));
    CHECK_THROWS_WITH(with(R"("dtype":"F32","shape":[2],"data_offsets":[0])"),
                      Catch::Contains("'w'") && Catch::Contains("expected [begin, end]"));
    CHECK_THROWS_WITH(open_with(craft(R"({"__metadata__":{"a":1}})")),
                      Catch::Contains("metadata entry 'a' is not a string"));
  }
  SECTION("missing tensor and mismatched expectations") {
    const std::string h = header_of(
        {{"h.0.attn.c_attn.weight", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"}});
    zero::testing::write_file(path, craft(h, eight));
    SafetensorsReader reader(path);
    CHECK_THROWS_WITH(reader.info("transformer.h.0.attn.c_attn.weight"),
                      Catch::Contains("bad.safetensors") &&
                          Catch::Contains("no tensor 'transformer.h.0.attn.c_attn.weight'") &&
                          Catch::Contains("did you mean 'h.0.attn.c_attn.weight'"));
    std::vector<float> out(2);
    CHECK_THROWS_WITH(reader.read("h.0.attn.c_attn.weight", Tensor<float>(out.data(), Shape{1, 2})),
                      Catch::Contains("bad.safetensors") &&
                          Catch::Contains("'h.0.attn.c_attn.weight'") &&
                          Catch::Contains("has shape [2] but [1, 2] was expected"));
    std::vector<double> wide(2);
    CHECK_THROWS_AS(reader.read("h.0.attn.c_attn.weight", Tensor<double>(wide.data(), Shape{2})),
                    CheckpointError);
  }
  SECTION("a missing file") {
    CHECK_THROWS_AS(SafetensorsReader(dir / "absent.safetensors"), IoError);
    CHECK_THROWS_WITH(SafetensorsReader(dir / "absent.safetensors"),
                      Catch::Contains("absent.safetensors"));
  }
}

TEST_CASE("safetensors reads a file written by the reference implementation",
          "[unit][safetensors]") {
  // Written by safetensors 0.8.0 from numpy arrays (tests/io/data/make_reference_numpy.py):
  // tensors ordered by dtype size then name, metadata first, header padded with spaces.
  SafetensorsReader reader(std::string(ZERO_IO_TEST_DATA) + "/reference_numpy.safetensors");
  CHECK(reader.metadata() ==
        std::map<std::string, std::string>{{"format", "np"}, {"who", "reference"}});
  CHECK(reader.tensors().size() == 7);
  CHECK(reader.read_vector<double>("w.f64") ==
        std::vector<double>{-1.0, -0.75, -0.5, -0.25, 0.0, 0.25});
  CHECK(reader.read_vector<float>("a.f32") == std::vector<float>{-3, -2, -1, 0, 1, 2, 3});
  const auto halves = reader.read_vector<float>("z.f16", DTypeRule::convert);
  CHECK(reader.info("z.f16").shape == std::vector<std::int64_t>{5, 2});
  CHECK(halves[1] == 0.333251953125f);  // numpy's float16(1/3)
  CHECK(halves[9] == 3.0f);
  CHECK(reader.read_vector<std::int64_t>("i64") ==
        std::vector<std::int64_t>{-5, std::int64_t{1} << 40, 7});
  CHECK(reader.info("i32").shape.empty());
  CHECK(reader.read_vector<std::int32_t>("i32") == std::vector<std::int32_t>{42});
  CHECK(reader.read_vector<std::uint16_t>("u16") == std::vector<std::uint16_t>{65535, 0, 12});
  CHECK(reader.info("u8").shape == std::vector<std::int64_t>{3, 0});
  CHECK(reader.read_vector<std::uint8_t>("u8").empty());
}

TEST_CASE("converting elements refuses integers that do not fit and rounds doubles once",
          "[unit][safetensors]") {
  // An id 70000 (a large vocabulary) read as u16 would wrap to 4464; -1 as u8 to 255.
  const std::int64_t ids[] = {1, 70000};
  std::uint16_t narrow[2] = {};
  CHECK_THROWS_WITH(convert_elements(DType::i64, ids, DType::u16, narrow, 2),
                    Catch::Contains("i64 value 70000 to u16") && Catch::Contains("out of range"));
  const std::int32_t negative[] = {-1};
  std::uint8_t byte = 0;
  CHECK_THROWS_WITH(convert_elements(DType::i32, negative, DType::u8, &byte, 1),
                    Catch::Contains("i32 value -1 to u8"));
  const std::int64_t fit[] = {0, 65535};
  convert_elements(DType::i64, fit, DType::u16, narrow, 2);
  CHECK(narrow[1] == 65535);

  // 1 + 2^-8 + 2^-30 is above the bf16 midpoint 1 + 2^-8, but its nearest float is that
  // midpoint, which ties to even (0x3f80): one rounding gives 0x3f81. The same for f16.
  const double above_bf16_tie = 1.0 + 0x1p-8 + 0x1p-30;
  const double above_f16_tie = 1.0 + 0x1p-11 + 0x1p-40;
  bf16 b;
  f16 h;
  convert_elements(DType::f64, &above_bf16_tie, DType::bf16, &b, 1);
  convert_elements(DType::f64, &above_f16_tie, DType::f16, &h, 1);
  CHECK(b.bits == 0x3f81);
  CHECK(h.bits == 0x3c01);
  const double below_bf16_tie = 1.0 + 0x1p-8 - 0x1p-30, exact_tie = 1.0 + 0x1p-8;
  convert_elements(DType::f64, &below_bf16_tie, DType::bf16, &b, 1);
  CHECK(b.bits == 0x3f80);
  convert_elements(DType::f64, &exact_tie, DType::bf16, &b, 1);
  CHECK(b.bits == 0x3f80);  // a true tie still goes to even
  const double negative_above = -above_bf16_tie, tiny = 1e-300, huge = 1e300;
  convert_elements(DType::f64, &negative_above, DType::bf16, &b, 1);
  CHECK(b.bits == 0xbf81);
  convert_elements(DType::f64, &tiny, DType::bf16, &b, 1);
  CHECK(b.bits == 0x0000);
  convert_elements(DType::f64, &huge, DType::bf16, &b, 1);
  CHECK(b.bits == 0x7f80);
}

TEST_CASE("safetensors refuses names and metadata that are not UTF-8, leaving no file",
          "[unit][safetensors]") {
  TempDir dir("st-utf8");
  const auto path = dir / "u.safetensors";
  CHECK_THROWS_WITH(
      SafetensorsWriter(path, {TensorDecl("w", DType::f32, Shape{1})}, {{"source", "\xff"}}),
      Catch::Contains("must be UTF-8"));
  CHECK_THROWS_AS(SafetensorsWriter(path, {TensorDecl("w\xfe", DType::f32, Shape{1})}),
                  CheckpointError);
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("an empty tensor whose other extents multiply past int64 opens with no elements",
          "[unit][safetensors]") {
  // [2^31, 2^32, 0] passed the header's unsigned checks (2^63 fits in 64 unsigned bits), and
  // numel() then multiplied 2^31 by 2^32 in int64: signed overflow before the 0.
  TempDir dir("st-empty");
  const auto path = dir / "empty.safetensors";
  zero::testing::write_file(
      path,
      craft(R"({"e":{"dtype":"F32","shape":[2147483648,4294967296,0],"data_offsets":[0,0]}})"));
  const SafetensorsReader reader(path);
  CHECK(reader.info("e").numel() == 0);
  CHECK(reader.read_vector<float>("e").empty());
}
