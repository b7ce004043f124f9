#pragma once
// Saving a checkpoint: a collective over any communicator. Every rank writes its own shard file
// (a safetensors file whose tensors are the rank's segments, named "<tensor>@<offset>") in
// parallel, checksumming each segment; rank 0 gathers what each rank wrote, checks that the
// segments of every logical tensor tile it exactly, writes the index, and publishes the tag.
//
// Atomicity (docs/checkpoints.md): everything is written into <dir>/<tag>.tmp-<nonce>/ (shard
// files and index each fsynced, then the directory), which publish_directory renames to
// <dir>/<tag> (or swaps with an existing <tag>); only then is <dir>/latest replaced (temporary
// file, fsync, rename, fsync of <dir>). A save killed at any point leaves the previous
// checkpoint and `latest` as they were, plus a .tmp- directory the next save removes.
// Every rank returns or throws the same error: failures are agreed on through the
// communicator, so no rank is left waiting in a collective.

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/checkpoint/comm_text.hpp>
#include <zero/checkpoint/crc32c.hpp>
#include <zero/checkpoint/index.hpp>
#include <zero/checkpoint/layout.hpp>
#include <zero/checkpoint/publish.hpp>
#include <zero/checkpoint/segment.hpp>
#include <zero/core/error.hpp>
#include <zero/io/file.hpp>
#include <zero/io/safetensors_writer.hpp>

