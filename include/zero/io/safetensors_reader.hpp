#pragma once
// SafetensorsReader: opens a safetensors file, validates its header once, and reads whole
// tensors or any element (or byte) range of one with pread, so a rank reads only the slice it
// owns and never maps or loads the whole model. Elements may be converted on the way (a BF16
// file read into an f32 buffer) when the caller asks for it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/tensor.hpp>
#include <zero/io/element_conversion.hpp>
#include <zero/io/file.hpp>
#include <zero/io/safetensors_header.hpp>

namespace zero::io {

/// Read access to one safetensors file.
class SafetensorsReader {
 public:
  /// Opens path and validates its header; throws IoError (cannot open or read) or
  /// CheckpointError (malformed file), naming the file and, where one is at fault, the tensor.
  explicit SafetensorsReader(std::filesystem::path path) : file_(std::move(path)) {
    const std::string name = file_.path().string();
    expect<CheckpointError>(file_.size() >= 8, "safetensors file '", name, "' has ", file_.size(),
                            " bytes; it needs at least the 8-byte header length");
    unsigned char length_bytes[8];
    file_.read_at(0, length_bytes, 8, "the header length");
    std::uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
    expect<CheckpointError>(header_bytes <= safetensors_max_header_bytes, "safetensors file '",
                            name, "': header length ", header_bytes, " exceeds the limit of ",
                            safetensors_max_header_bytes, " bytes (corrupt or not safetensors)");
    expect<CheckpointError>(header_bytes <= file_.size() - 8, "safetensors file '", name,
                            "': header length ", header_bytes, " is larger than the ",
                            file_.size() - 8, " bytes after the length field (truncated?)");
    std::string text(static_cast<std::size_t>(header_bytes), '\0');
    file_.read_at(8, text.data(), text.size(), "the header");
    data_offset_ = 8 + header_bytes;
    auto header = parse_safetensors_header(text, file_.size() - data_offset_, name);
    tensors_ = std::move(header.tensors);
    metadata_ = std::move(header.metadata);
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  /// The file's path.
  const std::filesystem::path& path() const { return file_.path(); }
  /// Every tensor, sorted by its offset in the file.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The header's "__metadata__" entries.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Absolute file offset of the data section.
  std::uint64_t data_offset() const { return data_offset_; }
  /// True when the file holds a tensor called name.
  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }

  /// The entry for name; throws CheckpointError naming the file and the missing tensor.
  const TensorInfo& info(std::string_view name) const {
    const auto it = index_.find(name);
    if (it == index_.end()) {
      raise<CheckpointError>("safetensors file '", path().string(), "' has no tensor '", name,
                             "' (it holds ", tensors_.size(), " tensors", suggestion(name), ")");
    }
    return tensors_[it->second];
  }

  /// Throws CheckpointError unless name exists with exactly shape.
  void expect_tensor(std::string_view name, const Shape& shape) const {
    const TensorInfo& t = info(name);
    expect<CheckpointError>(extents_of(shape) == t.shape, where(t), " has shape ", t.shape_string(),
                            " but ", shape, " was expected");
  }

  /// Copies bytes [first_byte, first_byte + out.size()) of tensor name into out, unconverted.
  void read_bytes(std::string_view name, std::uint64_t first_byte, std::span<std::byte> out) const {
    const TensorInfo& t = info(name);
    expect<CheckpointError>(first_byte <= t.bytes() && out.size() <= t.bytes() - first_byte,
                            where(t), ": byte range [", first_byte, ", ", first_byte + out.size(),
                            ") is outside its ", t.bytes(), " bytes");
    if (!out.empty()) {
      file_.read_at(data_offset_ + t.begin + first_byte, out.data(), out.size(), where(t));
    }
  }

