// Every kind of damage gives an error that names the file and the tensor: a shard byte flipped,
// a shard truncated or missing, the index malformed or truncated, `latest` missing or naming a
// missing tag; and wrong requests: a missing tensor, a range out of bounds. Bad saves (gaps,
// overlaps, undeclared tensors, a bad tag) fail on every rank and publish nothing.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "checkpoint_test_util.hpp"

using namespace zero;
using namespace zero::checkpoint;
using namespace zero::checkpoint::testing;
using Catch::Contains;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::TempDir;

namespace {

/// A saved 2-rank checkpoint "t" of make_tensors(0) and the shard holding tensor 0's first
/// segment, with that segment's record.
struct Fixture {
  TempDir dir{"ckpt-errors"};
  std::vector<LogicalTensor> tensors = make_tensors(0, 20);
  std::filesystem::path shard;
  std::string shard_name;
  SegmentRecord segment;
  Fixture() {
    save_with_ranks(2, dir.path(), "t", tensors, 11);
    const Reader reader(dir.path(), "t");
    segment = reader.tensor(tensors[0].spec.name).segments.front();
    shard_name = reader.index().files[static_cast<std::size_t>(segment.file)].name;
    shard = dir.path() / "t" / shard_name;
  }
};

void flip_byte(const std::filesystem::path& path, std::uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("a flipped shard byte fails the checksum of the segment holding it", "[unit]") {
  Fixture fx;
  const auto& t = fx.tensors[0];
  {  // Negative control: intact, the read succeeds.
    const Reader reader(fx.dir.path(), "t");
    CHECK(same_bytes(t, 0, read_bytes(reader, t, 0, t.spec.numel())));
  }
  flip_byte(fx.shard, fx.segment.byte_begin + 3);
  const Reader reader(fx.dir.path(), "t");
  CHECK_THROWS_AS(read_bytes(reader, t, 0, t.spec.numel()), CheckpointError);
  CHECK_THROWS_WITH(read_bytes(reader, t, 0, 1),  // a partial read verifies the whole segment
                    Contains("CRC32C") && Contains(fx.shard_name) && Contains(t.spec.name));
  // Other tensors stay readable.
  const auto& other = fx.tensors[3];
  CHECK(same_bytes(other, 0, read_bytes(reader, other, 0, other.spec.numel())));
  // With verification off the damage goes unnoticed: that is what the checksum buys.
  const Reader trusting(fx.dir.path(), "t", {Verify::none});
  CHECK_FALSE(same_bytes(t, 0, read_bytes(trusting, t, 0, t.spec.numel())));
}

TEST_CASE("a truncated shard is named when the checkpoint is opened", "[unit]") {
  Fixture fx;
  std::filesystem::resize_file(fx.shard, std::filesystem::file_size(fx.shard) - 5);
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"),
                    Contains(fx.shard_name) && Contains("truncated") && Contains("tensor '"));
}

TEST_CASE("a missing shard is named when the checkpoint is opened", "[unit]") {
  Fixture fx;
  std::filesystem::remove(fx.shard);
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"),
                    Contains(fx.shard_name) && Contains("missing") && Contains("tensor '"));
}

TEST_CASE("a malformed or truncated index is named", "[unit]") {
  Fixture fx;
  const auto index = fx.dir.path() / "t" / "index.json";
  const std::string text = zero::testing::read_file(index);
  zero::testing::write_file(index, text.substr(0, text.size() / 2));
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"),
                    Contains("index.json") && Contains("malformed index"));
  zero::testing::write_file(index, "{\"format\": \"zero-checkpoint\", \"version\": 1}");
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"), Contains("index.json") && Contains("\"tag\""));
  // A segment record that no longer tiles its tensor names the tensor.
  std::string shifted = text;
  const auto at = shifted.find("\"offset\": 0");
  REQUIRE(at != std::string::npos);
  shifted.replace(at, 11, "\"offset\": 1");
  zero::testing::write_file(index, shifted);
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"), Contains("index.json") && Contains("tensor '"));
  std::filesystem::remove(index);
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "t"), Contains("has no index.json"));
}

