#pragma once
// Direct I/O on a directory: whether its file system accepts O_DIRECT and with what alignment
// (the logical block size, which every O_DIRECT buffer address, file offset and length must be a
// multiple of). The alignment is asked of the kernel (statx STATX_DIOALIGN, Linux 6.1+) and
// otherwise found by trial writes of 512, 1024, ... 64 KiB bytes. Also names the file system
// type, so a message can say "tmpfs" instead of "EINVAL".

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <zero/core/error.hpp>
#include <zero/io/file.hpp>
#include <zero/offload/aligned_buffer.hpp>
#include <zero/offload/io_error.hpp>

namespace zero::offload {

/// What a directory's file system offers for direct I/O.
struct DirectIoSupport {
  bool supported = false;     ///< O_DIRECT open and an aligned write worked
  std::size_t alignment = 0;  ///< required alignment in bytes (0 when unsupported)
  std::string fs_type;        ///< "ext4", "xfs", "tmpfs", ... or "0x<magic>"
  std::string reason;         ///< why unsupported (empty when supported)
};

/// The file system type of path by name, from statfs's magic number.
inline std::string file_system_type(const std::filesystem::path& path) {
  struct statfs info {};
  if (::statfs(path.c_str(), &info) != 0) return "unknown";
  switch (static_cast<std::uint64_t>(info.f_type)) {
    case 0xEF53:
      return "ext4";  // ext2/3/4 share the magic
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x858458F6:
      return "ramfs";
    case 0x794C7630:
      return "overlayfs";
    case 0x6969:
      return "nfs";
    case 0xFF534D42:
      return "cifs";
    case 0x65735546:
      return "fuse";
    case 0xF2F52010:
      return "f2fs";
    case 0x2FC12FC1:
      return "zfs";
    default: {
      char text[32];
      std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(info.f_type));
      return text;
    }
  }
}

/// Opens (creating when create) path for reading and writing with O_DIRECT; throws NvmeIoError
/// naming the file and the reason.
inline io::FileDescriptor open_direct(const std::filesystem::path& path, bool create,
                                      bool direct = true) {
  int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0);
  if (direct) flags |= O_DIRECT;
  io::FileDescriptor fd(::open(path.c_str(), flags, 0600));
  if (!fd) {
    const int code = errno;
    throw NvmeIoError(direct ? "opening (O_DIRECT)" : "opening", path.string(), 0, 0, code,
                      errno_reason(code));
  }
  return fd;
}

/// Probes dir (which must exist) with a temporary file that is removed again.
inline DirectIoSupport probe_direct_io(const std::filesystem::path& dir) {
  DirectIoSupport out;
  out.fs_type = file_system_type(dir);
  const auto probe = dir / (".zero_direct_io_probe." + std::to_string(::getpid()));
  io::FileDescriptor fd(::open(probe.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0600));
  if (!fd) {
    const int code = errno;
    out.reason = zero::detail::concat("open with O_DIRECT failed: ", errno_reason(code));
    ::unlink(probe.c_str());
    return out;
  }
  struct RemoveProbe {  // also when a buffer allocation below throws
    const std::filesystem::path& path;
    io::FileDescriptor& fd;
    ~RemoveProbe() {
      fd.reset();
      ::unlink(path.c_str());
    }
  } remove_probe{probe, fd};
  std::size_t hint = 0;
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(fd.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN) != 0 && sx.stx_dio_offset_align != 0) {
    hint = std::max<std::size_t>(sx.stx_dio_mem_align, sx.stx_dio_offset_align);
  }
#endif
  int last_error = 0;
  for (std::size_t a = 512; a <= 65536; a *= 2) {
    if (hint != 0 && a < hint) continue;
    AlignedBuffer buf(a, a);
    if (::pwrite(fd.get(), buf.data(), a, static_cast<::off_t>(a)) == static_cast<::ssize_t>(a)) {
      out.supported = true;
      out.alignment = a;
      break;
    }
    last_error = errno;
  }
  if (!out.supported)
    out.reason =
        zero::detail::concat("an aligned O_DIRECT write failed: ", errno_reason(last_error));
  return out;
}

}  // namespace zero::offload
