// Hugging Face's sharded safetensors checkpoints: SafetensorsShardWriter splits tensors into
// files at the size limit (Hugging Face's rule) with an index, SafetensorsShards reads any
// tensor's ranges back from the file the index names, and malformed indexes are refused.
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <zero/io/safetensors.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::io;
using zero::testing::TempDir;

namespace {

/// Values of tensor t: t * 1000 + i, exact in f32.
std::vector<float> values_of(int t, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = float(t * 1000 + i);
  return v;
}

/// "t" and t (built by append: g++ 12 at -O3 warns falsely on "literal" + std::string&&).
std::string tensor_name(std::size_t t) {
  std::string name = "t";
  return name.append(std::to_string(t));
}

/// Writes tensors "t0".."t{k-1}" of the given element counts (f32) through a shard writer.
std::vector<std::filesystem::path> write_model(const std::filesystem::path& file,
                                               const std::vector<std::int64_t>& sizes,
                                               std::uint64_t max_shard_bytes) {
  std::vector<TensorDecl> decls;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    decls.emplace_back(tensor_name(t), DType::f32, std::vector<std::int64_t>{sizes[t]});
  }
  SafetensorsShardWriter writer(file, decls, {{"format", "pt"}}, max_shard_bytes);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v = values_of(int(t), sizes[t]);
    const std::int64_t half = sizes[t] / 2;  // in two pieces, as a unit-by-unit export
    writer.write(tensor_name(t), Tensor<float>(v.data(), Shape{half}));
    writer.write(tensor_name(t), Tensor<float>(v.data() + half, Shape{sizes[t] - half}));
  }
  writer.commit();
  return writer.paths();
}

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

}  // namespace

TEST_CASE("shard writer splits tensors at the limit as Hugging Face does", "[unit][safetensors]") {
  TempDir dir("st-shards");
  const auto file = dir / "model.safetensors";
  // 40, 40, 120 (over the limit: a file alone), 8, 0 and 32 bytes under a 64-byte limit.
  const std::vector<std::int64_t> sizes{10, 10, 30, 2, 0, 8};
  const auto paths = write_model(file, sizes, 64);
  REQUIRE(paths.size() == 5);  // four shards and the index
  CHECK(paths[0] == dir / "model-00001-of-00004.safetensors");
  CHECK(paths[3] == dir / "model-00004-of-00004.safetensors");
  CHECK(paths[4] == dir / "model.safetensors.index.json");
  CHECK_FALSE(std::filesystem::exists(file));
  for (const auto& p : paths) CHECK(std::filesystem::exists(p));
  CHECK(SafetensorsReader(paths[0]).tensors().size() == 1);  // t0; t0 + t1 is 80 bytes
  CHECK(SafetensorsReader(paths[1]).tensors().size() == 1);  // t1; with t2 past the limit
  CHECK(SafetensorsReader(paths[2]).tensors().size() == 1);  // t2 alone (120 bytes)
  CHECK(SafetensorsReader(paths[3]).tensors().size() == 3);  // t3, t4, t5: 40 bytes
  CHECK(SafetensorsReader(paths[3]).metadata().at("format") == "pt");

  const nlohmann::json index = read_json(paths[4]);
  CHECK(index["metadata"]["total_size"] == 4 * (10 + 10 + 30 + 2 + 0 + 8));
  CHECK(index["weight_map"]["t2"] == "model-00003-of-00004.safetensors");
  CHECK(index["weight_map"]["t5"] == "model-00004-of-00004.safetensors");
  CHECK(index["weight_map"].size() == sizes.size());

  // Read back through the index, the directory, and each range.
  for (const auto& opened : {paths[4], dir.path()}) {
    const SafetensorsShards shards(opened);
    CHECK(shards.sharded());
    CHECK(shards.num_files() == 4);
    CHECK(shards.path() == paths[4]);
    CHECK(shards.names() == std::vector<std::string>{"t0", "t1", "t2", "t3", "t4", "t5"});
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const std::string name = tensor_name(t);
      CHECK(shards.read_vector<float>(name) == values_of(int(t), sizes[t]));
      CHECK(shards.info(name).numel() == sizes[t]);
    }
    std::vector<double> part(7);  // converted on the way, from the middle of t2
    shards.read_elements("t2", 11, Tensor<double>(part.data(), Shape{7}), DTypeRule::convert);
    CHECK(part[0] == 2011.0);
    CHECK(part[6] == 2017.0);
    CHECK_FALSE(shards.contains("t6"));
    CHECK_THROWS_WITH(shards.info("t6"), Catch::Contains("maps no tensor 't6'"));
  }
}

TEST_CASE("shard writer writes one file and no index when the tensors fit", "[unit][safetensors]") {
  TempDir dir("st-one");
  const auto file = dir / "model.safetensors";
  SECTION("under the limit") {
    CHECK(write_model(file, {10, 6}, 64).size() == 1);
  }
  SECTION("no limit") {
    CHECK(write_model(file, {1000, 600}, 0).size() == 1);
  }
  CHECK(std::filesystem::exists(file));
  CHECK_FALSE(std::filesystem::exists(dir / "model.safetensors.index.json"));
  const SafetensorsShards one(dir.path());  // a directory with model.safetensors
  CHECK_FALSE(one.sharded());
  CHECK(one.path() == file);
  CHECK(one.read_vector<float>("t1").front() == 1000.0f);
  CHECK_THROWS_WITH(one.info("t9"), Catch::Contains("has no tensor 't9'"));
}