TEST_CASE("a flipped digit in the engine or client state fails the index's checksum", "[unit]") {
  // The segments' CRCs cover the tensors; "steps": 1000 read as 1001 (or a data loader's
  // position) parsed and loaded silently.
  TempDir dir("ckpt-state-crc");
  const auto tensors = make_tensors(0, 20);
  save_with_ranks(2, dir.path(), "t", tensors, 11,
                  {{"steps", 1000}, {"client_state", {{"next", 7}}}});
  CHECK(Reader(dir.path(), "t").engine_state().at("steps") == 1000);  // negative control
  const auto index = dir.path() / "t" / "index.json";
  const std::string text = zero::testing::read_file(index);
  for (const auto& [from, to] :
       {std::pair{"\"steps\": 1000", "\"steps\": 1001"}, std::pair{"\"next\": 7", "\"next\": 8"}}) {
    std::string flipped = text;
    const auto at = flipped.find(from);
    REQUIRE(at != std::string::npos);
    flipped.replace(at, std::string(from).size(), to);
    zero::testing::write_file(index, flipped);
    CHECK_THROWS_WITH(Reader(dir.path(), "t"),
                      Contains("index.json") && Contains("fail their checksum"));
  }
}

TEST_CASE("an index number that is a float or out of range is named, not cast (fuzz finding)",
          "[unit]") {
  // fuzz_checkpoint_index found "bytes": 8.9e102, which nlohmann cast to uint64 (undefined
  // behaviour under UBSan); integers out of their field's range were cast silently.
  const std::string where = "checkpoint 'x/index.json'";
  const std::string good = R"({"format": "zero-checkpoint", "version": 1, "tag": "t",
    "world_size": 1, "files": [{"name": "r0.bin", "rank": 0, "bytes": BYTES}],
    "tensors": {"w": {"dtype": "F32", "shape": SHAPE, "segments": [{"file": "r0.bin",
    "offset": 0, "count": 2, "bytes": [0, 8], "crc32c": CRC}]}}})";
  auto with = [&](const std::string& bytes, const std::string& shape, const std::string& crc) {
    std::string t = good;
    t.replace(t.find("BYTES"), 5, bytes);
    t.replace(t.find("SHAPE"), 5, shape);
    t.replace(t.find("CRC"), 3, crc);
    return t;
  };
  CHECK(parse_index(with("8", "[2]", "7"), where).files.at(0).bytes == 8);  // negative control
  CHECK_THROWS_WITH(
      parse_index(with("8.9e102", "[2]", "7"), where),
      Contains(where) && Contains("\"bytes\" must be an integer") && Contains("8.9e+102"));
  CHECK_THROWS_WITH(parse_index(with("-8", "[2]", "7"), where),
                    Contains("\"bytes\" must be an integer in [0, "));
  CHECK_THROWS_WITH(parse_index(with("8", "[2.5]", "7"), where),
                    Contains("\"shape\" must be an integer") && Contains("2.5"));
  CHECK_THROWS_WITH(parse_index(with("8", "[2]", "4294967296"), where),
                    Contains("\"crc32c\" must be an integer in [0, 4294967295]"));
  // A shape whose element count wraps to 0 in int64 would pass with no segments.
  std::string wrapped = with("8", "[4294967296, 4294967296]", "7");
  const auto segments = wrapped.find("[{\"file\"");
  wrapped.replace(segments, wrapped.find("]}}}") + 1 - segments, "[]");
  CHECK_THROWS_WITH(parse_index(wrapped, where), Contains("product fit in 64 bits"));
}

