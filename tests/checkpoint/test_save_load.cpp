// Save and load: round trips with the engine state and `latest`; any N saving ranks with a
// random segmentation to any M reading ranks with other ranges, bitwise; reads touch only the
// bytes they need; dtype conversion; replacing a tag; shard files are plain safetensors; a
// streamed save writes each segment's data while it is handed over.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>
#include <zero/io/safetensors_reader.hpp>

#include "../support/temp_dir.hpp"
#include "checkpoint_test_util.hpp"

using namespace zero;
using namespace zero::checkpoint;
using namespace zero::checkpoint::testing;
using zero::parallel::LocalComm;
using zero::testing::TempDir;

TEST_CASE("a checkpoint round-trips tensors, engine state and latest", "[unit]") {
  TempDir dir("ckpt-roundtrip");
  const auto tensors = make_tensors(3);
  const nlohmann::json engine = {{"step", 17},
                                 {"stage", 3},
                                 {"loss_scaler", {{"scale", 65536.0}, {"good_steps", 5}}},
                                 {"rng", {{"seed", 1234}, {"offset", 99}}}};
  save_with_ranks(2, dir.path(), "step-17", tensors, 7, engine);

  CHECK(read_latest(dir.path()) == "step-17");
  CHECK(list_tags(dir.path()) == std::vector<std::string>{"step-17"});
  const Reader reader(dir.path());
  CHECK(reader.tag() == "step-17");
  CHECK(reader.saved_world_size() == 2);
  CHECK(reader.engine_state() == engine);
  REQUIRE(reader.names().size() == tensors.size());
  for (const auto& t : tensors) {
    const TensorRecord& rec = reader.tensor(t.spec.name);
    CHECK(rec.spec() == t.spec);
    CHECK(same_bytes(t, 0, read_bytes(reader, t, 0, t.spec.numel())));
  }
  // Negative control: another version's data differ from what was saved.
  const auto other = make_tensors(4);
  CHECK_FALSE(same_bytes(other[0], 0, read_bytes(reader, tensors[0], 0, tensors[0].spec.numel())));
}

TEST_CASE("a checkpoint saved by N ranks loads bitwise on M ranks with other ranges", "[unit]") {
  const auto tensors = make_tensors(1, 9);
  for (int n : {1, 2, 3, 4}) {
    TempDir dir("ckpt-n-to-m");
    save_with_ranks(n, dir.path(), "t", tensors, static_cast<std::uint32_t>(100 + n));
    for (int m : {1, 2, 4, 8}) {
      // Each reading rank reads its ZeRO-style contiguous share of every tensor, then random
      // ranges; each collects the descriptions of its mismatches (assertions on the main thread).
      std::vector<std::vector<std::string>> wrong(static_cast<std::size_t>(m));
      std::vector<int> reads(static_cast<std::size_t>(m), 0);
      LocalComm::run(m, [&](LocalComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const Reader reader = load(comm, dir.path());
        std::mt19937 rng(static_cast<std::uint32_t>(1000 * n + 10 * m + comm.rank()));
        for (const auto& t : tensors) {
          const std::int64_t numel = t.spec.numel();
          const std::int64_t share = (numel + m - 1) / m;
          const std::int64_t a = std::min(numel, share * comm.rank());
          const std::int64_t b = std::min(numel, a + share);
          std::vector<std::pair<std::int64_t, std::int64_t>> ranges{{a, b}};
          for (int k = 0; k < 3 && numel > 0; ++k) {
            std::int64_t x = std::uniform_int_distribution<std::int64_t>(0, numel)(rng);
            std::int64_t y = std::uniform_int_distribution<std::int64_t>(0, numel)(rng);
            ranges.emplace_back(std::min(x, y), std::max(x, y));
          }
          for (const auto& [lo, hi] : ranges) {
            ++reads[r];
            if (!same_bytes(t, lo, read_bytes(reader, t, lo, hi - lo))) {
              wrong[r].push_back(t.spec.name + " [" + std::to_string(lo) + ", " +
                                 std::to_string(hi) + ")");
            }
          }
        }
      });
      for (int r = 0; r < m; ++r) {
        INFO("saved by " << n << " ranks, read by rank " << r << " of " << m);
        CHECK(wrong[static_cast<std::size_t>(r)].empty());
        CHECK(reads[static_cast<std::size_t>(r)] >= static_cast<int>(tensors.size()));
      }
    }
  }
}

