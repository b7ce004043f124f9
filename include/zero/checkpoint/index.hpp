#pragma once
// The checkpoint index (<tag>/index.json): every logical tensor with its dtype and shape and,
// for each segment of it, the shard file, the absolute byte range in that file, the element
// range in the flattened tensor and the CRC32C of the bytes; the shard files with their exact
// sizes; the world size of the save; and the engine's free-form state. Parsing validates
// everything a reader relies on, so reads need no further checks: segments of a tensor tile it
// exactly (sorted, no gap, no overlap), byte ranges match counts and lie inside their file.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/checkpoint/crc32c.hpp>
#include <zero/checkpoint/segment.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/io/safetensors_header.hpp>

namespace zero::checkpoint {

/// The "format" value of an index.
inline constexpr std::string_view index_format_name = "zero-checkpoint";
/// The index version this code writes and reads.
inline constexpr int index_format_version = 1;

/// One shard file of a checkpoint.
struct FileRecord {
  std::string name;         ///< File name inside the tag directory.
  int rank = 0;             ///< The rank that wrote it.
  std::uint64_t bytes = 0;  ///< Its exact size.
};

/// Where one segment of a logical tensor lives.
struct SegmentRecord {
  int file = 0;                  ///< Position in Index::files.
  std::uint64_t byte_begin = 0;  ///< First byte in the file (absolute).
  std::uint64_t byte_end = 0;    ///< One past the last byte.
  std::int64_t offset = 0;       ///< First element within the flattened tensor.
  std::int64_t count = 0;        ///< Elements.
  std::uint32_t crc32c = 0;      ///< CRC32C of the bytes [byte_begin, byte_end).

  /// One past the last element.
  std::int64_t end() const { return offset + count; }
};

/// A logical tensor and its segments (sorted by offset, tiling the tensor).
struct TensorRecord {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<SegmentRecord> segments;

  /// Elements of the flattened tensor.
  std::int64_t numel() const { return numel_of(shape); }
  /// The spec (name, dtype, shape).
  TensorSpec spec() const { return {name, dtype, shape}; }
  /// "F32 [768, 2304]" for messages.
  std::string describe() const {
    std::string s(io::safetensors_dtype_name(dtype));
    s += " [";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i > 0) s += ", ";
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
};

/// A whole checkpoint index.
struct Index {
  std::string tag;                                   ///< The tag it was saved under.
  int world_size = 0;                                ///< Ranks that saved it.
  std::vector<FileRecord> files;                     ///< Shard files, by rank.
  std::vector<TensorRecord> tensors;                 ///< Logical tensors in save order.
  nlohmann::json engine = nlohmann::json::object();  ///< The engine's state, free-form.
  std::vector<nlohmann::json>
      rank_states;  ///< Per saving rank, free-form (null: none); may be empty.
};

/// CRC32C of the index's free-form state (engine, then rank_states), over their compact dumps:
/// the segments' checksums cover the tensors, this one the counters, scheduler, loss scaler and
/// client_state, where a flipped digit would still parse.
inline std::uint32_t state_crc32c(const nlohmann::json& engine,
                                  const std::vector<nlohmann::json>& rank_states) {
  std::string text = engine.dump();
  for (const auto& r : rank_states) {
    text += '\n';  // appended in two steps: GCC 12 warns (-Wrestrict) on "\n" + r.dump()
    text += r.dump();
  }
  return crc32c(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

/// The index as JSON (tensors in order; segments name their file).
inline nlohmann::ordered_json index_to_json(const Index& index) {
  nlohmann::ordered_json j;
  j["format"] = index_format_name;
  j["version"] = index_format_version;
  j["tag"] = index.tag;
  j["world_size"] = index.world_size;
  j["checksum"] = "crc32c";
  auto& files = j["files"] = nlohmann::ordered_json::array();
  for (const FileRecord& f : index.files) {
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}});
  }
  auto& tensors = j["tensors"] = nlohmann::ordered_json::object();
  for (const TensorRecord& t : index.tensors) {
    nlohmann::ordered_json entry;
    entry["dtype"] = io::safetensors_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    auto& segs = entry["segments"] = nlohmann::ordered_json::array();
    for (const SegmentRecord& s : t.segments) {
      segs.push_back({{"file", index.files.at(static_cast<std::size_t>(s.file)).name},
                      {"offset", s.offset},
                      {"count", s.count},
                      {"bytes", {s.byte_begin, s.byte_end}},
                      {"crc32c", s.crc32c}});
    }
    tensors[t.name] = std::move(entry);
  }
  j["engine"] = nlohmann::ordered_json::parse(index.engine.dump());
  const bool any_rank_state = std::any_of(index.rank_states.begin(), index.rank_states.end(),
                                          [](const nlohmann::json& r) { return !r.is_null(); });
  if (any_rank_state) {
    auto& ranks = j["rank_states"] = nlohmann::ordered_json::array();
    for (const auto& r : index.rank_states)
      ranks.push_back(nlohmann::ordered_json::parse(r.dump()));
  }
  j["state_crc32c"] = state_crc32c(
      index.engine, any_rank_state ? index.rank_states : std::vector<nlohmann::json>{});
  return j;
}

