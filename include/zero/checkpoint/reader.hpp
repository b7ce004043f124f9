#pragma once
// Reading a checkpoint, at any world size and any sharding: read(name, offset, out) fills any
// element range of a logical tensor by reading (pread) only the byte ranges of the segments
// that overlap it, never whole files.
//
// Opening checks the index (index.hpp) and that every shard file exists with exactly the size
// the index records (a truncated file is named at open, before any read); a file is opened by
// the first read that needs it, so each rank holds descriptors only for the shards it reads
// (a load at large world sizes stays under the descriptor limit), relative to the tag directory
// the index came from, so a save replacing the tag cannot mix its files into this read. Checksums:
// with Verify::touched_segments (the default) every segment a read touches is verified in full
// before the read returns, once per Reader (verified segments are remembered). A read that
// covers whole segments checksums the bytes it reads anyway, at no extra I/O; a read that
// covers part of a segment not yet verified reads the rest of it too, through a bounded staging
// buffer. That is the trade-off: ZeRO loads read whole segments almost always (a new sharding
// cuts at most two segments per rank and tensor), and in exchange no byte a caller gets has
// escaped its checksum. Verify::none trusts the storage and reads exactly the requested bytes.

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/checkpoint/comm_text.hpp>
#include <zero/checkpoint/crc32c.hpp>
#include <zero/checkpoint/index.hpp>
#include <zero/checkpoint/layout.hpp>
#include <zero/checkpoint/publish.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/io/element_conversion.hpp>
#include <zero/io/file.hpp>

namespace zero::checkpoint {

/// Which checksums a Reader checks.
enum class Verify {
  touched_segments,  ///< Every segment a read touches, in full, once per Reader.
  none,              ///< None: read exactly the requested bytes.
};

/// How a Reader reads.
struct ReaderOptions {
  Verify verify = Verify::touched_segments;
  /// Staging buffer for converting reads and for verifying the unrequested part of a segment;
  /// bounds a read's extra memory.
  std::size_t chunk_bytes = std::size_t{8} << 20;
};

namespace detail {
/// Throws CheckpointError naming <dir>/latest when the tag it names has no directory.
inline void expect_latest_tag_exists(const std::filesystem::path& dir, const std::string& tag) {
  std::error_code ec;
  expect<CheckpointError>(std::filesystem::is_directory(dir / tag, ec), "'",
                          (dir / latest_file_name).string(), "' names tag '", tag, "' but '",
                          (dir / tag).string(), "' does not exist");
}
}  // namespace detail

/// Read access to one checkpoint tag. Reads are const and may run from several threads at once.
class Reader {
 public:
  /// Opens <dir>/<tag>, or the tag <dir>/latest names when tag is empty; throws CheckpointError
  /// naming the directory, tag, file and tensor at fault.
  explicit Reader(const std::filesystem::path& dir, std::string_view tag = {},
                  ReaderOptions options = {})
      : options_(options) {
    options_.chunk_bytes = std::max<std::size_t>(options_.chunk_bytes, 64);
    if (tag.empty()) {
      tag_ = read_latest(dir);
      detail::expect_latest_tag_exists(dir, tag_);
    } else {
      validate_tag(tag);
      tag_ = std::string(tag);
    }
    path_ = dir / tag_;
    std::error_code ec;
    expect<CheckpointError>(std::filesystem::is_directory(path_, ec), "checkpoint '",
                            path_.string(), "' does not exist", available_tags(dir));
    // Every file is opened relative to the tag directory as it is now: a save replacing the tag
    // (or a move of it) while this Reader lives cannot mix its files with the index read here.
    dir_ = io::open_directory(path_);
    const auto index_path = path_ / index_file_name;
    const std::string index_name(index_file_name);  // fstatat needs a terminated name
    struct stat index_info {};
    expect<CheckpointError>(::fstatat(dir_.get(), index_name.c_str(), &index_info, 0) == 0 &&
                                S_ISREG(index_info.st_mode),
                            "checkpoint '", path_.string(), "' has no ", index_file_name,
                            " (not a complete zero checkpoint)");
    const io::ReadFile index_file(dir_, index_name, index_path);
    std::string text(static_cast<std::size_t>(index_file.size()), '\0');
    index_file.read_at(0, text.data(), text.size(), "the checkpoint index");
    index_crc32c_ = crc32c(std::as_bytes(std::span<const char>(text)));
    index_ = parse_index(text, "checkpoint index '" + index_path.string() + "'");
    for (std::size_t i = 0; i < index_.tensors.size(); ++i) {
      by_name_.emplace(index_.tensors[i].name, i);
      first_segment_.push_back(segment_total_);
      segment_total_ += index_.tensors[i].segments.size();
    }
    state_ = std::make_unique<State>();
    state_->verified = std::make_unique<std::atomic<bool>[]>(segment_total_);
    check_files();
  }

