#pragma once
// Consolidating a sharded checkpoint into one safetensors file, streamed with bounded memory.
// Every size is known from the index, so the header is written first; then each tensor's
// segments are read in order (they tile it) in chunks of at most chunk_bytes of stored data,
// checksummed as they stream (each segment is read exactly once and verified when its last
// chunk is in), converted to the output dtype if asked, and appended. Memory: one staging
// buffer of chunk_bytes plus, when converting, one output buffer of the converted chunk
// (chunk_bytes / stored size * output size): at most 2 x chunk_bytes for f32 -> bf16 or
// f32 -> f32, never a whole tensor. A checksum failure aborts before the file is committed, so
// no output file appears with unverified bytes in it (AtomicFile: temporary name until commit).
//
// Transposed tensors (ExportOptions::transpose, e.g. io::gpt2::is_conv1d_weight for Hugging
// Face's GPT-2 Conv1D layout): a stored [R, C] tensor is written as [C, R], a block of output
// rows (stored columns [c0, c1)) at a time, read as R row ranges through Reader::read (which
// verifies every touched segment once under the Reader's Verify mode, so those segments may be
// read up to twice). Memory: two
// blocks of R x (c1 - c0) output elements, each at most chunk_bytes (one stored column at least),
// plus the Reader's staging buffer (ReaderOptions::chunk_bytes) when converting or verifying.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <zero/checkpoint/crc32c.hpp>
#include <zero/checkpoint/index.hpp>
#include <zero/checkpoint/reader.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/io/element_conversion.hpp>
#include <zero/io/safetensors_writer.hpp>

