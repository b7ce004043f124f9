#pragma once
// AlignedBuffer: an owning, zero-filled host allocation whose address and size are multiples of
// an alignment, as O_DIRECT requires of every buffer it transfers (the file system's logical
// block size, probed by zero/offload/direct_io.hpp). Optionally locked in RAM (mlock) so the
// kernel never pages it out mid-transfer; a CUDA engine may additionally cudaHostRegister data()
// to make device copies from it asynchronous.

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <span>
#include <utility>

#include <zero/core/error.hpp>

namespace zero::offload {

/// Owning host memory aligned for direct I/O; move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  /// Allocates bytes rounded up to a multiple of alignment (a power of two, at least 512), zero
  /// filled; with lock, tries to mlock it (locked() says whether that worked: RLIMIT_MEMLOCK).
  AlignedBuffer(std::size_t bytes, std::size_t alignment, bool lock = false)
      : alignment_(alignment) {
    expect<Error>(alignment >= 512 && (alignment & (alignment - 1)) == 0,
                  "AlignedBuffer: alignment ", alignment, " must be a power of two >= 512");
    size_ = (bytes + alignment - 1) / alignment * alignment;
    if (size_ == 0) return;
    data_ = static_cast<std::byte*>(std::aligned_alloc(alignment, size_));
    expect<OutOfMemoryError>(data_ != nullptr, "AlignedBuffer: could not allocate ", size_,
                             " bytes aligned to ", alignment,
                             " for NVMe swap buffers; lower offload_*.buffer_count or "
                             "zero_optimization.sub_group_size");
    std::memset(data_, 0, size_);  // also touches every page before any transfer uses it
    if (lock) locked_ = ::mlock(data_, size_) == 0;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& other) noexcept { swap(other); }
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    AlignedBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~AlignedBuffer() {
    if (data_ == nullptr) return;
    if (locked_) ::munlock(data_, size_);
    std::free(data_);
  }

  /// The first byte (nullptr when empty).
  std::byte* data() { return data_; }
  /// The first byte (nullptr when empty).
  const std::byte* data() const { return data_; }
  /// Size in bytes: the requested size rounded up to the alignment.
  std::size_t size() const { return size_; }
  /// The alignment of data() and size().
  std::size_t alignment() const { return alignment_; }
  /// True when mlock succeeded.
  bool locked() const { return locked_; }
  /// The whole buffer as bytes.
  std::span<std::byte> bytes() { return {data_, size_}; }

 private:
  void swap(AlignedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(alignment_, other.alignment_);
    std::swap(locked_, other.locked_);
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = 4096;
  bool locked_ = false;
};

}  // namespace zero::offload