TEST_CASE("reads touch only the byte ranges of overlapping segments", "[unit]") {
  TempDir dir("ckpt-ranges");
  const auto tensors = make_tensors(0, 50);
  // Tensor 0 (7 x 250 f32) in 4 equal segments on 4 ranks; everything else on rank 0.
  const std::int64_t numel = tensors[0].spec.numel();
  std::vector<std::vector<Piece>> pieces(4);
  for (int r = 0; r < 4; ++r) {
    pieces[static_cast<std::size_t>(r)].push_back(
        {0, numel * r / 4, numel * (r + 1) / 4 - numel * r / 4});
  }
  for (std::size_t k = 1; k < tensors.size(); ++k) {
    if (tensors[k].spec.numel() > 0) pieces[0].push_back({k, 0, tensors[k].spec.numel()});
  }
  LocalComm::run(4, [&](LocalComm& comm) {
    save_pieces(comm, dir.path(), "t", tensors, pieces[static_cast<std::size_t>(comm.rank())], {});
  });
  const std::int64_t seg = numel / 4;  // 437 elements (1750 = 437 + 438 + 437 + 438)
  {
    const Reader reader(dir.path(), "t", {Verify::none});
    std::vector<float> out(10);
    reader.read(tensors[0].spec.name, seg + 5, std::span<float>(out));
    CHECK(reader.bytes_read() == 40);  // exactly the requested bytes
  }
  {
    const Reader reader(dir.path(), "t");
    std::vector<float> out(10);
    reader.read(tensors[0].spec.name, seg + 5, std::span<float>(out));
    const std::uint64_t segment_bytes = 438 * 4;
    CHECK(reader.bytes_read() == segment_bytes);  // the touched segment once, for its checksum
    reader.read(tensors[0].spec.name, seg + 20, std::span<float>(out));
    CHECK(reader.bytes_read() == segment_bytes + 40);  // verified already: only the range
    std::vector<float> two(static_cast<std::size_t>(seg + 10));
    reader.read(tensors[0].spec.name, 0, std::span<float>(two));  // segment 0 whole + 10 of seg 1
    CHECK(reader.bytes_read() == segment_bytes + 40 + static_cast<std::uint64_t>(seg) * 4 + 40);
    CHECK(same_bytes(
        tensors[0], 0,
        std::vector<std::byte>(reinterpret_cast<const std::byte*>(two.data()),
                               reinterpret_cast<const std::byte*>(two.data() + two.size()))));
  }
}