  /// The tag directory.
  const std::filesystem::path& path() const { return path_; }
  /// The tag opened.
  const std::string& tag() const { return tag_; }
  /// The parsed index.
  const Index& index() const { return index_; }
  /// The CRC32C of the index file as read: two Readers of one tag with equal values read the
  /// same save (load compares them across ranks).
  std::uint32_t index_crc32c() const { return index_crc32c_; }
  /// The engine's state as saved.
  const nlohmann::json& engine_state() const { return index_.engine; }
  /// The state saving rank r passed in SaveOptions::rank_state (null when none was saved); a
  /// loader at the same world size resumes per-rank RNG or data positions from it.
  const nlohmann::json& rank_state(int r) const {
    expect<CheckpointError>(r >= 0 && r < index_.world_size, "checkpoint '", path_.string(),
                            "' was saved by ", index_.world_size, " ranks; there is no rank ", r);
    return index_.rank_states.empty() ? null_ : index_.rank_states[static_cast<std::size_t>(r)];
  }
  /// The number of ranks that saved the checkpoint.
  int saved_world_size() const { return index_.world_size; }
  /// True when the checkpoint holds tensor name.
  bool contains(std::string_view name) const { return by_name_.find(name) != by_name_.end(); }
  /// The names of all tensors, in save order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& t : index_.tensors) out.push_back(t.name);
    return out;
  }

