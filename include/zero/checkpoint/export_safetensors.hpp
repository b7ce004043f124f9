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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
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

/// How export_safetensors streams.
struct ExportOptions {
  std::size_t chunk_bytes = std::size_t{64} << 20;  ///< Stored bytes read per step.
  bool verify = true;                               ///< Check every segment's CRC32C.
};

/// What export_safetensors wrote.
struct ExportResult {
  std::uint64_t bytes_written = 0;    ///< Size of the output file.
  std::size_t tensors = 0;            ///< Tensors written.
  std::size_t peak_buffer_bytes = 0;  ///< Largest staging + conversion buffers held at once.
};

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
  std::set<std::string> outputs;
  for (const TensorRecord* t : records) {
    std::string out_name = mapping ? mapping(t->name) : t->name;
    expect<CheckpointError>(outputs.insert(out_name).second, "exporting '", out_path.string(),
                            "': tensor '", t->name, "' maps to '", out_name,
                            "', which another tensor already maps to");
    const DType out_dtype = is_floating(t->dtype) ? dtype : t->dtype;
    decls.emplace_back(std::move(out_name), out_dtype, t->shape);
  }
  io::SafetensorsWriter writer(out_path, decls,
                               {{"format", "pt"}, {"source", reader.path().string()}});

  const std::size_t chunk_bytes = std::max<std::size_t>(options.chunk_bytes, 64);
  ExportResult result;
  std::vector<std::byte> staging, converted;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TensorRecord& t = *records[i];
    const io::TensorDecl& d = decls[i];
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
        if (d.dtype == t.dtype) {
          writer.write_bytes(d.name, raw);
        } else {
          io::convert_elements(t.dtype, raw.data(), d.dtype, converted.data(), n);
          writer.write_bytes(d.name, std::span<const std::byte>(converted.data(), n * out_elem));
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