TEST_CASE("a new export replaces an earlier one's shards and index under the same name",
          "[unit][safetensors]") {
  TempDir dir("st-stale");
  const auto file = dir / "model.safetensors";
  write_text(dir / "notes.txt", "kept");
  write_text(dir / "other-00001-of-00002.safetensors", "another model's shard, kept");
  REQUIRE(write_model(file, {10}, 40).size() == 1);
  REQUIRE(write_model(file, {10, 10, 10}, 40).size() == 4);  // three shards and the index
  CHECK_FALSE(std::filesystem::exists(file));                // the one file they replace
  REQUIRE(write_model(file, {10, 20}, 40).size() == 3);      // two: the third goes
  CHECK_FALSE(std::filesystem::exists(dir / "model-00001-of-00003.safetensors"));
  CHECK_FALSE(std::filesystem::exists(dir / "model-00003-of-00003.safetensors"));
  CHECK(SafetensorsShards(dir.path()).num_files() == 2);
  REQUIRE(write_model(file, {5}, 40).size() == 1);  // one file: the index and shards go
  CHECK_FALSE(std::filesystem::exists(dir / "model.safetensors.index.json"));
  CHECK_FALSE(std::filesystem::exists(dir / "model-00001-of-00002.safetensors"));
  const SafetensorsShards one(dir.path());  // the directory loads the new file
  CHECK_FALSE(one.sharded());
  CHECK(one.names() == std::vector<std::string>{"t0"});
  CHECK(std::filesystem::exists(dir / "notes.txt"));
  CHECK(std::filesystem::exists(dir / "other-00001-of-00002.safetensors"));
  CHECK(is_shard_name("model-00002-of-00017.safetensors", file));
  CHECK_FALSE(is_shard_name("model-0002-of-00017.safetensors", file));
  CHECK_FALSE(is_shard_name("model-00002-of-00017.bin", file));
  CHECK_FALSE(is_shard_name("model.safetensors", file));
}

TEST_CASE("an abandoned or incomplete shard writer leaves no file", "[unit][safetensors]") {
  TempDir dir("st-abandon");
  const auto file = dir / "model.safetensors";
  {
    SafetensorsShardWriter writer(file,
                                  {{"a", DType::f32, std::vector<std::int64_t>{4}},
                                   {"b", DType::f32, std::vector<std::int64_t>{4}}},
                                  {}, 16);
    REQUIRE(writer.num_files() == 2);
    std::vector<float> v(4, 1.0f);
    writer.write("a", Tensor<float>(v.data(), Shape{4}));  // the first file is complete
    CHECK_THROWS_WITH(writer.commit(), Catch::Contains("cannot commit before tensor 'b'"));
    CHECK_THROWS_WITH(writer.write("a", Tensor<float>(v.data(), Shape{1})),
                      Catch::Contains("'a'"));  // out of order: b is next
  }
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("sharded checkpoints: a malformed index is refused, naming it and the entry",
          "[unit][safetensors]") {
  TempDir dir("st-badindex");
  const auto paths = write_model(dir / "model.safetensors", {10, 10}, 40);
  REQUIRE(paths.size() == 3);
  const auto index = dir / "bad.safetensors.index.json";
  const auto refused = [&](const std::string& text, const std::string& message) {
    write_text(index, text);
    CHECK_THROWS_WITH(SafetensorsShards(index),
                      Catch::Contains("bad.safetensors.index.json") && Catch::Contains(message));
  };
  refused("{", "invalid JSON");
  refused(R"({"metadata": {}})", "no \"weight_map\"");
  refused(R"({"weight_map": {}})", "names no tensor");
  refused(R"({"weight_map": {"t0": 3}})", "'t0' maps to 3");
  refused(R"({"weight_map": {"t0": "../model-00001-of-00002.safetensors"}})",
          "a shard must be a file under the index's directory");
  refused(R"({"weight_map": {"t0": "/etc/passwd"}})", "a shard must be a file");
  refused(R"({"weight_map": {"t1": "model-00001-of-00002.safetensors"}})", "maps tensor 't1' to");
  write_text(index, R"({"weight_map": {"t0": "missing.safetensors"}})");
  CHECK_THROWS_WITH(SafetensorsShards(index), Catch::Contains("missing.safetensors"));
  // Tensors the index does not name are not part of the model.
  write_text(index, R"({"weight_map": {"t1": "model-00002-of-00002.safetensors"}})");
  const SafetensorsShards partial(index);
  CHECK(partial.names() == std::vector<std::string>{"t1"});
  CHECK_FALSE(partial.contains("t0"));

  TempDir empty("st-emptydir");
  CHECK_THROWS_WITH(SafetensorsShards(empty.path()),
                    Catch::Contains("holds neither 'model.safetensors.index.json' nor "
                                    "'model.safetensors'"));
}