  /// The record of tensor name; CheckpointError naming the checkpoint and the tensor otherwise.
  const TensorRecord& tensor(std::string_view name) const {
    const auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      std::string hint;
      for (const auto& t : index_.tensors) {
        if (t.name.ends_with(name) || name.ends_with(t.name)) {
          hint = "; did you mean '" + t.name + "'?";
          break;
        }
      }
      raise<CheckpointError>("checkpoint '", path_.string(), "' has no tensor '", name,
                             "' (it has ", index_.tensors.size(), " tensors", hint, ")");
    }
    return index_.tensors[it->second];
  }

  /// Fills out with elements [offset, offset + out.size()) of the flattened tensor name,
  /// converting from the stored dtype when rule is DTypeRule::convert (f32 <-> bf16/f16/f64).
  template <class T>
  void read(std::string_view name, std::int64_t offset, std::span<T> out,
            io::DTypeRule rule = io::DTypeRule::exact) const {
    static_assert(!std::is_const_v<T>, "read writes into out");
    const TensorRecord& t = tensor(name);
    const auto count = static_cast<std::int64_t>(out.size());
    expect<CheckpointError>(offset >= 0 && offset <= t.numel() && count <= t.numel() - offset,
                            where(t), ": element range ", element_range(offset, count),
                            " is out of bounds (the tensor has ", t.numel(), " elements)");
    constexpr DType want = dtype_of<T>;
    if (t.dtype != want) {
      expect<CheckpointError>(rule == io::DTypeRule::convert, where(t), ": stored as ",
                              name_of(t.dtype), " but ", name_of(want),
                              " was requested; read with DTypeRule::convert to convert");
      expect<CheckpointError>(io::can_convert(t.dtype, want), where(t), ": cannot convert ",
                              name_of(t.dtype), " to ", name_of(want));
    }
    if (count == 0) return;
    const std::int64_t end = offset + count;
    auto seg =
        std::upper_bound(t.segments.begin(), t.segments.end(), offset,
                         [](std::int64_t v, const SegmentRecord& s) { return v < s.offset; });
    --seg;  // the tiling guarantees a segment starts at or before offset
    for (; seg != t.segments.end() && seg->offset < end; ++seg) {
      const std::int64_t lo = std::max(offset, seg->offset), hi = std::min(end, seg->end());
      read_from_segment(t, static_cast<std::size_t>(seg - t.segments.begin()), lo, hi,
                        out.data() + (lo - offset));
    }
  }

  /// The whole tensor name, flat (see read for rule).
  template <class T>
  std::vector<T> read_all(std::string_view name, io::DTypeRule rule = io::DTypeRule::exact) const {
    std::vector<T> values(static_cast<std::size_t>(tensor(name).numel()));
    read(name, 0, std::span<T>(values), rule);
    return values;
  }

  /// Raw stored bytes [first_byte, first_byte + out.size()) of segment s of tensor t, without
  /// checksum verification (for streaming consumers that checksum themselves, like export).
  void read_segment_bytes(const TensorRecord& t, const SegmentRecord& s, std::uint64_t first_byte,
                          std::span<std::byte> out) const {
    const std::uint64_t length = s.byte_end - s.byte_begin;  // a sum past 2^64 would wrap
    expect<CheckpointError>(first_byte <= length && out.size() <= length - first_byte, where(t),
                            ": byte range outside its segment");
    file_of(s).read_at(s.byte_begin + first_byte, out.data(), out.size(), where(t));
  }

  /// Throws the checksum error for segment s of t unless computed matches its CRC32C.
  void expect_checksum(const TensorRecord& t, const SegmentRecord& s,
                       std::uint32_t computed) const {
    if (computed == s.crc32c) return;
    raise<CheckpointError>("checkpoint '", path_.string(), "': shard file '",
                           index_.files[static_cast<std::size_t>(s.file)].name, "' bytes [",
                           s.byte_begin, ", ", s.byte_end, ") holding elements [", s.offset, ", ",
                           s.end(), ") of tensor '", t.name, "' fail their CRC32C check (index ",
                           s.crc32c, ", file ", computed, "): the file is corrupted");
  }

  /// The largest staging buffer a read has used (bytes).
  std::size_t peak_staging_bytes() const { return state_->peak_staging.load(); }
  /// Bytes read from shard files so far.
  std::uint64_t bytes_read() const { return state_->bytes_read.load(); }

 private:
  /// "checkpoint 'P', tensor 'N' (F32 [a, b])" for messages.
  std::string where(const TensorRecord& t) const {
    return zero::detail::concat("checkpoint '", path_.string(), "', tensor '", t.name, "' (",
                                t.describe(), ")");
  }

  /// ": it holds tags a, b" (or that there are none) for a missing tag directory.
  static std::string available_tags(const std::filesystem::path& dir) {
    const auto tags = list_tags(dir);
    if (tags.empty()) return " (no complete checkpoint in '" + dir.string() + "')";
    std::string s = " (complete tags there:";
    for (std::size_t i = 0; i < tags.size() && i < 8; ++i) s += " " + tags[i];
    return s + (tags.size() > 8 ? " ...)" : ")");
  }

  /// Checks that every shard file exists with the size the index records (a stat, no open:
  /// files are opened on first read, so a rank keeps descriptors only for the files it reads).
  void check_files() {
    state_->files = std::vector<std::optional<io::ReadFile>>(index_.files.size());
    state_->opened = std::make_unique<std::once_flag[]>(index_.files.size());
    for (const FileRecord& f : index_.files) {
      struct stat info {};
      if (::fstatat(dir_.get(), f.name.c_str(), &info, 0) != 0 || !S_ISREG(info.st_mode)) {
        raise<CheckpointError>("checkpoint '", path_.string(), "': shard file '", f.name,
                               "' (rank ", f.rank, ") is missing", first_tensor_in(f.name));
      }
      check_size(f, static_cast<std::uint64_t>(info.st_size));
    }
  }

  /// CheckpointError when shard file f has size bytes and the index records another.
  void check_size(const FileRecord& f, std::uint64_t size) const {
    expect<CheckpointError>(size == f.bytes, "checkpoint '", path_.string(), "': shard file '",
                            f.name, "' has ", size, " bytes but the index records ", f.bytes,
                            size < f.bytes ? " (truncated)" : " (modified)",
                            first_tensor_in(f.name));
  }

  /// "; it holds segments of tensor 'X' ..." for file messages.
  std::string first_tensor_in(const std::string& file) const {
    for (const auto& t : index_.tensors) {
      for (const auto& s : t.segments) {
        if (index_.files[static_cast<std::size_t>(s.file)].name == file) {
          return "; it holds segments of tensor '" + t.name + "' and others";
        }
      }
    }
    return "";
  }

  /// The open shard file of s, opened by the first read that needs it (thread-safe), in the
  /// directory the index was read from: once a save has replaced the tag and removed the old
  /// files, the open fails with a CheckpointError instead of reading the new checkpoint's bytes.
  const io::ReadFile& file_of(const SegmentRecord& s) const {
    const auto i = static_cast<std::size_t>(s.file);
    std::call_once(state_->opened[i], [&] {
      const FileRecord& f = index_.files[i];
      try {
        state_->files[i].emplace(dir_, f.name, path_ / f.name);
      } catch (const IoError& e) {
        raise<CheckpointError>("checkpoint '", path_.string(), "': shard file '", f.name,
                               "' can no longer be opened (was the tag replaced or removed "
                               "while it was being read?): ",
                               e.what());
      }
      check_size(f, state_->files[i]->size());
    });
    return *state_->files[i];
  }

  /// A staging buffer of at most chunk_bytes, at least one element of elem bytes.
  std::vector<std::byte> staging(std::uint64_t wanted_bytes, std::size_t elem) const {
    std::size_t bytes = static_cast<std::size_t>(
        std::min<std::uint64_t>(wanted_bytes, options_.chunk_bytes / elem * elem));
    bytes = std::max(bytes, elem);
    std::size_t peak = state_->peak_staging.load();
    while (bytes > peak && !state_->peak_staging.compare_exchange_weak(peak, bytes)) {
    }
    return std::vector<std::byte>(bytes);
  }

  /// Copies elements [lo, hi) (tensor coordinates, inside segment si) into dst, verifying the
  /// segment first if it has not been.
  template <class T>
  void read_from_segment(const TensorRecord& t, std::size_t si, std::int64_t lo, std::int64_t hi,
                         T* dst) const {
    const SegmentRecord& s = t.segments[si];
    const std::size_t elem = size_of(t.dtype);
    const auto ti = static_cast<std::size_t>(&t - index_.tensors.data());
    std::atomic<bool>& verified = state_->verified[first_segment_[ti] + si];
    const bool verify = options_.verify == Verify::touched_segments && !verified.load();
    const bool same = t.dtype == dtype_of<T>;
    const io::ReadFile& file = file_of(s);
    if (same && (!verify || (lo == s.offset && hi == s.end()))) {
      // Straight into the caller's memory, a chunk at a time: each chunk is checksummed while
      // it is still in cache, and the kernel is asked to read the next one ahead meanwhile.
      const auto bytes = static_cast<std::size_t>(hi - lo) * elem;
      const std::uint64_t start = s.byte_begin + static_cast<std::uint64_t>(lo - s.offset) * elem;
      const std::size_t chunk = std::max(options_.chunk_bytes / elem * elem, elem);
      auto* out = reinterpret_cast<std::byte*>(dst);
      std::uint32_t crc = 0;
      for (std::size_t done = 0; done < bytes; done += chunk) {
        const std::size_t n = std::min(chunk, bytes - done);
        if (done + n < bytes) {
          ::posix_fadvise(file.fd(), static_cast<::off_t>(start + done + n),
                          static_cast<::off_t>(std::min(chunk, bytes - done - n)),
                          POSIX_FADV_WILLNEED);
        }
        file.read_at(start + done, out + done, n, where(t));
        if (verify) crc = crc32c(std::span<const std::byte>(out + done, n), crc);
      }
      state_->bytes_read += bytes;
      if (verify) {
        expect_checksum(t, s, crc);
        verified.store(true);
      }
      return;
    }
    // Through staging: the whole segment when verifying, else only [lo, hi).
    const std::int64_t first = verify ? s.offset : lo, last = verify ? s.end() : hi;
    auto buffer = staging(static_cast<std::uint64_t>(last - first) * elem, elem);
    const auto chunk = static_cast<std::int64_t>(buffer.size() / elem);
    std::uint32_t crc = 0;
    for (std::int64_t c0 = first; c0 < last; c0 += chunk) {
      const std::int64_t c1 = std::min(last, c0 + chunk);
      const auto bytes = static_cast<std::size_t>(c1 - c0) * elem;
      file.read_at(s.byte_begin + static_cast<std::uint64_t>(c0 - s.offset) * elem, buffer.data(),
                   bytes, where(t));
      state_->bytes_read += bytes;
      if (verify) crc = crc32c(std::span<const std::byte>(buffer.data(), bytes), crc);
      const std::int64_t a = std::max(c0, lo), b = std::min(c1, hi);
      if (a < b) {
        io::convert_elements(t.dtype, buffer.data() + static_cast<std::size_t>(a - c0) * elem,
                             dtype_of<T>, dst + (a - lo), static_cast<std::size_t>(b - a));
      }
    }
    if (verify) {
      expect_checksum(t, s, crc);
      verified.store(true);
    }
  }

  ReaderOptions options_;
  nlohmann::json null_;  // what rank_state returns for a checkpoint without rank states
  std::string tag_;
  std::filesystem::path path_;
  io::FileDescriptor dir_;  // the tag directory, every file opened relative to it
  Index index_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::vector<std::size_t> first_segment_;  // per tensor: its first slot in verified_
  std::size_t segment_total_ = 0;
  std::uint32_t index_crc32c_ = 0;
  /// What reads update (behind a pointer so a Reader stays movable).
  struct State {
    std::unique_ptr<std::atomic<bool>[]> verified;  // per segment, in tensor order
    std::atomic<std::size_t> peak_staging{0};
    std::atomic<std::uint64_t> bytes_read{0};
    std::vector<std::optional<io::ReadFile>> files;  // per index file, opened on first use
    std::unique_ptr<std::once_flag[]> opened;        // guards each file's opening
  };
  std::unique_ptr<State> state_;
};

