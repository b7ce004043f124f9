#pragma once
// AlignedBuffer: an owning, zero-filled host allocation whose address and size are multiples of
// an alignment, as O_DIRECT requires of every buffer it transfers (the file system's logical
// block size, probed by zero/offload/direct_io.hpp). Optionally locked in RAM (mlock) so the
// kernel never pages it out mid-transfer; a CUDA engine may additionally cudaHostRegister data()
// to make device copies from it asynchronous.
//
// The address is at least page aligned, and a buffer of 2 MiB or more starts on a 2 MiB boundary
// with its whole 2 MiB pieces advised for transparent huge pages (MADV_HUGEPAGE; best effort).
// Why: an O_DIRECT request is a list of DMA segments, one per physically contiguous run of its
// pages. Over scattered 4 KiB pages a 1 MiB request is ~256 segments, at a device's
// max_segments (254 on virtio-blk), so the block layer cannot merge neighbouring requests (and
// may split one); over huge pages it is one or two segments and consecutive requests merge up to
// max_sectors_kb. Measured on a virtio disk, same files and engine, only the buffer changed:
// 1 MiB reads at queue depth 8 went from 257 device requests per 256 MiB (1.0 GB/s) to 72
// (2.8 GB/s). A sub-page start spans one more page per request, hence the page alignment even
// where the file system asks for only 512 bytes.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <span>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
    size_ = round_up(bytes, alignment);
    if (size_ == 0) return;
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t start =
        std::max({alignment, page, size_ >= huge_page_bytes ? huge_page_bytes : std::size_t{0}});
    data_ = static_cast<std::byte*>(std::aligned_alloc(start, round_up(size_, start)));
    expect<OutOfMemoryError>(data_ != nullptr, "AlignedBuffer: could not allocate ", size_,
                             " bytes aligned to ", start,
                             " for NVMe swap buffers; lower offload_*.buffer_count or make "
                             "the largest unit smaller");
    advise_huge_pages(data_, size_ / huge_page_bytes * huge_page_bytes);
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
  /// Sets the first bytes bytes (at most size()) to zero. From 1 MiB up with streaming stores
  /// on x86-64, which skip the cache: a swap buffer is larger than the cache anyway, and they
  /// zero it at twice memset's speed (45 against 20 GB/s measured), which is CPU time the I/O
  /// thread and the caller's update share.
  void zero(std::size_t bytes) {
    expect<Error>(bytes <= size_, "AlignedBuffer::zero: ", bytes, " bytes of a ", size_,
                  "-byte buffer");
    std::size_t done = 0;
#if defined(__SSE2__)
    if (bytes >= (std::size_t{1} << 20)) {
      const __m128i z = _mm_setzero_si128();
      for (; done + 64 <= bytes; done += 64) {  // data_ is page aligned
        auto* at = reinterpret_cast<__m128i*>(data_ + done);
        _mm_stream_si128(at, z);
        _mm_stream_si128(at + 1, z);
        _mm_stream_si128(at + 2, z);
        _mm_stream_si128(at + 3, z);
      }
      _mm_sfence();  // visible to other threads and to the device before any transfer
    }
#endif
    std::memset(data_ + done, 0, bytes - done);
  }

 private:
  void swap(AlignedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(alignment_, other.alignment_);
    std::swap(locked_, other.locked_);
  }

  static constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;  // x86-64 and arm64 (4K)
  static std::size_t round_up(std::size_t n, std::size_t to) {
    return (n + to - 1) / to * to;
  }
  // Only whole huge pages are advised, so a partial last one does not take 2 MiB of RAM; a
  // refusal (THP "never", no memory to compact) leaves ordinary pages, which work as before.
  static void advise_huge_pages(std::byte* data, std::size_t whole_huge_pages_bytes) {
#ifdef MADV_HUGEPAGE
    if (whole_huge_pages_bytes > 0) (void)::madvise(data, whole_huge_pages_bytes, MADV_HUGEPAGE);
#else
    (void)data;
    (void)whole_huge_pages_bytes;
#endif
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = 4096;
  bool locked_ = false;
};

}  // namespace zero::offload
