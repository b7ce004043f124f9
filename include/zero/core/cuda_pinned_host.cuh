#pragma once
// zero-requires: cuda
// CudaPinnedHost: page-locked host memory as a zero Device, so Buffer<T, CudaPinnedHost> is
// host memory that device copies reach by DMA without a staging copy (cudaMemcpyAsync from
// pageable memory is synchronous and goes through a driver bounce buffer). The memory is host
// memory (kind host): the host reads and writes it directly once the stream's copies are done.
// Page-locking is not stream-ordered: allocation is cudaHostAlloc, and deallocation waits for the
// buffer's stream before cudaFreeHost, so a copy still in flight never reads freed memory.
#if !defined(__CUDACC__)
#error "zero/core/cuda_pinned_host.cuh needs nvcc; host-only code uses Buffer<T, Host>"
#endif

#include <cstddef>
#include <cstring>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/device.hpp>
#include <zero/core/error.hpp>

namespace zero {

/// Page-locked host memory, ordered on CUDA streams.
struct CudaPinnedHost {
  static constexpr DeviceKind kind = DeviceKind::host;
  using Stream = CudaStream;
  using Event = CudaEvent;
  /// cudaHostAlloc returns page-aligned memory; 256 bytes is what callers may ask for.
  static constexpr std::size_t default_alignment = 256;

  /// The legacy default stream (a view, never destroyed).
  static Stream& default_stream() { return Cuda::default_stream(); }
  /// Page-locked host memory (portable to every device); throws OutOfMemoryError.
  static void* allocate(std::size_t bytes, std::size_t alignment, Stream&) {
    expect<Error>(
        alignment != 0 && alignment <= default_alignment && (alignment & (alignment - 1)) == 0,
        "CudaPinnedHost::allocate: alignment ", alignment,
        " must be a power of two <= ", default_alignment);
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not the next kernel check's error (see Cuda::allocate)
      raise<OutOfMemoryError>("CudaPinnedHost::allocate: could not page-lock ", bytes,
                              " bytes of host memory (check ulimit -l and the free host memory)");
    }
    ZERO_CUDA_CHECK(status);
    return p;
  }
  /// Waits for stream's earlier work (copies from or into p), then unpins and frees p.
  static void deallocate(void* p, std::size_t, Stream& stream) noexcept {
    cudaStreamSynchronize(stream.native());
    cudaFreeHost(p);
  }
  /// Copies bytes between any host or device pointers, ordered on stream.
  static void copy(void* dst, const void* src, std::size_t bytes, Stream& stream) {
    Cuda::copy(dst, src, bytes, stream);
  }
  /// Sets bytes to value after stream's earlier work (on the host: the memory is host memory).
  static void fill_bytes(void* dst, int value, std::size_t bytes, Stream& stream) {
    if (bytes == 0) return;
    stream.synchronize();
    std::memset(dst, value, bytes);
  }
};

static_assert(Device<CudaPinnedHost>);

}  // namespace zero
