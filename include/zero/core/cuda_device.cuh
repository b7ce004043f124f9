#pragma once
// The Cuda device: memory from the device's stream-ordered pool (cudaMallocAsync), RAII streams
// and events. Buffer<T, Cuda> and Arena<Cuda> use it exactly as they use Host.
#if !defined(__CUDACC__)
#error "zero/core/cuda_device.cuh needs nvcc; host-only code includes zero/core/device.hpp"
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/device.hpp>

namespace zero {

/// A CUDA stream; owning (created non-blocking) or a view of an existing one.
class CudaStream {
 public:
  /// Creates a non-blocking stream on the current device.
  CudaStream() : owned_(true) {
    ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  /// Views an existing stream (not destroyed by this object).
  static CudaStream view(cudaStream_t stream) { return CudaStream(stream); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  CudaStream(CudaStream&& o) noexcept
      : stream_(std::exchange(o.stream_, nullptr)), owned_(std::exchange(o.owned_, false)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      destroy();
      stream_ = std::exchange(o.stream_, nullptr);
      owned_ = std::exchange(o.owned_, false);
    }
    return *this;
  }
  ~CudaStream() { destroy(); }

  cudaStream_t native() const { return stream_; }
  /// Blocks the host until all work on the stream is done.
  void synchronize() const { ZERO_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s), owned_(false) {}
  void destroy() noexcept {
    if (owned_ && stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
};

/// A CUDA event for ordering streams: without timing unless made by timed().
class CudaEvent {
 public:
  CudaEvent() : CudaEvent(cudaEventDisableTiming) {}
  /// An event that also records a time (elapsed_ms), for measuring work on a stream.
  static CudaEvent timed() { return CudaEvent(cudaEventDefault); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  /// Marks the current end of stream's work.
  void record(const CudaStream& stream) {
    ZERO_CUDA_CHECK(cudaEventRecord(event_, stream.native()));
  }
  /// Makes stream wait (on the device) for the recorded work; the host does not block.
  void wait_on(const CudaStream& stream) const {
    ZERO_CUDA_CHECK(cudaStreamWaitEvent(stream.native(), event_, 0));
  }
  /// Blocks the host until the recorded work is done.
  void synchronize() const { ZERO_CUDA_CHECK(cudaEventSynchronize(event_)); }
  /// True when the recorded work is done.
  bool ready() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    ZERO_CUDA_CHECK(status);
    return true;
  }
  /// Milliseconds from start's recorded work to this event's (both timed() and complete).
  float elapsed_ms(const CudaEvent& start) const {
    float ms = 0;
    ZERO_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }
  cudaEvent_t native() const { return event_; }

 private:
  explicit CudaEvent(unsigned flags) { ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags)); }
  cudaEvent_t event_ = nullptr;
};

/// The current CUDA device.
struct Cuda {
  static constexpr DeviceKind kind = DeviceKind::cuda;
  using Stream = CudaStream;
  using Event = CudaEvent;
  /// cudaMalloc's own alignment; enough for 128-bit vector loads.
  static constexpr std::size_t default_alignment = 256;

  /// The legacy default stream (a view, never destroyed).
  static Stream& default_stream() {
    static Stream stream = Stream::view(nullptr);  // a view of stream 0: no owned state
    return stream;
  }
  /// Makes the current device's default memory pool keep the memory freed to it for the next
  /// allocation (a release threshold of "all") instead of its default of handing it back to the
  /// driver at each synchronisation, after which every step's scratch and buffers were fresh
  /// driver allocations. The caching allocators of PyTorch and JAX do the same. The engine's
  /// CUDA backend and nn::CudaKernels call it; it is idempotent.
  static void keep_pool_memory() {
    int device = 0;
    ZERO_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    ZERO_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t all = UINT64_MAX;
    ZERO_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &all));
  }
  /// Stream-ordered allocation from the device's default memory pool.
  static void* allocate(std::size_t bytes, std::size_t alignment, Stream& stream) {
    expect<Error>(
        alignment != 0 && alignment <= default_alignment && (alignment & (alignment - 1)) == 0,
        "Cuda::allocate: alignment ", alignment, " must be a power of two <= ", default_alignment);
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t status = cudaMallocAsync(&p, bytes, stream.native());
    if (status == cudaErrorMemoryAllocation) {
      // The failed call left its error as the thread's last one, which the next kernel
      // launch's check would report as its own: the caller may recover (a smaller arena).
      (void)cudaGetLastError();
      raise<OutOfMemoryError>("Cuda::allocate: out of device memory allocating ", bytes, " bytes");
    }
    ZERO_CUDA_CHECK(status);
    held_bytes_ += bytes;
    return p;
  }
  /// Returns memory to the pool once stream's earlier work is done.
  static void deallocate(void* p, std::size_t bytes, Stream& stream) noexcept {
    if (p == nullptr) return;
    held_bytes_ -= bytes;
    cudaFreeAsync(p, stream.native());
  }
  /// Bytes allocated through allocate and not yet given back through deallocate, by every thread
  /// of the process: what zero's buffers and arenas hold of the device's pool (ops::cuda's
  /// DeviceScratch and cuBLASLt's workspace take theirs from the pool directly). The [cuda]
  /// engine tests hold memory_report() to it.
  static std::size_t allocated_bytes() { return held_bytes_.load(); }
  /// Copies bytes between any host or device pointers, ordered on stream.
  static void copy(void* dst, const void* src, std::size_t bytes, Stream& stream) {
    if (bytes != 0) {
      ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream.native()));
    }
  }
  /// Sets bytes to value, ordered on stream.
  static void fill_bytes(void* dst, int value, std::size_t bytes, Stream& stream) {
    if (bytes != 0) ZERO_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream.native()));
  }

 private:
  static inline std::atomic<std::size_t> held_bytes_{0};
};

static_assert(Device<Cuda>);

}  // namespace zero
