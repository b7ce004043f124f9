#pragma once
// Arenas: one allocation that hands out aligned tensor views in stack order. ZeRO-R's
// constant-size buffers come from arenas: memory is taken once, so it cannot fragment, and the
// peak is known. mark()/release() free everything allocated after a mark.
//
// BumpArena is the stack-order allocator over a byte range it does not own, on any device (its
// views carry the device's kind); Arena<Device> is a BumpArena owning its range. Code that only
// allocates views (the layers, through StepContext::arena) takes a BumpArena, so one model runs
// on host or device memory alike.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include <zero/core/buffer.hpp>
#include <zero/core/device.hpp>
#include <zero/core/error.hpp>
#include <zero/core/tensor.hpp>

namespace zero {

/// A bump allocator over a byte range of one device's memory (not owned).
class BumpArena {
 public:
  /// Position in the arena returned by mark().
  using Mark = std::size_t;
  /// Alignment of every view unless a larger one is asked for; fits 128-bit loads and cuBLAS.
  static constexpr std::size_t default_alignment = 256;

  /// Views of [base, base + capacity_bytes) on device; name appears in error messages.
  BumpArena(std::byte* base, std::size_t capacity_bytes, DeviceKind device,
            std::string name = "arena")
      : base_(base), capacity_(capacity_bytes), device_(device), name_(std::move(name)) {}
  BumpArena(const BumpArena&) = delete;
  BumpArena& operator=(const BumpArena&) = delete;
  virtual ~BumpArena() = default;

  /// A view of shape, aligned to alignment (a power of two); throws OutOfMemoryError when the
  /// arena cannot hold it.
  template <class T>
  Tensor<T> allocate(Shape shape, std::size_t alignment = default_alignment) {
    expect<Error>(alignment != 0 && (alignment & (alignment - 1)) == 0, "Arena '", name_,
                  "': alignment ", alignment, " is not a power of two");
    const auto base = reinterpret_cast<std::uintptr_t>(base_);
    const std::uintptr_t start = (base + used_ + alignment - 1) & ~(alignment - 1);
    const auto numel = static_cast<std::size_t>(shape.numel());
    const auto offset = static_cast<std::size_t>(start - base);
    // Checked before the products and sums below, which could wrap for a huge shape.
    expect<OutOfMemoryError>(offset <= capacity_ && numel <= (capacity_ - offset) / sizeof(T),
                             "Arena '", name_, "': cannot allocate ", numel, " elements of ",
                             sizeof(T), " bytes for shape ", shape, ": ", used_, " of ", capacity_,
                             " bytes in use");
    const std::size_t bytes = numel * sizeof(T);
    const std::size_t end = offset + bytes;
    used_ = end;
    peak_ = used_ > peak_ ? used_ : peak_;
    return Tensor<T>(reinterpret_cast<T*>(start), shape, device_);
  }

  /// The current position; release(mark) frees everything allocated after it.
  Mark mark() const { return used_; }
  /// Frees all views handed out after m.
  void release(Mark m) {
    expect<Error>(m <= used_, "Arena '", name_, "': release to mark ", m,
                  " which is past the current position ", used_);
    used_ = m;
  }
  /// Frees every view.
  void reset() { used_ = 0; }
  /// Starts the high-water mark again from the current position.
  void reset_peak() { peak_ = used_; }

  std::size_t used_bytes() const { return used_; }
  /// Highest used_bytes() seen since construction (or the last reset_peak()).
  std::size_t peak_bytes() const { return peak_; }
  std::size_t capacity_bytes() const { return capacity_; }
  /// The device whose memory the views are.
  DeviceKind device() const { return device_; }
  const std::string& name() const { return name_; }

 private:
  std::byte* base_;
  std::size_t capacity_;
  DeviceKind device_;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
  std::string name_;
};

namespace detail {
// Arena's storage, a base so that it exists before the BumpArena over it is built.
template <Device Dev>
struct ArenaStorage {
  Buffer<std::byte, Dev> storage;
};
}  // namespace detail

/// A bump allocator owning capacity_bytes of Dev memory.
template <Device Dev = Host>
class Arena : private detail::ArenaStorage<Dev>, public BumpArena {
 public:
  /// Reserves capacity_bytes (not filled: every view is written before it is read, and on the
  /// host the pages a run never reaches take no memory), allocated and freed in stream's order;
  /// name appears in error messages.
  explicit Arena(std::size_t capacity_bytes, std::string name = "arena",
                 typename Dev::Stream& stream = Dev::default_stream())
      : detail::ArenaStorage<Dev>{Buffer<std::byte, Dev>(
            capacity_bytes, typename Buffer<std::byte, Dev>::Uninitialized{}, default_alignment,
            stream)},
        BumpArena(this->storage.data(), this->storage.size(), Dev::kind, std::move(name)) {}
};

}  // namespace zero