/// Opens the same tag on every rank (a collective): rank 0 resolves tag (or `latest` when it is
/// empty) and broadcasts it, so a save that replaces `latest` meanwhile cannot make ranks load
/// different checkpoints; and the ranks compare the CRC32C of the index each read, so neither
/// can a save of that same tag between their opens, nor per-node copies of dir that differ.
/// Throws on every rank if rank 0 cannot resolve the tag, any rank cannot open it (a rank that
/// failed throws its own error, the others CheckpointError naming the first such rank) or the
/// ranks read different indexes (CheckpointError naming the first rank that differs from 0).
template <CheckpointComm Comm>
Reader load(Comm& comm, const std::filesystem::path& dir, std::string_view tag = {},
            ReaderOptions options = {}) {
  std::string resolved;
  if (comm.rank() == 0) {
    try {
      const std::string t = tag.empty() ? read_latest(dir) : std::string(tag);
      restore_replaced_tag(dir, t);  // a save interrupted inside its two-rename fallback
      if (tag.empty()) detail::expect_latest_tag_exists(dir, t);
      resolved = "+" + t;
    } catch (const std::exception& e) {
      resolved = std::string("-") + e.what();
    }
  }
  resolved = parallel::broadcast_text(comm, resolved, 0);
  if (resolved.front() != '+') throw CheckpointError(resolved.substr(1));
  // Each rank opens the checkpoint itself, and one may fail alone (a file system that shows it
  // the new tag late, a directory local to its node): the ranks agree, so every rank throws the
  // first failure instead of the others going on to wait for it in the load's next collective.
  std::optional<Reader> reader;
  std::string failure;
  std::exception_ptr thrown;
  try {
    reader.emplace(dir, resolved.substr(1), options);
  } catch (const std::exception& e) {
    failure = e.what();
    thrown = std::current_exception();
  }
  // Each rank's outcome: "+" and the CRC32C of the index it read, or "-" and its failure.
  const std::vector<std::string> outcomes = parallel::all_gather_text(
      comm, thrown ? "-" + failure : "+" + std::to_string(reader->index_crc32c()));
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].front() == '+') continue;
    if (thrown) std::rethrow_exception(thrown);  // this rank's own failure, as it was
    throw CheckpointError(zero::detail::concat("checkpoint '", resolved.substr(1),
                                               "' could not be opened on rank ", r, ": ",
                                               outcomes[r].substr(1)));
  }
  for (std::size_t r = 1; r < outcomes.size(); ++r) {
    expect<CheckpointError>(
        outcomes[r] == outcomes[0], "checkpoint '", resolved.substr(1), "': rank ", r,
        " read another index than rank 0 (a save of the same tag ran while the ranks opened "
        "it, or the ranks see different copies of '",
        dir.string(), "'); nothing was loaded, load again");
  }
  return std::move(*reader);
}

}  // namespace zero::checkpoint