TEST_CASE("reads convert between f32, bf16 and f64 when asked", "[unit]") {
  TempDir dir("ckpt-convert");
  const auto tensors = make_tensors(0);
  // Finite values for conversion checks.
  std::vector<LogicalTensor> finite = {tensors[0], tensors[6]};
  {
    std::vector<float> v(static_cast<std::size_t>(finite[0].spec.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.37f - 3.1f;
    std::memcpy(finite[0].bytes.data(), v.data(), finite[0].bytes.size());
    std::vector<bf16> w(static_cast<std::size_t>(finite[1].spec.numel()));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = bf16(static_cast<float>(i) * 0.5f - 7.f);
    std::memcpy(finite[1].bytes.data(), w.data(), finite[1].bytes.size());
  }
  save_with_ranks(3, dir.path(), "t", finite, 5);
  const Reader reader(dir.path(), "t");
  const auto f32 = reader.read_all<float>(finite[0].spec.name);
  const auto as_bf16 = reader.read_all<bf16>(finite[0].spec.name, io::DTypeRule::convert);
  const auto as_f64 = reader.read_all<double>(finite[0].spec.name, io::DTypeRule::convert);
  for (std::size_t i = 0; i < f32.size(); ++i) {
    CHECK(as_bf16[i].bits == bf16(f32[i]).bits);
    CHECK(as_f64[i] == static_cast<double>(f32[i]));
  }
  const auto widened = reader.read_all<float>(finite[1].spec.name, io::DTypeRule::convert);
  for (std::size_t i = 0; i < widened.size(); ++i) {
    CHECK(widened[i] == static_cast<float>(i) * 0.5f - 7.f);
  }
  CHECK_THROWS_WITH(reader.read_all<bf16>(finite[0].spec.name),
                    Catch::Contains("DTypeRule::convert") && Catch::Contains(finite[0].spec.name));
}

TEST_CASE("saving an existing tag replaces it, latest follows only when asked", "[unit]") {
  TempDir dir("ckpt-replace");
  const auto first = make_tensors(1), second = make_tensors(2);
  save_with_ranks(2, dir.path(), "keep", first, 1, {{"version", 1}});
  save_with_ranks(3, dir.path(), "keep", second, 2, {{"version", 2}});
  {
    const Reader reader(dir.path());
    CHECK(reader.engine_state().at("version") == 2);
    CHECK(reader.saved_world_size() == 3);
    for (const auto& t : second) CHECK(same_bytes(t, 0, read_bytes(reader, t, 0, t.spec.numel())));
  }
  save_with_ranks(1, dir.path(), "side", first, 3, {{"version", 3}}, {.update_latest = false});
  CHECK(read_latest(dir.path()) == "keep");
  CHECK(Reader(dir.path(), "side").engine_state().at("version") == 3);
  // No temporary or replaced directories remain.
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    entries.push_back(e.path().filename().string());
  }
  std::sort(entries.begin(), entries.end());
  CHECK(entries == std::vector<std::string>{"keep", "latest", "side"});
}

TEST_CASE("shard files are plain safetensors files with one tensor per segment", "[unit]") {
  TempDir dir("ckpt-safetensors");
  const auto tensors = make_tensors(0);
  save_with_ranks(2, dir.path(), "t", tensors, 9);
  const Reader reader(dir.path(), "t");
  std::size_t segments = 0;
  for (const FileRecord& f : reader.index().files) {
    const io::SafetensorsReader shard(reader.path() / f.name);
    CHECK(shard.metadata().at("rank") == std::to_string(f.rank));
    for (const TensorRecord& t : reader.index().tensors) {
      for (const SegmentRecord& s : t.segments) {
        if (reader.index().files[static_cast<std::size_t>(s.file)].name != f.name) continue;
        const auto key = t.name + "@" + std::to_string(s.offset);
        const io::TensorInfo& info = shard.info(key);
        CHECK(info.numel() == s.count);
        CHECK(shard.data_offset() + info.begin == s.byte_begin);
        ++segments;
      }
    }
  }
  std::size_t expected = 0;
  for (const auto& t : reader.index().tensors) expected += t.segments.size();
  CHECK(segments == expected);
}

TEST_CASE("a save cleans up what interrupted saves left and restores a replaced tag", "[unit]") {
  TempDir dir("ckpt-stale");
  const auto tensors = make_tensors(6);
  save_with_ranks(2, dir.path(), "keep", tensors, 1, {{"version", 6}});
  // A crash inside the two-rename fallback of publish_directory: only keep.old-<nonce> exists.
  std::filesystem::rename(dir / "keep", dir / "keep.old-0123456789abcdef");
  std::filesystem::create_directory(dir / "next.tmp-feedfacefeedface");
  zero::testing::write_file(dir / "next.tmp-feedfacefeedface" / "index.json", "{");
  zero::testing::write_file(dir / "latest.tmp.123.456", "half");
  CHECK_THROWS_AS(Reader(dir.path(), "keep"), CheckpointError);
  save_with_ranks(1, dir.path(), "next", tensors, 2, {{"version", 7}});
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    entries.push_back(e.path().filename().string());
  }
  std::sort(entries.begin(), entries.end());
  CHECK(entries == std::vector<std::string>{"keep", "latest", "next"});
  const Reader restored(dir.path(), "keep");
  CHECK(restored.engine_state().at("version") == 6);
  for (const auto& t : tensors) CHECK(same_bytes(t, 0, read_bytes(restored, t, 0, t.spec.numel())));
}