namespace zero::checkpoint {

/// How save behaves.
struct SaveOptions {
  bool update_latest = true;  ///< Replace <dir>/latest with this tag once it is published.
  /// This rank's own state (its RNG, its data-loader position, ...), kept per rank in the index
  /// beside the shared engine state; Reader::rank_state(r) returns it. Null: none.
  nlohmann::json rank_state = nullptr;
};

/// What save did.
struct SaveResult {
  std::filesystem::path path;     ///< <dir>/<tag>.
  std::uint64_t shard_bytes = 0;  ///< Bytes of this rank's shard file.
  std::uint64_t total_bytes = 0;  ///< Bytes of all shard files and the index.
};

/// Takes one segment's data to write (streamed saves: valid only during the call).
using SegmentSink = std::function<void(const Segment&)>;
/// Hands every segment a rank declared to the sink, in the declared order.
using SegmentProducer = std::function<void(const SegmentSink&)>;

namespace detail {

/// 16 hex digits from the system's random source and the process id: the temporary directory
/// of one save is never a leftover of another.
inline std::string make_nonce() {
  std::random_device device;
  const std::uint64_t value =
      (std::uint64_t{device()} << 32) ^ device() ^ (static_cast<std::uint64_t>(::getpid()) << 16);
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

/// Walks state for a number JSON cannot hold (dump() writes inf and NaN as null), at the JSON
/// pointer at (extended while it descends).
inline void expect_finite_numbers(const nlohmann::json& state, std::string& at,
                                  const std::string& what) {
  if (state.is_number_float()) {
    const double v = state.get<double>();
    expect<CheckpointError>(std::isfinite(v), what, " holds ", v, " at '", at.empty() ? "/" : at,
                            "', which JSON cannot store (it would load as null); store it as a "
                            "string or a finite number");
    return;
  }
  const std::size_t length = at.size();
  if (state.is_object()) {
    for (const auto& [key, value] : state.items()) {
      at += '/';
      for (char c : key) at += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
      expect_finite_numbers(value, at, what);
      at.resize(length);
    }
  } else if (state.is_array()) {
    for (std::size_t i = 0; i < state.size(); ++i) {
      at += '/' + std::to_string(i);
      expect_finite_numbers(state[i], at, what);
      at.resize(length);
    }
  }
}

/// CheckpointError unless state (what names it) comes back from the index as it was saved:
/// no infinite or NaN number (saved as null), no string that is not UTF-8 (replaced or refused
/// by the dump).
inline void expect_storable(const nlohmann::json& state, const std::string& what) {
  std::string at;
  expect_finite_numbers(state, at, what);
  try {
    (void)state.dump();
  } catch (const nlohmann::json::type_error& e) {
    raise<CheckpointError>(what, " holds a string that is not valid UTF-8, which JSON cannot ",
                           "store (", e.what(), ")");
  }
}

/// The name a segment has inside its shard file.
inline std::string segment_key(std::string_view tensor, std::int64_t offset) {
  return std::string(tensor) + "@" + std::to_string(offset);
}

/// Writes rank's shard file into temp and returns the report rank 0 builds the index from:
/// {"ok", "rank", "tag", "tensors": [specs], "file": {...}, "segments": [...]}. declared are the
/// segments' shapes, in the order produce hands their data to its sink (each segment's data is
/// read only during that call).
inline nlohmann::json write_shard(const std::filesystem::path& temp, int rank, int world_size,
                                  std::string_view tag, std::span<const TensorSpec> tensors,
                                  std::span<const SegmentShape> declared,
                                  const SegmentProducer& produce,
                                  const nlohmann::json& rank_state) {
  const std::string who = "rank " + std::to_string(rank);
  expect_storable(rank_state, who + "'s SaveOptions::rank_state");
  std::map<std::string, const TensorSpec*, std::less<>> spec_of;
  nlohmann::json specs = nlohmann::json::array();
  for (const TensorSpec& t : tensors) {
    expect<CheckpointError>(!t.name.empty(), who, ": a tensor has an empty name");
    expect<CheckpointError>(shape_fits(t.shape, t.dtype), who, ": tensor '", t.name,
                            "' has a negative extent or more bytes than fit in 64 bits");
    const auto [it, fresh] = spec_of.emplace(t.name, &t);
    if (!fresh) {
      expect<CheckpointError>(*it->second == t, who, ": tensor '", t.name,
                              "' is declared twice with different dtype or shape");
      continue;
    }
    specs.push_back(
        {{"name", t.name}, {"dtype", io::safetensors_dtype_name(t.dtype)}, {"shape", t.shape}});
  }
  std::vector<io::TensorDecl> decls;
  std::vector<const SegmentShape*> kept;
  for (const SegmentShape& s : declared) {
    const auto it = spec_of.find(s.name);
    expect<CheckpointError>(it != spec_of.end(), who, ": segment at element ", s.offset,
                            " belongs to tensor '", s.name, "', which was not declared");
    const TensorSpec& t = *it->second;
    expect<CheckpointError>(s.dtype == t.dtype, who, ": segment of tensor '", t.name, "' carries ",
                            name_of(s.dtype), " data but the tensor is ", name_of(t.dtype));
    expect<CheckpointError>(s.offset >= 0 && s.count >= 0 && s.count <= t.numel() - s.offset, who,
                            ": segment ", element_range(s.offset, s.count), " of tensor '", t.name,
                            "' is outside its ", t.numel(), " elements");
    if (s.count == 0) continue;
    decls.emplace_back(segment_key(s.name, s.offset), t.dtype, std::vector<std::int64_t>{s.count});
    kept.push_back(&s);
  }
  const std::string file_name = shard_file_name(rank, world_size);
  const std::map<std::string, std::string> metadata{{"format", "zero-checkpoint-shard"},
                                                    {"rank", std::to_string(rank)},
                                                    {"tag", std::string(tag)},
                                                    {"world_size", std::to_string(world_size)}};
  io::SafetensorsWriter writer(temp / file_name, decls, metadata);
  // The same serialisation the writer used, so these are the data section's file offsets.
  const std::uint64_t data_offset =
      8 + io::serialize_safetensors_header(writer.tensors(), metadata).size();
  nlohmann::json records = nlohmann::json::array();
  std::size_t next = 0;
  produce([&](const Segment& s) {
    expect<CheckpointError>(s.data.size() % size_of(s.dtype) == 0, who, ": segment of tensor '",
                            s.name, "' has ", s.data.size(), " bytes, not whole elements");
    if (s.count() == 0) return;
    expect<CheckpointError>(next < kept.size() && shape_of(s) == *kept[next], who,
                            ": the data of segment ", element_range(s.offset, s.count()),
                            " of tensor '", s.name, "' is not the next one declared (",
                            next < kept.size() ? kept[next]->name : std::string("none left"), ")");
    const io::TensorInfo& info = writer.tensors()[next];
    const std::uint32_t crc = crc32c(s.data);
    writer.write_bytes(info.name, s.data);
    records.push_back({{"tensor", s.name},
                       {"offset", s.offset},
                       {"count", s.count()},
                       {"bytes", {data_offset + info.begin, data_offset + info.end}},
                       {"crc32c", crc}});
    ++next;
  });
  expect<CheckpointError>(next == kept.size(), who, ": ", kept.size() - next, " of the ",
                          kept.size(), " declared segments got no data");
  writer.commit();
  const std::uint64_t file_bytes =
      data_offset + (writer.tensors().empty() ? 0 : writer.tensors().back().end);
  return {{"ok", true},
          {"rank", rank},
          {"tag", tag},
          {"tensors", std::move(specs)},
          {"file", {{"name", file_name}, {"rank", rank}, {"bytes", file_bytes}}},
          {"segments", std::move(records)},
          {"rank_state", rank_state}};
}

/// Rank 0's part after every shard is written: builds and checks the index from the reports,
/// writes it, syncs the temporary directory and publishes it. Returns the bytes of the index.
inline std::uint64_t finish_save(const std::filesystem::path& dir, std::string_view tag,
                                 const std::filesystem::path& temp,
                                 const std::vector<std::string>& reports,
                                 const nlohmann::json& engine, const SaveOptions& options) {
  const std::filesystem::path final_dir = dir / std::string(tag);
  std::vector<nlohmann::json> parsed;
  std::string failures;
  for (const std::string& text : reports) {
    parsed.push_back(nlohmann::json::parse(text));
    const auto& r = parsed.back();
    if (!r.at("ok").get<bool>()) {
      failures += "\n  rank " + std::to_string(r.at("rank").get<int>()) + ": " +
                  r.at("error").get<std::string>();
    }
  }
  expect<CheckpointError>(failures.empty(), "saving checkpoint '", final_dir.string(),
                          "' failed; nothing was published:", failures);
  Index index;
  index.tag = std::string(tag);
  index.world_size = static_cast<int>(reports.size());
  index.engine = engine;
  std::map<std::string, std::size_t> tensor_at;
  for (const auto& r : parsed) {
    const int rank = r.at("rank").get<int>();
    expect<CheckpointError>(r.at("tag").get<std::string>() == tag, "saving checkpoint '",
                            final_dir.string(), "': rank ", rank, " saves tag '",
                            r.at("tag").get<std::string>(), "' but rank 0 saves '", tag,
                            "'; every rank must pass the same tag");
    for (const auto& s : r.at("tensors")) {
      TensorRecord t;
      t.name = s.at("name").get<std::string>();
      t.dtype = *io::parse_safetensors_dtype(s.at("dtype").get<std::string>());
      t.shape = s.at("shape").get<std::vector<std::int64_t>>();
      const auto [it, fresh] = tensor_at.emplace(t.name, index.tensors.size());
      if (fresh) {
        index.tensors.push_back(std::move(t));
      } else {
        const TensorRecord& known = index.tensors[it->second];
        expect<CheckpointError>(known.dtype == t.dtype && known.shape == t.shape,
                                "saving checkpoint '", final_dir.string(), "': rank ", rank,
                                " declares tensor '", t.name, "' as ", t.describe(),
                                " but an earlier rank as ", known.describe());
      }
    }
    index.rank_states.push_back(r.at("rank_state"));
    const auto& f = r.at("file");
    index.files.push_back(
        {f.at("name").get<std::string>(), rank, f.at("bytes").get<std::uint64_t>()});
    const int file = static_cast<int>(index.files.size()) - 1;
    for (const auto& s : r.at("segments")) {
      SegmentRecord seg;
      seg.file = file;
      seg.offset = s.at("offset").get<std::int64_t>();
      seg.count = s.at("count").get<std::int64_t>();
      seg.byte_begin = s.at("bytes")[0].get<std::uint64_t>();
      seg.byte_end = s.at("bytes")[1].get<std::uint64_t>();
      seg.crc32c = s.at("crc32c").get<std::uint32_t>();
      index.tensors[tensor_at.at(s.at("tensor").get<std::string>())].segments.push_back(seg);
    }
  }
  validate_index(index, "saving checkpoint '" + final_dir.string() + "'");
  const std::string text = index_to_json(index).dump(1);
  io::AtomicFile index_file(temp / index_file_name);
  index_file.write(text.data(), text.size());
  index_file.commit();
  sync_directory(temp);
  publish_directory(temp, final_dir);
  if (options.update_latest) {
    try {
      write_latest(dir, tag);
    } catch (const std::exception& e) {
      // The tag is in place (and replaced what it named before): say so, rather than let the
      // caller take the failure for a save that published nothing.
      raise<CheckpointError>("checkpoint '", final_dir.string(),
                             "' was saved and published, but 'latest' could not be updated to "
                             "name it (it still names the tag before): ",
                             e.what());
    }
  }
  return text.size();
}

}  // namespace detail

/// Saves a checkpoint under <dir>/<tag>: a collective, every rank of comm must call it with the
/// same dir and tag. tensors are the logical tensors this rank knows (ranks may declare
/// different subsets; declarations of one name must agree); declared are the shapes of the runs
/// of them this rank holds, and produce hands their data to its sink in that order, each only
/// for the call (so a rank may stage its state one piece at a time, as an offloaded engine swaps
/// in one unit at a time). Across all ranks the segments of every tensor must tile it exactly:
/// no gap, no overlap (replicated state is saved by one rank). engine is the engine's free-form
/// state; rank 0's is stored (options.rank_state, per rank); either must come back from JSON as
/// it is (no infinite or NaN number, which would load as null; no string that is not UTF-8), or
/// the save is a CheckpointError naming where. Throws CheckpointError (or IoError)
/// on every rank if any rank failed, producing its data too; then nothing was published, except
/// when only the update of `latest` failed, which the message says (the tag itself is complete
/// and in place).
template <CheckpointComm Comm>
SaveResult save_streamed(Comm& comm, const std::filesystem::path& dir, std::string_view tag,
                         std::span<const TensorSpec> tensors,
                         std::span<const SegmentShape> declared, const SegmentProducer& produce,
                         const nlohmann::json& engine = nlohmann::json::object(),
                         const SaveOptions& options = {}) {
  const int rank = comm.rank();
  std::string prepared;
  if (rank == 0) {
    try {
      validate_tag(tag);
      detail::expect_storable(engine, "the engine state");
      create_durable_directories(dir);
      remove_stale_entries(dir);
      const auto temp = dir / (std::string(tag) + std::string(temp_marker) + detail::make_nonce());
      std::filesystem::create_directory(temp);
      prepared = "+" + temp.filename().string();
    } catch (const std::exception& e) {
      prepared = std::string("-") + e.what();
    }
  }
  prepared = parallel::broadcast_text(comm, prepared, 0);
  expect<CheckpointError>(prepared.front() == '+', "saving checkpoint '", tag, "' in '",
                          dir.string(), "' failed on rank 0: ", prepared.substr(1));
  const std::filesystem::path temp = dir / prepared.substr(1);

  nlohmann::json report;
  try {
    report = detail::write_shard(temp, rank, comm.size(), tag, tensors, declared, produce,
                                 options.rank_state);
  } catch (const std::exception& e) {
    report = {{"ok", false}, {"rank", rank}, {"error", e.what()}};
  }
  // Invalid UTF-8 (in a path or message) is replaced, not thrown: every rank must reach the
  // gather.
  const std::vector<std::string> reports = parallel::all_gather_text(
      comm, report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));

