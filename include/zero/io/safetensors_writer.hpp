#pragma once
// SafetensorsWriter: streams a safetensors file tensor by tensor. The caller declares every
// tensor (name, dtype, extents) up front, which fixes the header; then it appends each tensor's
// data in declaration order, in as many pieces as it likes (a unit at a time, a shard at a
// time), so no process ever holds the whole model. The file appears under its final name only
// on commit (temporary file, fsync, rename); an abandoned writer leaves nothing behind.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/io/element_conversion.hpp>
#include <zero/io/file.hpp>
#include <zero/io/safetensors_header.hpp>

namespace zero::io {

/// A tensor to be written: its name, the dtype stored in the file, and its extents.
struct TensorDecl {
  std::string name;                 ///< Unique name; "__metadata__" is reserved.
  DType dtype = DType::f32;         ///< Element type in the file.
  std::vector<std::int64_t> shape;  ///< Extents (any rank, rank 0 for a scalar).

  TensorDecl() = default;
  /// Declares name with dtype and extents given as a vector.
  TensorDecl(std::string name_, DType dtype_, std::vector<std::int64_t> shape_)
      : name(std::move(name_)), dtype(dtype_), shape(std::move(shape_)) {}
  /// Declares name with dtype and a zero::Shape.
  TensorDecl(std::string name_, DType dtype_, const Shape& shape_)
      : name(std::move(name_)), dtype(dtype_), shape(extents_of(shape_)) {}
};

/// Writes one safetensors file from declared tensors whose data arrive in order.
class SafetensorsWriter {
 public:
  /// Validates the declarations, creates the temporary file and writes the header. Throws
  /// CheckpointError for an empty, duplicate or reserved name or a negative extent, IoError if
  /// the file cannot be created.
  SafetensorsWriter(std::filesystem::path path, const std::vector<TensorDecl>& tensors,
                    const std::map<std::string, std::string>& metadata = {})
      : tensors_(plan(path, tensors)), file_(std::move(path)) {
    const std::string header = serialize_safetensors_header(tensors_, metadata);
    unsigned char length_bytes[8];
    for (int i = 0; i < 8; ++i) {
      length_bytes[i] = static_cast<unsigned char>(std::uint64_t{header.size()} >> (8 * i));
    }
    file_.write(length_bytes, 8);
    file_.write(header.data(), header.size());
    data_start_ = file_.bytes_written();
    skip_empty();
  }

  /// The path the file gets on commit.
  const std::filesystem::path& path() const { return file_.final_path(); }
  /// The declared tensors with their byte ranges in the data section.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The name of the tensor whose data are expected next ("" when all are written).
  std::string_view next_tensor() const {
    return current_ < tensors_.size() ? std::string_view(tensors_[current_].name) : "";
  }

  /// Appends data (all or the next part of tensor name's elements) to the file, converting to
  /// the declared dtype as rule allows. name must be the tensor being written: data arrive in
  /// declaration order. Throws CheckpointError naming file and tensor otherwise.
  template <class T>
  void write(std::string_view name, Tensor<T> data, DTypeRule rule = DTypeRule::exact) {
    using Elem = std::remove_const_t<T>;
    constexpr DType from = dtype_of<Elem>;
    const TensorInfo& t = expect_current(
        name, static_cast<std::uint64_t>(data.numel()) * size_of(tensors_[index_of(name)].dtype));
    expect<CheckpointError>(data.device() == DeviceKind::host, where(t),
                            ": data must be in host memory, not on ", name_of(data.device()));
    expect<CheckpointError>(from == t.dtype || rule == DTypeRule::convert, where(t),
                            ": declared as ", safetensors_dtype_name(t.dtype), " but ",
                            name_of(from), " data were given; write with DTypeRule::convert");
    expect<CheckpointError>(can_convert(from, t.dtype), where(t), ": cannot convert ",
                            name_of(from), " to ", safetensors_dtype_name(t.dtype));
    const auto count = static_cast<std::size_t>(data.numel());
    if (from == t.dtype) {
      append(data.data(), count * sizeof(Elem));
      return;
    }
    const std::size_t chunk = conversion_chunk_elems;
    std::vector<std::byte> staging(std::min(count, chunk) * size_of(t.dtype));
    for (std::size_t done = 0; done < count; done += chunk) {
      const std::size_t n = std::min(chunk, count - done);
      convert_elements(from, data.data() + done, t.dtype, staging.data(), n, where(t));
      append(staging.data(), n * size_of(t.dtype));
    }
  }

