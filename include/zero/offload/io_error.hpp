#pragma once
// NvmeIoError: a failed swap-file operation, naming the file, the byte range and the system's
// reason, so "disk full" or "I/O error on /nvme/zero_swap/rank3/optimizer/group12.swp at byte
// 4194304" reaches the user instead of a bare errno.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include <zero/core/error.hpp>

namespace zero::offload {

/// Which way a transfer moves data.
enum class IoOp : unsigned char { read, write };

/// "read" or "write".
constexpr const char* name_of(IoOp op) {
  return op == IoOp::read ? "read" : "write";
}

/// A swap-file operation failed: open, read, write, allocate. error_code() is the errno value
/// (0 for a short transfer, which has no errno).
class NvmeIoError : public IoError {
 public:
  /// Builds the message "<what> '<path>' at byte <offset> (<bytes> bytes) failed: <reason>".
  NvmeIoError(std::string_view what, std::string path, std::uint64_t offset, std::uint64_t bytes,
              int error_code, std::string_view reason)
      : IoError(zero::detail::concat("NVMe offload: ", what, " '", path, "' at byte ", offset, " (",
                                     bytes, " bytes) failed: ", reason)),
        path_(std::move(path)),
        offset_(offset),
        bytes_(bytes),
        error_code_(error_code) {}

  /// The file involved.
  const std::string& path() const { return path_; }
  /// The first byte of the failed range.
  std::uint64_t offset() const { return offset_; }
  /// The length of the failed range in bytes.
  std::uint64_t bytes() const { return bytes_; }
  /// The errno value (0 for a short transfer).
  int error_code() const { return error_code_; }

 private:
  std::string path_;
  std::uint64_t offset_;
  std::uint64_t bytes_;
  int error_code_;
};

/// The reason text for errno value code, with a hint for the errors a swap file typically meets.
inline std::string errno_reason(int code) {
  std::string text = zero::detail::concat(std::strerror(code), " (errno ", code, ")");
  if (code == ENOSPC || code == EDQUOT)
    text += "; free space on the device or point offload_*.nvme_path at a larger one";
  else if (code == EINVAL)
    text += "; O_DIRECT needs buffers, offsets and sizes aligned to the logical block size";
  else if (code == EIO)
    text += "; the device reported an I/O error (check dmesg and the drive's health)";
  return text;
}

/// The error for a transfer that moved fewer bytes than asked (no errno).
inline NvmeIoError short_transfer_error(IoOp op, std::string path, std::uint64_t offset,
                                        std::uint64_t bytes, std::uint64_t done) {
  return NvmeIoError(op == IoOp::read ? "reading" : "writing", std::move(path), offset, bytes, 0,
                     zero::detail::concat("short ", name_of(op), ": ", done, " of ", bytes,
                                          op == IoOp::read ? " bytes (the swap file is truncated?)"
                                                           : " bytes (the device is full?)"));
}

/// The error for a transfer that failed with errno code.
inline NvmeIoError errno_transfer_error(IoOp op, std::string path, std::uint64_t offset,
                                        std::uint64_t bytes, int code) {
  return NvmeIoError(op == IoOp::read ? "reading" : "writing", std::move(path), offset, bytes, code,
                     errno_reason(code));
}

}  // namespace zero::offload
