#pragma once
// The safetensors header: parsing with full validation, and serialisation.
// A file is an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// padded with spaces, then the data section; offsets are relative to the data section. As in the
// reference implementation, the tensors' byte ranges must tile the data section exactly: sorted
// by offset, each begins where the previous ends and the last ends at the end of the file.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>

namespace zero::io {

/// Largest header accepted: the reference implementation's limit, so a corrupt length field
/// cannot make a reader allocate gigabytes.
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

/// The reserved header key of the free-form string metadata.
inline constexpr std::string_view safetensors_metadata_key = "__metadata__";

/// The safetensors spelling of a dtype ("F64", "F32", "BF16", "F16", "I64", "I32", "U16", "U8").
constexpr std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return "F64";
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::u16:
      return "U16";
    case DType::u8:
      return "U8";
  }
  return "?";
}

/// The dtype of a safetensors dtype name, or nullopt for one zero has no element type for
/// (BOOL, I8, I16, U32, U64, F8_*, ...).
inline std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType d : all_dtypes) {
    if (name == safetensors_dtype_name(d)) return d;
  }
  return std::nullopt;
}

/// One tensor of a safetensors file: name, dtype, extents and its bytes in the data section.
struct TensorInfo {
  std::string name;                 ///< Tensor name as in the header.
  DType dtype = DType::f32;         ///< Element type stored in the file.
  std::vector<std::int64_t> shape;  ///< Extents (any rank; rank 0 is a scalar).
  std::uint64_t begin = 0;          ///< First byte, relative to the data section.
  std::uint64_t end = 0;            ///< One past the last byte, relative to the data section.

  /// Number of elements (1 for rank 0, 0 if any extent is 0).
  std::int64_t numel() const { return numel_of(shape); }
  /// Size of the data in bytes.
  std::uint64_t bytes() const { return end - begin; }
  /// The extents as a zero::Shape; throws ShapeError past Shape::max_rank.
  Shape zero_shape() const {
    expect<ShapeError>(shape.size() <= static_cast<std::size_t>(Shape::max_rank), "tensor '", name,
                       "' has rank ", shape.size(), "; zero::Shape holds at most ",
                       Shape::max_rank);
    Shape s;
    switch (shape.size()) {  // Shape is built from an initializer_list only
      case 0:
        s = Shape{};
        break;
      case 1:
        s = Shape{shape[0]};
        break;
      case 2:
        s = Shape{shape[0], shape[1]};
        break;
      case 3:
        s = Shape{shape[0], shape[1], shape[2]};
        break;
      case 4:
        s = Shape{shape[0], shape[1], shape[2], shape[3]};
        break;
      case 5:
        s = Shape{shape[0], shape[1], shape[2], shape[3], shape[4]};
        break;
      default:
        s = Shape{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
        break;
    }
    return s;
  }
  /// The extents as "[d0, d1, ...]".
  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i > 0) s += ", ";
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
};

/// The extents of a zero::Shape as a vector (the form TensorInfo keeps).
inline std::vector<std::int64_t> extents_of(const Shape& shape) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(shape.rank()));
  for (int i = 0; i < shape.rank(); ++i) out[static_cast<std::size_t>(i)] = shape[i];
  return out;
}

/// A parsed and validated header.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;              ///< Sorted by their offset in the data section.
  std::map<std::string, std::string> metadata;  ///< The "__metadata__" entries.
};

namespace detail {
/// a * b, or nullopt on 64-bit overflow.
inline std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
}  // namespace detail