  /// Appends raw bytes (already in the declared dtype, little-endian) to tensor name.
  void write_bytes(std::string_view name, std::span<const std::byte> bytes) {
    expect_current(name, bytes.size());
    append(bytes.data(), bytes.size());
  }

  /// Checks every tensor is complete, then makes the file durable and renames it into place.
  void commit() {
    expect<CheckpointError>(current_ == tensors_.size(), "safetensors file '", path().string(),
                            "': cannot commit before tensor '", next_tensor(),
                            "' and the ones after it are written");
    file_.commit();
  }

 private:
  /// The declarations with their byte ranges, validated before any file is created.
  static std::vector<TensorInfo> plan(const std::filesystem::path& path,
                                      const std::vector<TensorDecl>& tensors) {
    const std::string file = path.string();
    std::vector<TensorInfo> planned;
    std::set<std::string_view> seen;
    std::uint64_t offset = 0;
    for (const TensorDecl& d : tensors) {
      expect<CheckpointError>(!d.name.empty(), "safetensors file '", file,
                              "': a tensor has an empty name");
      expect<CheckpointError>(d.name != safetensors_metadata_key, "safetensors file '", file,
                              "': '__metadata__' is reserved and cannot name a tensor");
      expect<CheckpointError>(seen.insert(d.name).second, "safetensors file '", file, "': tensor '",
                              d.name, "' is declared twice");
      TensorInfo info;
      info.name = d.name;
      info.dtype = d.dtype;
      info.shape = d.shape;
      std::uint64_t bytes = size_of(d.dtype);
      for (std::int64_t e : d.shape) {
        expect<CheckpointError>(e >= 0, "safetensors file '", file, "', tensor '", d.name,
                                "': extent ", e, " is negative");
        const auto product = detail::checked_mul(bytes, static_cast<std::uint64_t>(e));
        expect<CheckpointError>(product.has_value(), "safetensors file '", file, "', tensor '",
                                d.name, "': ", info.shape_string(), " is too large");
        bytes = *product;
      }
      info.begin = offset;
      info.end = offset + bytes;
      offset = info.end;
      planned.push_back(std::move(info));
    }
    return planned;
  }

  /// "safetensors file 'F', tensor 'N'" for messages.
  std::string where(const TensorInfo& t) const {
    return zero::detail::concat("safetensors file '", path().string(), "', tensor '", t.name, "'");
  }

  /// Position of name among the declarations; CheckpointError if it was not declared. Data
  /// arrive in declaration order, so the tensor being written is looked at first (a search per
  /// write made a shard of many segments quadratic to write).
  std::size_t index_of(std::string_view name) const {
    if (current_ < tensors_.size() && tensors_[current_].name == name) return current_;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].name == name) return i;
    }
    raise<CheckpointError>("safetensors file '", path().string(), "': tensor '", name,
                           "' was not declared");
  }

  /// The tensor name, after checking that it is the one being written and that bytes more
  /// bytes fit into it. Zero-size tensors need no data and accept empty writes at any time.
  const TensorInfo& expect_current(std::string_view name, std::uint64_t bytes) {
    const std::size_t i = index_of(name);
    const TensorInfo& t = tensors_[i];
    if (t.bytes() == 0) {
      expect<CheckpointError>(bytes == 0, where(t), " has no elements but ", bytes,
                              " bytes were given");
      return t;
    }
    expect<CheckpointError>(i == current_, where(t), ": data must arrive in declaration order; ",
                            current_ < tensors_.size()
                                ? "'" + tensors_[current_].name + "' is being written"
                                : std::string("all tensors are complete"));
    const std::uint64_t written = file_.bytes_written() - data_start_ - t.begin;
    expect<CheckpointError>(bytes <= t.bytes() - written, where(t), ": ", bytes,
                            " more bytes would overflow its ", t.bytes(), " bytes (", written,
                            " already written)");
    return t;
  }

  /// Writes bytes and moves on past the tensors they complete.
  void append(const void* data, std::size_t bytes) {
    file_.write(data, bytes);
    skip_empty();
  }

  /// Advances current_ past complete tensors (including zero-size ones).
  void skip_empty() {
    const std::uint64_t data_written = file_.bytes_written() - data_start_;
    while (current_ < tensors_.size() && tensors_[current_].end <= data_written) ++current_;
  }

  std::vector<TensorInfo> tensors_;  // before file_: validated before the file is created
  AtomicFile file_;
  std::uint64_t data_start_ = 0;
  std::size_t current_ = 0;
};

}  // namespace zero::io