TEST_CASE("a save leaves alone what only looks like a leftover of an interrupted save", "[unit]") {
  // Every name with ".tmp-" or ".old-" in it was removed (or renamed onto its prefix) by the
  // next save into the directory: a user's files beside the checkpoints were lost.
  TempDir dir("ckpt-not-stale");
  const auto tensors = make_tensors(2);
  std::filesystem::create_directory(dir / "eval");
  std::filesystem::create_directory(dir / "eval.old-run");              // not a nonce
  std::filesystem::create_directory(dir / "run.tmp-feedfacefeedfac");   // 15 digits
  std::filesystem::create_directory(dir / "run.tmp-FEEDFACEFEEDFACE");  // not make_nonce's case
  std::filesystem::create_directory(dir / "a b.tmp-feedfacefeedface");  // not a tag
  zero::testing::write_file(dir / "notes.tmp-0123456789abcdef", "a file, not a save's directory");
  zero::testing::write_file(dir / "config.old-2024.json", "{}");
  zero::testing::write_file(dir / "latest.tmp.backup", "not AtomicFile's name");
  std::filesystem::create_directory(dir / "latest.tmp.12.34");  // a directory, not its file
  // What a save does leave: these three go.
  std::filesystem::create_directory(dir / "next.tmp-feedfacefeedface");
  zero::testing::write_file(dir / "latest.tmp.123.456.2", "half");
  std::filesystem::create_directory(dir / "eval.old-0123456789abcdef");  // eval exists: removed
  save_with_ranks(1, dir.path(), "t", tensors, 1, {{"version", 1}});
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    entries.push_back(e.path().filename().string());
  }
  std::sort(entries.begin(), entries.end());
  CHECK(entries == std::vector<std::string>{"a b.tmp-feedfacefeedface", "config.old-2024.json",
                                            "eval", "eval.old-run", "latest", "latest.tmp.12.34",
                                            "latest.tmp.backup", "notes.tmp-0123456789abcdef",
                                            "run.tmp-FEEDFACEFEEDFACE", "run.tmp-feedfacefeedfac",
                                            "t"});
}

TEST_CASE("a load restores a tag that a save interrupted inside its two-rename fallback",
          "[unit]") {
  // Only keep.old-<nonce> is left and `latest` names keep: before, every load failed ("does
  // not exist") until some save ran remove_stale_entries.
  TempDir dir("ckpt-restore-on-load");
  const auto tensors = make_tensors(6);
  save_with_ranks(2, dir.path(), "keep", tensors, 1, {{"version", 6}});
  std::filesystem::rename(dir / "keep", dir / "keep.old-0123456789abcdef");
  CHECK_THROWS_AS(Reader(dir.path(), "keep"), CheckpointError);
  LocalComm::run(2, [&](LocalComm& comm) {
    const Reader reader = load(comm, dir.path());
    CHECK(reader.engine_state().at("version") == 6);
    for (const auto& t : tensors) CHECK(same_bytes(t, 0, read_bytes(reader, t, 0, t.spec.numel())));
  });
  CHECK(std::filesystem::exists(dir / "keep"));
  CHECK_FALSE(std::filesystem::exists(dir / "keep.old-0123456789abcdef"));
}