TEST_CASE("latest missing or naming a missing tag is named", "[unit]") {
  Fixture fx;
  zero::testing::write_file(fx.dir.path() / "latest", "gone\n");
  CHECK_THROWS_WITH(Reader(fx.dir.path()),
                    Contains("latest") && Contains("'gone'") && Contains("does not exist"));
  std::filesystem::remove(fx.dir.path() / "latest");
  CHECK_THROWS_WITH(Reader(fx.dir.path()), Contains("latest") && Contains("does not exist"));
  CHECK_THROWS_WITH(Reader(fx.dir.path(), "nope"),
                    Contains("nope") && Contains("complete tags there: t"));
  // Collectively: every rank gets the error, naming latest as Reader does (load passed the tag
  // it had read on, and the message said only that the tag did not exist).
  zero::testing::write_file(fx.dir.path() / "latest", "gone\n");
  const auto threw = per_rank<std::string>(2, [&](LocalComm& comm) {
    try {
      (void)load(comm, fx.dir.path());
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(nothing thrown)");
  });
  for (const std::string& m : threw) {
    CHECK_THAT(m, Contains("latest") && Contains("names tag 'gone'") && Contains("does not exist"));
  }
}

TEST_CASE("a Reader reads the tag it opened: a move follows it, a replacement is an error",
          "[unit]") {
  Fixture fx;
  const auto& t = fx.tensors[0];
  const auto& other = fx.tensors[3];
  {  // Moved after opening: every file still comes from the directory the index was read from.
    const Reader reader(fx.dir.path(), "t", {Verify::none});
    std::filesystem::rename(fx.dir.path() / "t", fx.dir.path() / "moved");
    CHECK(same_bytes(other, 0, read_bytes(reader, other, 0, other.spec.numel())));
    std::filesystem::rename(fx.dir.path() / "moved", fx.dir.path() / "t");
  }
  // Replaced by a save of the same tag with other values (same segmentation, so every shard
  // has the size the first index records): reading is an error, never the new checkpoint's
  // bytes under the old index (without checksums nothing else would notice).
  const Reader reader(fx.dir.path(), "t", {Verify::none});
  save_with_ranks(2, fx.dir.path(), "t", make_tensors(1, 20), 11);
  CHECK_THROWS_WITH(read_bytes(reader, t, 0, t.spec.numel()),
                    Contains("can no longer be opened") && Contains("replaced"));
}

TEST_CASE("a missing tensor or an out-of-bounds range is named", "[unit]") {
  Fixture fx;
  const Reader reader(fx.dir.path(), "t");
  std::vector<float> out(4);
  CHECK_THROWS_WITH(reader.read("h.0.attn.c_attn.weight", 0, std::span<float>(out)),
                    Contains("no tensor 'h.0.attn.c_attn.weight'") &&
                        Contains("did you mean 'transformer.h.0.attn.c_attn.weight'"));
  const auto& bias = fx.tensors[2];  // 13 elements
  CHECK_THROWS_WITH(reader.read(bias.spec.name, 10, std::span<float>(out)),
                    Contains(bias.spec.name) && Contains("[10, 14)") && Contains("out of bounds"));
  CHECK_NOTHROW(reader.read(bias.spec.name, 9, std::span<float>(out)));
  // A range whose end passes int64: the message writes the end as a sum (computing it was
  // signed overflow).
  const std::int64_t far = std::numeric_limits<std::int64_t>::max() - 1;
  CHECK_THROWS_WITH(
      reader.read(bias.spec.name, far, std::span<float>(out)),
      Contains("[9223372036854775806, 9223372036854775806 + 4)") && Contains("out of bounds"));
  // A raw byte range whose end wraps past 2^64 is refused (its check summed the two, and the
  // read came from before the segment).
  const TensorRecord& record = reader.tensor(fx.tensors[0].spec.name);
  std::vector<std::byte> two(2);
  CHECK_THROWS_WITH(reader.read_segment_bytes(record, record.segments.front(),
                                              std::numeric_limits<std::uint64_t>::max(), two),
                    Contains("byte range outside its segment"));
  CHECK_NOTHROW(reader.read_segment_bytes(record, record.segments.front(), 0, two));
}

TEST_CASE("a save refuses a shape or a segment whose element counts pass int64", "[unit]") {
  // The shape's product and a segment's end were computed, with signed overflow, before (or
  // while) refusing them; now each is refused by name with nothing published.
  TempDir dir("ckpt-overflow");
  const std::int64_t big = std::int64_t{1} << 40;
  const auto attempt = [&](const std::vector<TensorSpec>& specs,
                           const std::vector<SegmentShape>& declared) {
    std::string error;
    LocalComm::run(1, [&](LocalComm& comm) {
      try {
        save_streamed(comm, dir.path(), "t", specs, declared, [](const SegmentSink&) {});
      } catch (const CheckpointError& e) {
        error = e.what();
      }
    });
    CHECK(list_tags(dir.path()).empty());
    return error;
  };
  CHECK_THAT(attempt({{"huge", DType::f32, {big, big}}}, {}),
             Contains("'huge'") && Contains("more bytes than fit in 64 bits"));
  // 2^61 f32 elements are 2^63 bytes: one past int64.
  CHECK_THAT(attempt({{"bytes", DType::f32, {std::int64_t{1} << 61}}}, {}),
             Contains("'bytes'") && Contains("64 bits"));
  CHECK_THAT(attempt({{"neg", DType::f32, {4, -1}}}, {}), Contains("'neg'"));
  const std::int64_t last = std::numeric_limits<std::int64_t>::max();
  CHECK_THAT(attempt({{"w", DType::f32, {8}}}, {{"w", last, DType::f32, 2}}),
             Contains("[9223372036854775807, 9223372036854775807 + 2)") && Contains("'w'"));
  // Negative control: large extents with a zero among them are an empty tensor, in any order
  // (the byte count through 2^40 x 2^40 was refused before reaching the 0).
  LocalComm::run(1, [&](LocalComm& comm) {
    const std::vector<TensorSpec> fits{{"empty", DType::f32, {0, big, big}},
                                       {"empty_last", DType::f32, {big, big, 0}}};
    save_streamed(comm, dir.path(), "ok", fits, {}, [](const SegmentSink&) {});
  });
  CHECK(list_tags(dir.path()) == std::vector<std::string>{"ok"});
}

TEST_CASE("a bad segmentation fails the save on every rank and publishes nothing", "[unit]") {
  TempDir dir("ckpt-bad-save");
  const auto tensors = make_tensors(0);
  save_with_ranks(1, dir.path(), "good", tensors, 1);
  const auto name = tensors[2].spec.name;  // 13 elements
  auto attempt = [&](std::vector<std::vector<Piece>> pieces, std::string tag = "bad") {
    // Everything else from rank 0.
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      if (k != 2 && tensors[k].spec.numel() > 0)
        pieces[0].push_back({k, 0, tensors[k].spec.numel()});
    }
    std::vector<std::string> errors(2);
    LocalComm::run(2, [&](LocalComm& comm) {
      try {
        save_pieces(comm, dir.path(), tag, tensors, pieces[static_cast<std::size_t>(comm.rank())],
                    {});
      } catch (const CheckpointError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK(errors[0] == errors[1]);
    CHECK(read_latest(dir.path()) == "good");
    CHECK(list_tags(dir.path()) == std::vector<std::string>{"good"});
    return errors[0];
  };
  CHECK_THAT(attempt({{{2, 0, 7}}, {{2, 6, 7}}}), Contains(name) && Contains("overlaps"));
  CHECK_THAT(attempt({{{2, 0, 6}}, {{2, 7, 6}}}), Contains(name) && Contains("missing before"));
  CHECK_THAT(attempt({{{2, 0, 13}}, {}}, "bad/tag"), Contains("bad/tag"));
  // The name of latest's temporary file: the next save would remove it as a leftover.
  CHECK_THAT(attempt({{{2, 0, 13}}, {}}, "latest.tmp.1"), Contains("temporary file of 'latest'"));
  CHECK_THAT(attempt({{{2, 0, 13}}, {{2, 13, 1}}}),
             Contains("rank 1") && Contains(name) && Contains("outside"));
  // A segment of a tensor nobody declared.
  std::vector<std::string> errors(2);
  LocalComm::run(2, [&](LocalComm& comm) {
    std::vector<float> data(3);
    try {
      save(comm, dir.path(), "undeclared", std::span<const TensorSpec>(),
           std::vector<Segment>{segment_of("ghost", 0, data)}, {});
    } catch (const CheckpointError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  CHECK_THAT(errors[1], Contains("'ghost'") && Contains("not declared"));
  CHECK(list_tags(dir.path()) == std::vector<std::string>{"good"});
}

TEST_CASE("a save whose tag was published but whose latest could not be updated says so",
          "[unit]") {
  // It said nothing was published, while the tag (replacing an older one of the same name) was
  // already in place.
  TempDir dir("ckpt-latest-fails");
  std::filesystem::create_directories(dir.path() / "latest" / "blocker");  // rename onto it fails
  const auto tensors = make_tensors(0, 20);
  CHECK_THROWS_WITH(
      save_with_ranks(2, dir.path(), "t1", tensors, 3),
      Contains("was saved and published") && Contains("'latest' could not be updated"));
  CHECK(Reader(dir.path(), "t1").tag() == "t1");  // complete and readable
}
