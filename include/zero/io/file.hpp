#pragma once
// POSIX file helpers shared by zero's readers and writers.
// - ReadFile reads at absolute offsets with pread: there is no shared file position, so several
//   threads may read disjoint slices of one open file at once (each rank reads only its shard).
// - MappedFile maps a whole file read-only, for token files that are indexed at random.
// - AtomicFile writes under a temporary name and renames on commit, after fsync of the file and
//   of its directory, so a crash leaves either the old file or the complete new one, never a
//   truncated file under the final name.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include <zero/core/error.hpp>

namespace zero::io {

namespace detail {
/// The text of errno value code.
inline std::string errno_text(int code) {
  return std::strerror(code);
}
}  // namespace detail

/// An open file descriptor that closes itself.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  /// Takes ownership of fd (-1 for none).
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~FileDescriptor() { reset(); }

  /// The raw descriptor (-1 when closed).
  int get() const { return fd_; }
  /// True while a descriptor is held.
  explicit operator bool() const { return fd_ >= 0; }
  /// Closes the descriptor; errors from close are ignored because nothing was written through it
  /// or the writer already checked them (AtomicFile closes explicitly before rename).
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Gives up ownership and returns the descriptor.
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

/// fsync of a directory, so the entries created or renamed in it are durable. File systems that
/// cannot sync a directory (EINVAL) are accepted; other failures throw IoError naming it.
inline void sync_directory(const std::filesystem::path& dir) {
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) {
    const int code = errno;
    raise<IoError>("cannot open directory '", dir.string(),
                   "' to sync it: ", detail::errno_text(code));
  }
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    const int code = errno;
    raise<IoError>("fsync of directory '", dir.string(), "' failed: ", detail::errno_text(code));
  }
}

/// Opens the directory path read-only (for openat and fstatat relative to it); IoError naming
/// it and the system's reason.
inline FileDescriptor open_directory(const std::filesystem::path& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) {
    const int code = errno;
    raise<IoError>("cannot open directory '", path.string(), "': ", detail::errno_text(code));
  }
  return fd;
}

/// A regular file opened read-only, read at absolute offsets.
class ReadFile {
 public:
  /// Opens path; throws IoError naming the file and the system's reason.
  explicit ReadFile(std::filesystem::path path) : ReadFile(AT_FDCWD, std::move(path)) {}
  /// Opens the entry name of the open directory dir (openat: the directory, not whatever a
  /// path names now, so a rename or replacement of the directory does not redirect the open);
  /// shown is the path messages name.
  ReadFile(const FileDescriptor& dir, const std::string& name, std::filesystem::path shown)
      : ReadFile(dir.get(), std::move(shown), name.c_str()) {}

  /// The file's path as opened.
  const std::filesystem::path& path() const { return path_; }
  /// The file's size in bytes when it was opened.
  std::uint64_t size() const { return size_; }
  /// The descriptor, for callers that map the file.
  int fd() const { return fd_.get(); }

  /// Reads exactly bytes bytes at offset into out; a short file or a failed read is an IoError
  /// naming the file, the range and what (the caller's description of the data).
  void read_at(std::uint64_t offset, void* out, std::size_t bytes, std::string_view what) const {
    auto* dst = static_cast<std::byte*>(out);
    std::size_t done = 0;
    while (done < bytes) {
      const ::ssize_t got =
          ::pread(fd_.get(), dst + done, bytes - done, static_cast<::off_t>(offset + done));
      if (got < 0) {
        const int code = errno;
        if (code == EINTR) continue;
        raise<IoError>("reading ", what, " from '", path_.string(), "' at byte ", offset + done,
                       " failed: ", detail::errno_text(code));
      }
      expect<IoError>(got > 0, "reading ", what, " from '", path_.string(), "': the file ends at ",
                      offset + done, " bytes but bytes [", offset, ", ", offset + bytes,
                      ") were expected (truncated?)");
      done += static_cast<std::size_t>(got);
    }
  }

 private:
  /// Opens entry (relative to dir_fd, or the working directory for AT_FDCWD); path is shown.
  ReadFile(int dir_fd, std::filesystem::path path, const char* entry = nullptr)
      : path_(std::move(path)) {
    fd_ = FileDescriptor(::openat(dir_fd, entry ? entry : path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd_) {
      const int code = errno;
      raise<IoError>("cannot open '", path_.string(), "' for reading: ", detail::errno_text(code));
    }
    struct stat info {};
    if (::fstat(fd_.get(), &info) != 0) {
      const int code = errno;
      raise<IoError>("cannot stat '", path_.string(), "': ", detail::errno_text(code));
    }
    expect<IoError>(S_ISREG(info.st_mode), "'", path_.string(), "' is not a regular file");
    size_ = static_cast<std::uint64_t>(info.st_size);
  }

  std::filesystem::path path_;
  FileDescriptor fd_;
  std::uint64_t size_ = 0;
};

/// A whole file mapped read-only into memory; an empty file maps to no memory.
class MappedFile {
 public:
  /// Maps path; throws IoError naming the file.
  explicit MappedFile(const std::filesystem::path& path) : file_(path) {
    size_ = file_.size();
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, file_.fd(), 0);
    if (p == MAP_FAILED) {
      const int code = errno;
      raise<IoError>("cannot map '", path.string(), "' (", size_,
                     " bytes): ", detail::errno_text(code));
    }
    data_ = static_cast<const std::byte*>(p);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept
      : file_(std::move(other.file_)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  }

