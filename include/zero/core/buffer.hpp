#pragma once
// Buffer<T, Device>: owning, aligned, move-only storage for count elements of T on a device,
// zero-filled on creation unless asked not to (storage that is always written before it is
// read, such as an arena: on the host its untouched pages then take no memory). Views of it are
// Tensor<T>.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include <zero/core/device.hpp>
#include <zero/core/tensor.hpp>

namespace zero {

/// Owning storage of count elements of a trivially copyable T on Dev.
template <class T, Device Dev = Host>
class Buffer {
  static_assert(std::is_trivially_copyable_v<T>, "zero::Buffer holds trivially copyable types");

 public:
  using device_type = Dev;
  using Stream = typename Dev::Stream;

  Buffer() = default;
  /// Allocates count zeroed elements aligned to alignment bytes, ordered on stream.
  explicit Buffer(std::size_t count, std::size_t alignment = Dev::default_alignment,
                  Stream& stream = Dev::default_stream())
      : count_(count), stream_(&stream) {
    data_ = static_cast<T*>(Dev::allocate(bytes_of(count), alignment, stream));
    Dev::fill_bytes(data_, 0, count * sizeof(T), stream);
  }
  /// Tag: allocate without zero-filling.
  struct Uninitialized {};
  /// Allocates count elements aligned to alignment bytes without filling them: every element
  /// must be written before it is read.
  Buffer(std::size_t count, Uninitialized, std::size_t alignment = Dev::default_alignment,
         Stream& stream = Dev::default_stream())
      : count_(count), stream_(&stream) {
    data_ = static_cast<T*>(Dev::allocate(bytes_of(count), alignment, stream));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        count_(std::exchange(other.count_, 0)),
        stream_(other.stream_) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  ~Buffer() { release(); }

  /// The stream the allocation, the zero-fill and the free are ordered on.
  Stream& stream() const { return *stream_; }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return count_ == 0; }

  /// The whole buffer as a 1-D view.
  Tensor<T> view() { return {data_, Shape{static_cast<std::int64_t>(count_)}, Dev::kind}; }
  Tensor<const T> view() const {
    return {data_, Shape{static_cast<std::int64_t>(count_)}, Dev::kind};
  }
  /// The first shape.numel() elements seen as shape; throws ShapeError if they do not fit.
  Tensor<T> view(Shape shape) {
    expect<ShapeError>(static_cast<std::size_t>(shape.numel()) <= count_, "Buffer::view: shape ",
                       shape, " needs ", shape.numel(), " elements, the buffer holds ", count_);
    return {data_, shape, Dev::kind};
  }

 private:
  // count * sizeof(T), refused (OutOfMemoryError) where it would wrap.
  static std::size_t bytes_of(std::size_t count) {
    expect<OutOfMemoryError>(count <= std::numeric_limits<std::size_t>::max() / sizeof(T),
                             "Buffer: ", count, " elements of ", sizeof(T),
                             " bytes are more than memory can hold");
    return count * sizeof(T);
  }
  void release() noexcept {
    if (data_ != nullptr) Dev::deallocate(data_, count_ * sizeof(T), *stream_);
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
  Stream* stream_ = &Dev::default_stream();
};

}  // namespace zero