/// Checks what readers rely on and sorts each tensor's segments by offset: file references,
/// byte ranges inside their file and matching count * element size, and segments tiling the
/// tensor. Throws CheckpointError naming where (the index file) and the tensor.
inline void validate_index(Index& index, const std::string& where) {
  expect<CheckpointError>(index.world_size > 0, where, ": world_size ", index.world_size,
                          " must be positive");
  std::map<std::string_view, int> seen;
  for (TensorRecord& t : index.tensors) {
    const std::string at = where + ", tensor '" + t.name + "' (" + t.describe() + ")";
    expect<CheckpointError>(!t.name.empty(), where, ": a tensor has an empty name");
    expect<CheckpointError>(seen.emplace(t.name, 0).second, at, ": listed twice");
    // Its element count and bytes must fit int64 before numel() is used (a product that wraps
    // to 0 would pass with no segments).
    expect<CheckpointError>(shape_fits(t.shape, t.dtype), at,
                            ": the shape's extents must be >= 0 and their product fit in 64 bits");
    std::sort(t.segments.begin(), t.segments.end(),
              [](const auto& a, const auto& b) { return a.offset < b.offset; });
    std::int64_t next = 0;
    for (const SegmentRecord& s : t.segments) {
      expect<CheckpointError>(s.file >= 0 && static_cast<std::size_t>(s.file) < index.files.size(),
                              at, ": a segment names file #", s.file, " of ", index.files.size());
      const FileRecord& f = index.files[static_cast<std::size_t>(s.file)];
      expect<CheckpointError>(s.count > 0, at, ": segment at element ", s.offset, " in '", f.name,
                              "' has ", s.count, " elements");
      expect<CheckpointError>(s.offset == next, at, ": segments must tile the tensor, but ",
                              s.offset < next ? "one overlaps the previous at element "
                                              : "elements are missing before element ",
                              s.offset, " (covered up to ", next, ")");
      expect<CheckpointError>(s.count <= t.numel() - s.offset, at, ": segment at element ",
                              s.offset, " with ", s.count, " elements passes the tensor's end");
      const auto bytes = static_cast<std::uint64_t>(s.count) * size_of(t.dtype);
      expect<CheckpointError>(s.byte_end >= s.byte_begin && s.byte_end - s.byte_begin == bytes, at,
                              ": segment [", s.offset, ", ", s.end(), ") in '", f.name,
                              "' has byte range [", s.byte_begin, ", ", s.byte_end, ") but needs ",
                              bytes, " bytes");
      expect<CheckpointError>(s.byte_end <= f.bytes, at, ": segment [", s.offset, ", ", s.end(),
                              ") reaches byte ", s.byte_end, " of '", f.name, "', which has ",
                              f.bytes, " bytes");
      next = s.end();
    }
    expect<CheckpointError>(next == t.numel(), at, ": segments cover elements [0, ", next, ") of ",
                            t.numel());
  }
}

namespace detail {
/// j[key] as T, or CheckpointError naming where and the key.
/// value as the integer type I, or a CheckpointError naming key: nlohmann converts a float or
/// an out-of-range integer with a cast whose result is undefined (found by
/// fuzz_checkpoint_index: "bytes": 8.9e102).
template <class I>
I index_integer(const nlohmann::ordered_json& value, const char* key, const std::string& where) {
  bool fits = false;
  if (value.is_number_unsigned()) {
    fits = std::in_range<I>(value.get<std::uint64_t>());
  } else if (value.is_number_integer()) {
    fits = std::in_range<I>(value.get<std::int64_t>());
  }
  expect<CheckpointError>(fits, where, ": \"", key, "\" must be an integer in [",
                          +std::numeric_limits<I>::min(), ", ", +std::numeric_limits<I>::max(),
                          "], got ", value.dump());
  return value.is_number_unsigned() ? static_cast<I>(value.get<std::uint64_t>())
                                    : static_cast<I>(value.get<std::int64_t>());
}

/// True for std::vector of an integer type (the index's shape and byte ranges).
template <class T>
inline constexpr bool is_integer_vector = false;
template <class I>
inline constexpr bool is_integer_vector<std::vector<I>> = std::is_integral_v<I>;

template <class T>
T index_field(const nlohmann::ordered_json& j, const char* key, const std::string& where) {
  expect<CheckpointError>(j.is_object() && j.contains(key), where, ": missing \"", key, "\"");
  const auto& value = j.at(key);
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return index_integer<T>(value, key, where);
  } else if constexpr (is_integer_vector<T>) {
    expect<CheckpointError>(value.is_array(), where, ": \"", key, "\" has the wrong type (",
                            value.dump(), "): expected a list");
    T out;
    for (const auto& e : value) out.push_back(index_integer<typename T::value_type>(e, key, where));
    return out;
  } else {
    try {
      return value.get<T>();
    } catch (const nlohmann::json::exception& e) {
      raise<CheckpointError>(where, ": \"", key, "\" has the wrong type (", value.dump(),
                             "): ", e.what());
    }
  }
}
}  // namespace detail