  /// Reads out.numel() elements of tensor name starting at flat element first into the host
  /// tensor out (a rank's shard of a flattened parameter), converting as rule allows.
  template <class T>
  void read_elements(std::string_view name, std::int64_t first, Tensor<T> out,
                     DTypeRule rule = DTypeRule::exact) const {
    static_assert(!std::is_const_v<T>, "read_elements writes into out");
    const TensorInfo& t = info(name);
    const std::int64_t count = out.numel();
    expect<CheckpointError>(
        first >= 0 && count >= 0 && first <= t.numel() && count <= t.numel() - first, where(t),
        ": ", count, " elements from element ", first, " are outside its ", t.numel(), " elements");
    expect<CheckpointError>(out.device() == DeviceKind::host, where(t),
                            ": reads go to host memory, but the destination lives on ",
                            name_of(out.device()));
    check_dtype<T>(t, rule);
    if (count == 0) return;
    const std::size_t elem = size_of(t.dtype);
    const std::uint64_t start = data_offset_ + t.begin + static_cast<std::uint64_t>(first) * elem;
    if (t.dtype == dtype_of<T>) {
      file_.read_at(start, out.data(), static_cast<std::size_t>(count) * elem, where(t));
      return;
    }
    std::vector<std::byte> staging(
        std::min<std::size_t>(static_cast<std::size_t>(count), conversion_chunk_elems) * elem);
    for (std::int64_t done = 0; done < count;) {
      const auto n = static_cast<std::size_t>(
          std::min<std::int64_t>(count - done, static_cast<std::int64_t>(conversion_chunk_elems)));
      file_.read_at(start + static_cast<std::uint64_t>(done) * elem, staging.data(), n * elem,
                    where(t));
      convert_elements(t.dtype, staging.data(), dtype_of<T>, out.data() + done, n, where(t));
      done += static_cast<std::int64_t>(n);
    }
  }

  /// Reads the whole tensor name into out, whose shape must equal the file's.
  template <class T>
  void read(std::string_view name, Tensor<T> out, DTypeRule rule = DTypeRule::exact) const {
    expect_tensor(name, out.shape());
    read_elements(name, 0, out, rule);
  }

  /// The whole tensor name as a vector of T (flat, row-major).
  template <class T>
  std::vector<T> read_vector(std::string_view name, DTypeRule rule = DTypeRule::exact) const {
    const TensorInfo& t = info(name);
    std::vector<T> values(static_cast<std::size_t>(t.numel()));
    read_elements(name, 0, Tensor<T>(values.data(), Shape{t.numel()}), rule);
    return values;
  }

 private:
  /// "safetensors file 'F', tensor 'N'" for messages.
  std::string where(const TensorInfo& t) const {
    return zero::detail::concat("safetensors file '", path().string(), "', tensor '", t.name, "' (",
                                safetensors_dtype_name(t.dtype), " ", t.shape_string(), ")");
  }

  /// Throws CheckpointError unless elements of t may be read as T under rule.
  template <class T>
  void check_dtype(const TensorInfo& t, DTypeRule rule) const {
    constexpr DType want = dtype_of<T>;
    if (t.dtype == want) return;
    expect<CheckpointError>(rule == DTypeRule::convert, where(t), ": stored as ",
                            safetensors_dtype_name(t.dtype), " but ", name_of(want),
                            " was requested; read with DTypeRule::convert to convert");
    expect<CheckpointError>(can_convert(t.dtype, want), where(t), ": cannot convert ",
                            safetensors_dtype_name(t.dtype), " to ", name_of(want),
                            " (only float<->float and integer<->integer)");
  }

  /// ", did you mean 'X'" for the stored name that ends like name, if any (a missing or extra
  /// "transformer." prefix is the usual mistake).
  std::string suggestion(std::string_view name) const {
    for (const auto& t : tensors_) {
      const std::string_view stored = t.name;
      const bool a_ends_b = stored.size() > name.size() && stored.ends_with(name);
      const bool b_ends_a = name.size() > stored.size() && name.ends_with(stored);
      if (a_ends_b || b_ends_a) return "; did you mean '" + t.name + "'?";
    }
    return "";
  }

  ReadFile file_;
  std::uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::size_t, std::less<>> index_;
};

}  // namespace zero::io