  /// The mapped bytes (nullptr for an empty file).
  const std::byte* data() const { return data_; }
  /// The file's size in bytes.
  std::uint64_t size() const { return size_; }
  /// The file's path.
  const std::filesystem::path& path() const { return file_.path(); }

 private:
  ReadFile file_;
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

/// Writes a file under a temporary name in the target's directory; commit() makes it durable
/// and renames it into place. Destroying an uncommitted AtomicFile removes the temporary file.
class AtomicFile {
 public:
  /// Creates a fresh temporary file next to final_path; throws IoError naming both.
  explicit AtomicFile(std::filesystem::path final_path) : final_path_(std::move(final_path)) {
    // pid and thread keep concurrent writers of one target apart; O_EXCL catches the rest.
    // Built with append: g++ 12 at -O3 warns falsely (-Wrestrict) on "literal" + std::string&&.
    std::string base = final_path_.string();
    base.append(".tmp.").append(std::to_string(::getpid())).append(".");
    base.append(std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
    for (int attempt = 0; attempt < 100 && !fd_; ++attempt) {
      std::string name = base;
      if (attempt > 0) name.append(".").append(std::to_string(attempt));
      temp_path_ = name;
      fd_ =
          FileDescriptor(::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (!fd_ && errno != EEXIST) break;
    }
    if (!fd_) {
      const int code = errno;
      raise<IoError>("cannot create temporary file '", temp_path_.string(), "' for '",
                     final_path_.string(), "': ", detail::errno_text(code));
    }
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_) {
      fd_.reset();
      ::unlink(temp_path_.c_str());
    }
  }

  /// The path the file gets on commit.
  const std::filesystem::path& final_path() const { return final_path_; }
  /// The temporary path written until commit.
  const std::filesystem::path& temp_path() const { return temp_path_; }
  /// Bytes written so far.
  std::uint64_t bytes_written() const { return written_; }

  /// Appends bytes bytes; throws IoError naming the final file.
  void write(const void* data, std::size_t bytes) {
    expect<IoError>(static_cast<bool>(fd_), "writing '", final_path_.string(),
                    "': the file was already committed");
    const auto* src = static_cast<const std::byte*>(data);
    std::size_t done = 0;
    while (done < bytes) {
      const ::ssize_t put = ::write(fd_.get(), src + done, bytes - done);
      if (put < 0) {
        const int code = errno;
        if (code == EINTR) continue;
        raise<IoError>("writing '", temp_path_.string(), "' (for '", final_path_.string(),
                       "') failed after ", written_ + done, " bytes: ", detail::errno_text(code));
      }
      done += static_cast<std::size_t>(put);
    }
    written_ += bytes;
  }

  /// Flushes the data to storage, renames the file into place and syncs the directory entry.
  void commit() {
    expect<IoError>(static_cast<bool>(fd_), "committing '", final_path_.string(),
                    "': the file was already committed");
    if (::fsync(fd_.get()) != 0) {
      const int code = errno;
      raise<IoError>("fsync of '", temp_path_.string(), "' failed: ", detail::errno_text(code));
    }
    // close can report a deferred write error (NFS); check it before the rename publishes.
    if (::close(fd_.release()) != 0) {
      const int code = errno;
      ::unlink(temp_path_.c_str());
      raise<IoError>("closing '", temp_path_.string(), "' failed: ", detail::errno_text(code));
    }
    if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) {
      const int code = errno;
      ::unlink(temp_path_.c_str());
      raise<IoError>("renaming '", temp_path_.string(), "' to '", final_path_.string(),
                     "' failed: ", detail::errno_text(code));
    }
    // The rename is only durable once the directory itself is synced: a failure throws (the
    // file is in place, but a crash may lose it), except on a file system that cannot sync a
    // directory (EINVAL).
    std::filesystem::path dir = final_path_.parent_path();
    if (dir.empty()) dir = ".";
    sync_directory(dir);
  }

 private:
  std::filesystem::path final_path_;
  std::filesystem::path temp_path_;
  FileDescriptor fd_;
  std::uint64_t written_ = 0;
};

}  // namespace zero::io