  std::string outcome;
  if (rank == 0) {
    try {
      std::uint64_t total = detail::finish_save(dir, tag, temp, reports, engine, options);
      for (const std::string& r : reports) {
        const auto j = nlohmann::json::parse(r);
        total += j.at("file").at("bytes").get<std::uint64_t>();
      }
      outcome = "+" + std::to_string(total);
    } catch (const std::exception& e) {
      std::error_code ignored;
      std::filesystem::remove_all(temp, ignored);
      outcome = std::string("-") + e.what();
    }
  }
  outcome = parallel::broadcast_text(comm, outcome, 0);
  if (outcome.front() != '+') throw CheckpointError(outcome.substr(1));
  SaveResult result;
  result.path = dir / std::string(tag);
  result.total_bytes = std::stoull(outcome.substr(1));
  if (report.at("ok").get<bool>()) {
    result.shard_bytes = report.at("file").at("bytes").get<std::uint64_t>();
  }
  return result;
}

/// save_streamed with every segment's data in memory (it must stay valid until save returns).
template <CheckpointComm Comm>
SaveResult save(Comm& comm, const std::filesystem::path& dir, std::string_view tag,
                std::span<const TensorSpec> tensors, std::span<const Segment> segments,
                const nlohmann::json& engine = nlohmann::json::object(),
                const SaveOptions& options = {}) {
  std::vector<SegmentShape> declared;
  declared.reserve(segments.size());
  for (const Segment& s : segments) declared.push_back(shape_of(s));
  return save_streamed(
      comm, dir, tag, tensors, declared,
      [&](const SegmentSink& sink) {
        for (const Segment& s : segments) sink(s);
      },
      engine, options);
}

/// Collects a rank's tensors and segments, then saves them (a convenience over save()).
class Writer {
 public:
  /// Declares a logical tensor.
  void add_tensor(TensorSpec spec) { tensors_.push_back(std::move(spec)); }
  /// Adds a segment; its data must stay valid until save returns.
  void add_segment(Segment segment) { segments_.push_back(std::move(segment)); }
  /// Adds elements [offset, offset + data.size()) of tensor name.
  template <class T>
  void add_segment(std::string name, std::int64_t offset, std::span<const T> data) {
    segments_.push_back(segment_of(std::move(name), offset, data));
  }
  /// The declared tensors.
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  /// The added segments.
  const std::vector<Segment>& segments() const { return segments_; }

  /// Saves everything added under <dir>/<tag> (a collective; see save()).
  template <CheckpointComm Comm>
  SaveResult save(Comm& comm, const std::filesystem::path& dir, std::string_view tag,
                  const nlohmann::json& engine = nlohmann::json::object(),
                  const SaveOptions& options = {}) const {
    return checkpoint::save(comm, dir, tag, std::span<const TensorSpec>(tensors_),
                            std::span<const Segment>(segments_), engine, options);
  }

 private:
  std::vector<TensorSpec> tensors_;
  std::vector<Segment> segments_;
};

}  // namespace zero::checkpoint