TEST_CASE("a save refuses a state that JSON would not give back", "[unit]") {
  // An infinite or NaN number was written as null (best_val_loss = inf came back as null, and
  // its get<double>() threw after the load); a rank_state string that is not UTF-8 was replaced
  // with U+FFFD. Now the save fails on every rank and publishes nothing.
  TempDir dir("ckpt-unstorable");
  const auto tensors = make_tensors(2);
  const auto pieces = random_segmentation(tensors, 2, 5);
  const auto refused = [&](const nlohmann::json& engine, const SaveOptions& rank1) {
    std::vector<std::string> errors(2);
    LocalComm::run(2, [&](LocalComm& comm) {
      try {
        save_pieces(comm, dir.path(), "t", tensors, pieces[static_cast<std::size_t>(comm.rank())],
                    engine, comm.rank() == 1 ? rank1 : SaveOptions{});
      } catch (const CheckpointError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK_FALSE(std::filesystem::exists(dir / "t"));
    CHECK(errors[0] == errors[1]);
    return errors[0];
  };
  CHECK_THAT(refused({{"step", 3}, {"client_state", {{"best_val_loss", INFINITY}}}}, {}),
             Catch::Contains("the engine state holds inf at '/client_state/best_val_loss'"));
  SaveOptions nan_state;
  nan_state.rank_state = {{"rng", {{"a/b", {1.0, std::nan("")}}}}};
  CHECK_THAT(refused({{"step", 3}}, nan_state),
             Catch::Contains("rank 1's SaveOptions::rank_state holds nan at '/rng/a~1b/1'"));
  SaveOptions bad_text;
  bad_text.rank_state = {{"name", std::string("\xff\xfe")}};
  CHECK_THAT(refused({{"step", 3}}, bad_text),
             Catch::Contains("rank 1's SaveOptions::rank_state holds a string that is not valid "
                             "UTF-8"));
  // Finite numbers, and strings of any UTF-8, come back as they were.
  SaveOptions fine;
  fine.rank_state = {{"x", -0.5}, {"name", "h\u00e9"}};
  LocalComm::run(2, [&](LocalComm& comm) {
    save_pieces(comm, dir.path(), "t", tensors, pieces[static_cast<std::size_t>(comm.rank())],
                {{"best", 1e300}}, comm.rank() == 1 ? fine : SaveOptions{});
  });
  const Reader reader(dir.path(), "t");
  CHECK(reader.engine_state().at("best") == 1e300);
  CHECK(reader.rank_state(1) == fine.rank_state);
}

TEST_CASE("a load refuses ranks that read different saves of one tag", "[unit]") {
  // Node-local copies of a checkpoint directory that differ (or a save of the same tag between
  // the ranks' opens): each rank opened its own version and loaded it, silently.
  TempDir here("ckpt-copy-a"), there("ckpt-copy-b");
  const auto tensors = make_tensors(3);
  save_with_ranks(2, here.path(), "t", tensors, 1, {{"version", 1}});
  save_with_ranks(2, there.path(), "t", tensors, 1, {{"version", 2}});
  std::vector<std::string> errors(2);
  LocalComm::run(2, [&](LocalComm& comm) {
    try {
      (void)load(comm, comm.rank() == 0 ? here.path() : there.path(), "t");
    } catch (const CheckpointError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    CHECK_THAT(e, Catch::Contains("checkpoint 't': rank 1 read another index than rank 0") &&
                      Catch::Contains("nothing was loaded"));
  }
  // Identical copies load.
  std::filesystem::remove_all(there / "t");
  std::filesystem::copy(here / "t", there / "t", std::filesystem::copy_options::recursive);
  LocalComm::run(2, [&](LocalComm& comm) {
    const Reader reader = load(comm, comm.rank() == 0 ? here.path() : there.path(), "t");
    CHECK(reader.engine_state().at("version") == 1);
  });
}

TEST_CASE("each rank's own state is kept beside the shared engine state", "[unit]") {
  TempDir dir("ckpt-rank-state");
  const auto tensors = make_tensors(2);
  const auto pieces = random_segmentation(tensors, 3, 12);
  LocalComm::run(3, [&](LocalComm& comm) {
    SaveOptions options;
    options.rank_state = {{"rng_offset", 1000 + comm.rank()}, {"sample", 7 * comm.rank()}};
    save_pieces(comm, dir.path(), "t", tensors, pieces[static_cast<std::size_t>(comm.rank())],
                {{"step", 5}}, options);
  });
  const Reader reader(dir.path(), "t");
  for (int r = 0; r < 3; ++r) {
    CHECK(reader.rank_state(r).at("rng_offset") == 1000 + r);
    CHECK(reader.rank_state(r).at("sample") == 7 * r);
  }
  CHECK_THROWS_WITH(reader.rank_state(3), Catch::Contains("saved by 3 ranks"));
  save_with_ranks(2, dir.path(), "plain", tensors, 3);
  CHECK(Reader(dir.path(), "plain").rank_state(1).is_null());
}

TEST_CASE("a Reader opens a shard file only when a read needs it", "[unit]") {
  TempDir dir("ckpt-lazy");
  const auto tensors = make_tensors(0, 4);
  std::vector<std::vector<Piece>> pieces(4);
  for (std::size_t k = 0; k < tensors.size(); ++k) {  // tensor k entirely on rank k % 4
    if (tensors[k].spec.numel() > 0) pieces[k % 4].push_back({k, 0, tensors[k].spec.numel()});
  }
  LocalComm::run(4, [&](LocalComm& comm) {
    save_pieces(comm, dir.path(), "t", tensors, pieces[static_cast<std::size_t>(comm.rank())], {});
  });
  const auto open_descriptors = [] {
    return std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                         std::filesystem::directory_iterator());
  };
  const auto before = open_descriptors();
  const Reader reader(dir.path(), "t");
  // The tag directory stays open (files open relative to it); the shard files were checked
  // with stat, not opened.
  CHECK(open_descriptors() == before + 1);
  CHECK(same_bytes(tensors[1], 0, read_bytes(reader, tensors[1], 0, tensors[1].spec.numel())));
  CHECK(open_descriptors() == before + 2);  // rank 1's file only
  CHECK(same_bytes(tensors[5], 0, read_bytes(reader, tensors[5], 0, tensors[5].spec.numel())));
  CHECK(open_descriptors() == before + 2);  // tensor 5 is in rank 1's file too
}

TEST_CASE("a streamed save reads each segment's data only while it writes it", "[unit]") {
  // Each rank declares two segments of "w" and hands both over through one scratch buffer,
  // overwritten after each hand-over: the checkpoint holds what the buffer held at the time,
  // which a save that kept the spans to write later would not.
  TempDir dir("ckpt-streamed");
  const std::vector<TensorSpec> tensors{{"w", DType::f32, {4, 16}}};
  const auto value = [](std::int64_t i) { return 0.5f * static_cast<float>(i) - 3.0f; };
  const auto declared_by = [](int rank) {
    return std::vector<SegmentShape>{{"w", rank * 32, DType::f32, 16},
                                     {"w", rank * 32 + 16, DType::f32, 16}};
  };
  // Runs a save on 2 ranks whose rank 1 hands over `order` (indices into its declared list);
  // returns each rank's error (empty: none).
  const auto save_on_two = [&](const std::string& tag, std::vector<int> order) {
    std::vector<std::string> errors(2);
    LocalComm::run(2, [&](LocalComm& comm) {
      const std::vector<SegmentShape> declared = declared_by(comm.rank());
      std::vector<int> mine = comm.rank() == 1 ? order : std::vector<int>{0, 1};
      std::vector<float> scratch(16);
      try {
        save_streamed(comm, dir.path(), tag, tensors, declared, [&](const SegmentSink& sink) {
          for (int k : mine) {
            const SegmentShape& s = declared[static_cast<std::size_t>(k)];
            for (std::int64_t i = 0; i < s.count; ++i) {
              scratch[static_cast<std::size_t>(i)] = value(s.offset + i);
            }
            sink(segment_of(s.name, s.offset, scratch));
            std::fill(scratch.begin(), scratch.end(), -1.0f);
          }
        });
      } catch (const CheckpointError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return errors;
  };
  const auto fine = save_on_two("streamed", {0, 1});
  CHECK(fine == std::vector<std::string>(2));
  const Reader reader(dir.path());
  std::vector<float> w(64);
  reader.read("w", 0, std::span<float>(w));
  std::vector<float> want(64);
  for (std::int64_t i = 0; i < 64; ++i) want[static_cast<std::size_t>(i)] = value(i);
  CHECK(w == want);
  // The data must come in the declared order, and all of it: otherwise every rank throws and
  // nothing is published.
  const auto swapped = save_on_two("swapped", {1, 0});
  CHECK(swapped[0] == swapped[1]);
  CHECK_THAT(swapped[0], Catch::Contains("rank 1") && Catch::Contains("not the next one declared"));
  const auto short_of = save_on_two("short", {0});
  CHECK(short_of[0] == short_of[1]);
  CHECK_THAT(short_of[0], Catch::Contains("rank 1") &&
                              Catch::Contains("1 of the 2 declared segments got no data"));
  CHECK(list_tags(dir.path()) == std::vector<std::string>{"streamed"});
}