/// Parses and validates index JSON; where names the file in messages. Every problem (bad JSON,
/// a truncated file, missing or mistyped fields, an unknown file or dtype, a broken tiling) is a
/// CheckpointError naming where and, when one is at fault, the tensor.
inline Index parse_index(std::string_view text, const std::string& where) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    raise<CheckpointError>(
        where, ": malformed index (not valid JSON; truncated or corrupted?): ", e.what());
  }
  expect<CheckpointError>(j.is_object(), where, ": malformed index: not a JSON object");
  const auto format = detail::index_field<std::string>(j, "format", where);
  expect<CheckpointError>(format == index_format_name, where, ": format is '", format,
                          "', expected '", index_format_name, "'");
  const int version = detail::index_field<int>(j, "version", where);
  expect<CheckpointError>(version == index_format_version, where, ": index version ", version,
                          " is not supported (this build reads version ", index_format_version,
                          ")");
  Index index;
  index.tag = detail::index_field<std::string>(j, "tag", where);
  index.world_size = detail::index_field<int>(j, "world_size", where);
  std::map<std::string, int> file_of;
  const auto& files = j.contains("files") ? j.at("files") : nlohmann::ordered_json();
  expect<CheckpointError>(files.is_array(), where, ": \"files\" is missing or not an array");
  for (const auto& f : files) {
    FileRecord rec;
    rec.name = detail::index_field<std::string>(f, "name", where + ", files");
    rec.rank = detail::index_field<int>(f, "rank", where + ", file '" + rec.name + "'");
    rec.bytes = detail::index_field<std::uint64_t>(f, "bytes", where + ", file '" + rec.name + "'");
    expect<CheckpointError>(
        rec.name.find('/') == std::string::npos && rec.name != ".." && !rec.name.empty(), where,
        ": file name '", rec.name, "' must be a plain name inside the tag directory");
    expect<CheckpointError>(file_of.emplace(rec.name, static_cast<int>(index.files.size())).second,
                            where, ": file '", rec.name, "' is listed twice");
    index.files.push_back(std::move(rec));
  }
  const auto& tensors = j.contains("tensors") ? j.at("tensors") : nlohmann::ordered_json();
  expect<CheckpointError>(tensors.is_object(), where, ": \"tensors\" is missing or not an object");
  for (const auto& [name, entry] : tensors.items()) {
    const std::string at = where + ", tensor '" + name + "'";
    TensorRecord t;
    t.name = name;
    const auto dtype = detail::index_field<std::string>(entry, "dtype", at);
    const auto parsed = io::parse_safetensors_dtype(dtype);
    expect<CheckpointError>(parsed.has_value(), at, ": unknown dtype '", dtype, "'");
    t.dtype = *parsed;
    t.shape = detail::index_field<std::vector<std::int64_t>>(entry, "shape", at);
    for (std::int64_t e : t.shape) expect<CheckpointError>(e >= 0, at, ": negative extent ", e);
    expect<CheckpointError>(entry.contains("segments") && entry.at("segments").is_array(), at,
                            ": \"segments\" is missing or not an array");
    for (const auto& s : entry.at("segments")) {
      SegmentRecord seg;
      const auto file = detail::index_field<std::string>(s, "file", at);
      const auto it = file_of.find(file);
      expect<CheckpointError>(it != file_of.end(), at, ": a segment names file '", file,
                              "', which \"files\" does not list");
      seg.file = it->second;
      seg.offset = detail::index_field<std::int64_t>(s, "offset", at);
      seg.count = detail::index_field<std::int64_t>(s, "count", at);
      const auto bytes = detail::index_field<std::vector<std::uint64_t>>(s, "bytes", at);
      expect<CheckpointError>(bytes.size() == 2, at, ": a segment's \"bytes\" is not [begin, end]");
      seg.byte_begin = bytes[0];
      seg.byte_end = bytes[1];
      seg.crc32c = detail::index_field<std::uint32_t>(s, "crc32c", at);
      t.segments.push_back(seg);
    }
    index.tensors.push_back(std::move(t));
  }
  if (j.contains("engine")) index.engine = nlohmann::json::parse(j.at("engine").dump());
  if (j.contains("rank_states")) {
    const auto& ranks = j.at("rank_states");
    expect<CheckpointError>(
        ranks.is_array() && ranks.size() == static_cast<std::size_t>(index.world_size), where,
        ": \"rank_states\" must be an array of world_size (", index.world_size, ") entries");
    for (const auto& r : ranks) index.rank_states.push_back(nlohmann::json::parse(r.dump()));
  }
  // Indexes written before the field have none to check.
  if (j.contains("state_crc32c")) {
    const auto want = detail::index_field<std::uint32_t>(j, "state_crc32c", where);
    const std::uint32_t got = state_crc32c(index.engine, index.rank_states);
    expect<CheckpointError>(got == want, where,
                            ": the engine and client state fail their checksum (", got, " against ",
                            want, "): the index is corrupted");
  }
  validate_index(index, where);
  return index;
}

}  // namespace zero::checkpoint