/// Parses header JSON for a data section of data_bytes bytes. Every inconsistency (bad JSON,
/// unknown dtype, malformed shape or offsets, offsets outside the data, overlaps, gaps, a byte
/// count that does not match shape and dtype) is a CheckpointError naming file and tensor.
inline SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t data_bytes,
                                                  const std::string& file) {
  const std::string where = "safetensors file '" + file + "'";
  expect<CheckpointError>(!text.empty() && text.front() == '{', where,
                          ": the header does not start with '{' (not a safetensors file?)");
  nlohmann::json json;
  // A name listed twice would keep only its last entry (nlohmann::json's choice): the first is
  // found while parsing, as a key of the top-level object (depth 1) seen before.
  std::set<std::string, std::less<>> names;
  std::string repeated;
  const auto find_repeated = [&](int depth, nlohmann::json::parse_event_t event,
                                 nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && repeated.empty() &&
        !names.insert(parsed.get<std::string>()).second) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  try {
    json = nlohmann::json::parse(text, find_repeated);
  } catch (const nlohmann::json::exception& e) {
    raise<CheckpointError>(where, ": the header is not valid JSON: ", e.what());
  }
  expect<CheckpointError>(json.is_object(), where, ": the header is not a JSON object");
  expect<CheckpointError>(repeated.empty(), where, ", tensor '", repeated,
                          "': the header lists the name twice");

  SafetensorsHeader header;
  for (const auto& [name, entry] : json.items()) {
    const std::string tensor = where + ", tensor '" + name + "'";
    if (name == safetensors_metadata_key) {
      expect<CheckpointError>(entry.is_object(), where, ": \"__metadata__\" is not an object");
      for (const auto& [key, value] : entry.items()) {
        expect<CheckpointError>(value.is_string(), where, ": metadata entry '", key,
                                "' is not a string");
        header.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    expect<CheckpointError>(entry.is_object(), tensor, ": the entry is not a JSON object");
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      expect<CheckpointError>(entry.contains(field), tensor, ": the entry has no \"", field, "\"");
    }
    TensorInfo info;
    info.name = name;
    const auto& dtype = entry.at("dtype");
    expect<CheckpointError>(dtype.is_string(), tensor, ": \"dtype\" is not a string");
    const auto parsed = parse_safetensors_dtype(dtype.get<std::string>());
    expect<CheckpointError>(parsed.has_value(), tensor, ": unknown or unsupported dtype '",
                            dtype.get<std::string>(),
                            "'; zero reads F64, F32, BF16, F16, I64, I32, U16 and U8");
    info.dtype = *parsed;

    const auto& shape = entry.at("shape");
    expect<CheckpointError>(shape.is_array(), tensor, ": \"shape\" is not an array");
    std::uint64_t numel = 1;
    bool overflow = false;
    for (const auto& extent : shape) {
      expect<CheckpointError>(extent.is_number_unsigned(), tensor, ": shape ", shape.dump(),
                              " has an entry that is not a non-negative integer");
      const auto e = extent.get<std::uint64_t>();
      expect<CheckpointError>(
          e <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), tensor,
          ": extent ", e, " is too large");
      info.shape.push_back(static_cast<std::int64_t>(e));
      const auto product = detail::checked_mul(numel, e);
      overflow = overflow || !product;
      numel = product.value_or(0);
    }

    const auto& offsets = entry.at("data_offsets");
    expect<CheckpointError>(offsets.is_array() && offsets.size() == 2 &&
                                offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
                            tensor, ": \"data_offsets\" is ", offsets.dump(),
                            "; expected [begin, end] with non-negative integers");
    info.begin = offsets[0].get<std::uint64_t>();
    info.end = offsets[1].get<std::uint64_t>();
    expect<CheckpointError>(info.begin <= info.end, tensor, ": data_offsets [", info.begin, ", ",
                            info.end, "] end before they begin");
    expect<CheckpointError>(info.end <= data_bytes, tensor, ": data_offsets [", info.begin, ", ",
                            info.end, "] reach past the data section's ", data_bytes,
                            " bytes (truncated file?)");
    const auto expected = detail::checked_mul(numel, size_of(info.dtype));
    expect<CheckpointError>(!overflow && expected.has_value(), tensor, ": shape ",
                            info.shape_string(), " has more elements than 64 bits can count");
    expect<CheckpointError>(*expected == info.bytes(), tensor, ": shape ", info.shape_string(),
                            " of ", safetensors_dtype_name(info.dtype), " needs ", *expected,
                            " bytes but data_offsets [", info.begin, ", ", info.end, "] hold ",
                            info.bytes());
    header.tensors.push_back(std::move(info));
  }

  // Sort by (begin, end) so zero-size tensors sit before a tensor starting at the same byte.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t next = 0;
  const TensorInfo* previous = nullptr;
  for (const auto& info : header.tensors) {
    if (info.begin < next) {
      raise<CheckpointError>(where, ", tensor '", info.name, "': data_offsets [", info.begin, ", ",
                             info.end, "] overlap tensor '", previous->name, "' at [",
                             previous->begin, ", ", previous->end, "]");
    }
    if (info.begin > next) {
      raise<CheckpointError>(where, ", tensor '", info.name, "': data_offsets [", info.begin, ", ",
                             info.end, "] leave a gap after byte ", next,
                             "; tensors must tile the data section");
    }
    next = info.end;
    previous = &info;
  }
  expect<CheckpointError>(next == data_bytes, where, ": the tensors end at byte ", next,
                          " of the data section but it holds ", data_bytes,
                          " bytes (trailing bytes not described by the header)");
  return header;
}

/// The header bytes for tensors (in the given order) and metadata: compact JSON with
/// "__metadata__" first when present, padded with spaces to a multiple of 8 bytes as the
/// reference writer does, so the data section starts 8-byte aligned. Written entry by entry
/// (the names are unique, as the writer checks): an ordered_json object looks each key up
/// linearly, which made a shard of many segments quadratic to describe.
inline std::string serialize_safetensors_header(
    const std::vector<TensorInfo>& tensors, const std::map<std::string, std::string>& metadata) {
  std::string text = "{";
  try {
    const auto key = [&](const std::string& name) {
      if (text.size() > 1) text += ',';
      text += nlohmann::json(name).dump();  // quoted and escaped
      text += ':';
    };
    if (!metadata.empty()) {
      key(std::string(safetensors_metadata_key));
      text += nlohmann::json(metadata).dump();  // a std::map: keys in order
    }
    for (const auto& t : tensors) {
      key(t.name);
      text += R"({"dtype":")";
      text += safetensors_dtype_name(t.dtype);
      text += R"(","shape":)";
      text += nlohmann::json(t.shape).dump();
      text += R"(,"data_offsets":[)" + std::to_string(t.begin) + ',' + std::to_string(t.end) + "]}";
    }
  } catch (const nlohmann::json::type_error& e) {  // 316: a name or value is not UTF-8
    raise<CheckpointError>("safetensors header: tensor names and metadata must be UTF-8 (",
                           e.what(), ")");
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace zero::io
