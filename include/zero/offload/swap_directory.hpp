#pragma once
// SwapDirectory: the directory one NvmeSwapper keeps its files in,
// <nvme_path>/zero_swap/rank<r>/<tag>, locked for the swapper's life so that no other swapper
// (another engine of the same rank with the same nvme_path and tag) truncates its files, and
// cleared of the swap files a killed run left there before the preflight counts free space.
// release() removes the lock file and every empty level up to zero_swap/; the swapper removes
// its own files first.

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include <zero/core/error.hpp>
#include <zero/io/file.hpp>
#include <zero/offload/io_error.hpp>

namespace zero::offload {

/// The locked directory of one swapper's files (see the file comment).
class SwapDirectory {
 public:
  SwapDirectory() = default;
  /// Names <nvme_path>/zero_swap/rank<rank>/<tag>; nothing is created or locked yet.
  SwapDirectory(const std::filesystem::path& nvme_path, int rank, const std::string& tag)
      : path_(nvme_path / "zero_swap" / ("rank" + std::to_string(rank)) / tag), rank_(rank) {}

  /// The directory.
  const std::filesystem::path& path() const { return path_; }

  /// Creates the directory and takes <dir>/.lock exclusively (flock; let go by release), so two
  /// swappers (two engines of one rank with the same nvme_path and tag) never share files; a
  /// ConfigError when another swapper holds it, an NvmeIoError when the file system fails.
  // Other swappers (other ranks, other engines, other jobs on the same nvme_path) remove the
  // shared parents (zero_swap/, rank<r>/) when they find them empty on exit, which can undo a
  // create_directories before the lock file lands in path_; once the lock file is there path_
  // is not empty and stays. So an ENOENT here is retried.
  void lock() {
    for (int attempt = 1;; ++attempt) {
      std::error_code ec;
      std::filesystem::create_directories(path_, ec);
      const bool raced = ec == std::errc::no_such_file_or_directory;
      if (ec && !raced) {
        throw NvmeIoError("creating directory", path_.string(), 0, 0, ec.value(),
                          errno_reason(ec.value()));
      }
      if (!raced && lock_directory()) return;
      if (attempt == 100) {
        throw NvmeIoError("creating directory", path_.string(), 0, 0, ENOENT,
                          "removed again by another swapper 100 times in a row");
      }
    }
  }
  /// Removes the swap files (group<n>.swp) a run that did not close its swapper (killed, out
  /// of memory) left in the directory: after lock(), this swapper holds its lock, so nobody else
  /// uses them, and their space is free again before the preflight counts it.
  void remove_stale_files() {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(path_, ec)) {
      const std::string name = entry.path().filename().string();
      const bool swap_file = name.starts_with("group") && name.ends_with(".swp") &&
                             name.size() > 9 &&
                             name.find_first_not_of("0123456789", 5) == name.size() - 4;
      if (!swap_file) continue;
      std::error_code removed;
      if (!std::filesystem::remove(entry.path(), removed) && removed) {
        throw NvmeIoError("removing the stale swap file", entry.path().string(), 0, 0,
                          removed.value(), errno_reason(removed.value()));
      }
    }
  }

  /// Removes the lock file (while still holding it: nobody else uses it), lets go of the lock,
  /// then removes <tag>/, rank<r>/ and zero_swap/ where nothing else is left in them.
  void release() noexcept {
    std::error_code ec;
    if (lock_) std::filesystem::remove(path_ / ".lock", ec);
    lock_ = io::FileDescriptor();
    auto d = path_;
    for (int up = 0; up < 3 && !d.empty(); ++up, d = d.parent_path())
      if (!std::filesystem::remove(d, ec)) break;
  }

 private:
  // Takes path_'s lock; false when path_ vanished before the lock file was created, or the lock
  // file was removed (by the swapper closing that held it) before the lock was taken.
  bool lock_directory() {
    const auto path = path_ / ".lock";
    lock_ = io::FileDescriptor(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!lock_) {
      const int code = errno;
      if (code == ENOENT) return false;
      throw NvmeIoError("creating", path.string(), 0, 0, code, errno_reason(code));
    }
    if (::flock(lock_.get(), LOCK_EX | LOCK_NB) != 0) {
      const int code = errno;
      lock_ = io::FileDescriptor();
      // Only EWOULDBLOCK means another holder; ENOLCK (NFS without a lock daemon) and the like
      // are the file system's answer, not a second swapper.
      if (code != EWOULDBLOCK) {
        throw NvmeIoError("locking", path.string(), 0, 0, code, errno_reason(code));
      }
      raise<ConfigError>("NVMe offload: '", path_.string(), "' is in use by another swapper (",
                         "another engine of rank ", rank_, " with the same nvme_path?); ",
                         "give each engine its own nvme_path");
    }
    // A swapper closing removes .lock while it still holds it, then lets go: a lock taken on
    // the file it removed guards nothing (a third swapper creates a new .lock and takes that
    // one too). Only a lock on the file .lock names now counts; otherwise try again.
    struct stat held {
    }, named{};
    if (::fstat(lock_.get(), &held) != 0 || ::stat(path.c_str(), &named) != 0 ||
        held.st_nlink == 0 || held.st_ino != named.st_ino || held.st_dev != named.st_dev) {
      lock_ = io::FileDescriptor();
      return false;
    }
    return true;
  }

  std::filesystem::path path_;
  int rank_ = 0;
  io::FileDescriptor lock_;  // <dir>/.lock, held with flock until release
};

}  // namespace zero::offload