namespace zero::checkpoint {

/// Maps a checkpoint tensor name to the name it gets in the exported file.
using NameMapping = std::function<std::string(std::string_view)>;

/// Selects the 2-D tensors that are written transposed.
using TransposePredicate = std::function<bool(std::string_view)>;

/// The leading rows (of dimension 0) of a tensor, by checkpoint name, to write; nullopt: all.
using RowLimit = std::function<std::optional<std::int64_t>(std::string_view)>;

/// How export_safetensors streams.
struct ExportOptions {
  std::size_t chunk_bytes = std::size_t{64} << 20;  ///< Stored bytes read per step.
  bool verify = true;                               ///< Check every segment's CRC32C.
  TransposePredicate transpose = {};  ///< 2-D tensors (by checkpoint name) written as [C, R].
  /// Tensors written without their last rows: a token embedding padded past the vocabulary for
  /// tensor parallelism (GPT-2's 50257 tokens stored as 50258 rows) keeps the vocabulary's rows,
  /// the shape Hugging Face and load_gpt2_weights expect. The rows dropped are still read and
  /// checksummed.
  RowLimit leading_rows = {};
};

/// What export_safetensors wrote.
struct ExportResult {
  std::uint64_t bytes_written = 0;    ///< Size of the output file.
  std::size_t tensors = 0;            ///< Tensors written.
  std::size_t peak_buffer_bytes = 0;  ///< Largest staging + conversion buffers held at once.
};

namespace detail {
/// Writes stored [R, C] tensor t as declaration d ([C, R], element type T) to writer, a block
/// of output rows at a time; returns the bytes of the two blocks it held.
template <class T>
std::size_t export_transposed(const Reader& reader, const TensorRecord& t, const io::TensorDecl& d,
                              io::SafetensorsWriter& writer, std::size_t chunk_bytes) {
  const auto rows = static_cast<std::size_t>(t.shape[0]),
             cols = static_cast<std::size_t>(t.shape[1]);
  if (rows == 0 || cols == 0) return 0;
  const std::size_t width = std::clamp<std::size_t>(chunk_bytes / sizeof(T) / rows, 1, cols);
  std::vector<T> stored(rows * width), transposed(rows * width);
  const io::DTypeRule rule = io::DTypeRule::convert;
  for (std::size_t c0 = 0; c0 < cols; c0 += width) {
    const std::size_t w = std::min(width, cols - c0);
    for (std::size_t r = 0; r < rows; ++r) {
      reader.read(t.name, static_cast<std::int64_t>(r * cols + c0),
                  std::span<T>(stored.data() + r * w, w), rule);
    }
    for (std::size_t j = 0; j < w; ++j) {
      for (std::size_t r = 0; r < rows; ++r) transposed[j * rows + r] = stored[r * w + j];
    }
    writer.write_bytes(d.name, std::as_bytes(std::span<const T>(transposed.data(), w * rows)));
  }
  return 2 * rows * width * sizeof(T) + reader.peak_staging_bytes();
}
}  // namespace detail

/// Writes tensors names (all when empty, in save order) of reader into one safetensors file at
/// out_path, floating tensors converted to dtype (integer tensors keep theirs), named by
/// mapping (identity when empty). Memory is bounded as the file comment says. Throws
/// CheckpointError for a missing tensor, a duplicate output name or a checksum failure (then
/// no file is created).
inline ExportResult export_safetensors(const Reader& reader, const std::vector<std::string>& names,
                                       const std::filesystem::path& out_path, DType dtype,
                                       const NameMapping& mapping = {},
                                       const ExportOptions& options = {}) {
  std::vector<const TensorRecord*> records;
  for (const std::string& name : names.empty() ? reader.names() : names) {
    records.push_back(&reader.tensor(name));
  }
  std::vector<io::TensorDecl> decls;
  // Whether each tensor is written transposed: by options.transpose, never by comparing shapes
  // (a square [C, C] weight, GPT-2's attn.c_proj, has the same shape either way).
  std::vector<char> transposed;
  std::vector<std::int64_t> kept;  // the leading elements of each tensor written
  std::set<std::string> outputs;
  for (const TensorRecord* t : records) {
    std::string out_name = mapping ? mapping(t->name) : t->name;
    expect<CheckpointError>(outputs.insert(out_name).second, "exporting '", out_path.string(),
                            "': tensor '", t->name, "' maps to '", out_name,
                            "', which another tensor already maps to");
    const DType out_dtype = is_floating(t->dtype) ? dtype : t->dtype;
    std::vector<std::int64_t> shape = t->shape;
    transposed.push_back(options.transpose && options.transpose(t->name) ? 1 : 0);
    std::int64_t keep = t->numel();
    if (const auto rows = options.leading_rows ? options.leading_rows(t->name) : std::nullopt) {
      expect<CheckpointError>(
          !shape.empty() && *rows >= 1 && *rows <= shape[0] && !transposed.back(), "exporting '",
          out_path.string(), "': tensor '", t->name, "' is ", t->describe(),
          "; cannot keep its first ", *rows, " rows (1 to its first extent, and not transposed)");
      keep = shape[0] == 0 ? 0 : t->numel() / shape[0] * *rows;
      shape[0] = *rows;
    }
    kept.push_back(keep);
    if (transposed.back()) {
      expect<CheckpointError>(shape.size() == 2, "exporting '", out_path.string(), "': tensor '",
                              t->name, "' is ", t->describe(), "; only 2-D tensors transpose");
      std::swap(shape[0], shape[1]);
    }
    decls.emplace_back(std::move(out_name), out_dtype, std::move(shape));
  }
  io::SafetensorsWriter writer(out_path, decls,
                               {{"format", "pt"}, {"source", reader.path().string()}});

  const std::size_t chunk_bytes = std::max<std::size_t>(options.chunk_bytes, 64);
  ExportResult result;
  std::vector<std::byte> staging, converted;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TensorRecord& t = *records[i];
    const io::TensorDecl& d = decls[i];
    if (transposed[i]) {
      visit_dtype(d.dtype, [&](auto tag) {
        const std::size_t held =
            detail::export_transposed<decltype(tag)>(reader, t, d, writer, chunk_bytes);
        result.peak_buffer_bytes = std::max(result.peak_buffer_bytes, held);
      });
      ++result.tensors;
      continue;
    }
    const std::size_t in_elem = size_of(t.dtype), out_elem = size_of(d.dtype);
    const std::size_t chunk_elems = std::max<std::size_t>(chunk_bytes / in_elem, 1);
    for (const SegmentRecord& s : t.segments) {
      const auto count = static_cast<std::size_t>(s.count);
      const std::size_t step = std::min(count, chunk_elems);
      // Grown to the largest chunk needed so far, never past chunk_bytes (one element minimum).
      if (staging.size() < step * in_elem) staging.resize(step * in_elem);
      if (d.dtype != t.dtype && converted.size() < step * out_elem) {
        converted.resize(step * out_elem);
      }
      result.peak_buffer_bytes =
          std::max(result.peak_buffer_bytes, staging.size() + converted.size());
      std::uint32_t crc = 0;
      for (std::size_t done = 0; done < count; done += step) {
        const std::size_t n = std::min(step, count - done);
        const std::span<std::byte> raw(staging.data(), n * in_elem);
        reader.read_segment_bytes(t, s, done * in_elem, raw);
        if (options.verify) crc = crc32c(raw, crc);
        // The elements of this chunk inside the rows written (segments tile the tensor in order).
        const std::int64_t first = s.offset + static_cast<std::int64_t>(done);
        const auto w = static_cast<std::size_t>(
            std::clamp<std::int64_t>(kept[i] - first, 0, static_cast<std::int64_t>(n)));
        if (w == 0) continue;
        if (d.dtype == t.dtype) {
          writer.write_bytes(d.name, raw.first(w * in_elem));
        } else {
          io::convert_elements(t.dtype, raw.data(), d.dtype, converted.data(), w);
          writer.write_bytes(d.name, std::span<const std::byte>(converted.data(), w * out_elem));
        }
      }
      if (options.verify) reader.expect_checksum(t, s, crc);
    }
    ++result.tensors;
  }
  writer.commit();
  std::error_code ec;
  result.bytes_written = std::filesystem::file_size(out_path, ec);
  return result;
}

}  // namespace zero::checkpoint
