#pragma once
// Tensor<T>: a non-owning view of a dense row-major array (pointer, shape, device). Views are
// cheap to copy; ownership lives in Buffer or Arena. Element access is for host views only.

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>

namespace zero {

/// A view of shape.numel() contiguous elements of T on a device.
template <class T>
class Tensor {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  constexpr Tensor() = default;
  /// Views data as shape on device.
  constexpr Tensor(T* data, Shape shape, DeviceKind device = DeviceKind::host)
      : data_(data), shape_(shape), device_(device) {}
  /// A Tensor<T> converts to a Tensor<const T>.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  constexpr Tensor(const Tensor<U>& other)  // NOLINT: implicit by design
      : data_(other.data()), shape_(other.shape()), device_(other.device()) {}

  constexpr T* data() const { return data_; }
  constexpr const Shape& shape() const { return shape_; }
  constexpr DeviceKind device() const { return device_; }
  constexpr int rank() const { return shape_.rank(); }
  constexpr std::int64_t numel() const { return shape_.numel(); }
  constexpr std::size_t bytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  constexpr bool empty() const { return numel() == 0; }
  /// Extent of dimension i (negative i counts from the back).
  std::int64_t dim(int i) const { return shape_[i]; }
  /// Runtime tag of T.
  static constexpr DType dtype() { return dtype_of<value_type>; }

  /// The same elements seen as another shape with the same element count.
  Tensor reshape(Shape shape) const {
    expect<ShapeError>(shape.numel() == numel(), "Tensor::reshape: cannot view ", shape_, " (",
                       numel(), " elements) as ", shape, " (", shape.numel(), " elements)");
    return Tensor(data_, shape, device_);
  }
  /// The whole tensor as one dimension.
  Tensor flat() const { return Tensor(data_, Shape{numel()}, device_); }
  /// count elements starting at flat offset, as a 1-D view.
  Tensor slice(std::int64_t offset, std::int64_t count) const {
    expect<ShapeError>(offset >= 0 && count >= 0 && offset + count <= numel(), "Tensor::slice: [",
                       offset, ", ", offset + count, ") is outside the tensor's ", numel(),
                       " elements");
    return Tensor(data_ + offset, Shape{count}, device_);
  }
  /// Sub-tensor at index i of the first dimension.
  Tensor operator[](std::int64_t i) const {
    expect<ShapeError>(rank() > 0 && i >= 0 && i < shape_[0], "Tensor[", i,
                       "]: index out of range for shape ", shape_);
    const Shape inner = shape_.drop_front();
    return Tensor(data_ + i * inner.numel(), inner, device_);
  }
  /// Element at flat index i of a host tensor.
  T& at(std::int64_t i) const {
    expect<ShapeError>(device_ == DeviceKind::host, "Tensor::at: the tensor lives on ",
                       name_of(device_), "; element access needs a host tensor");
    expect<ShapeError>(i >= 0 && i < numel(), "Tensor::at(", i, "): out of range for ", numel(),
                       " elements");
    return data_[i];
  }
  /// The elements of a host tensor as a span.
  std::span<T> span() const {
    expect<ShapeError>(device_ == DeviceKind::host, "Tensor::span: the tensor lives on ",
                       name_of(device_), "; spans need a host tensor");
    return {data_, static_cast<std::size_t>(numel())};
  }
  T* begin() const { return span().data(); }
  T* end() const { return begin() + numel(); }

 private:
  T* data_ = nullptr;
  Shape shape_{};
  DeviceKind device_ = DeviceKind::host;
};

/// Throws ShapeError unless a and b have the same shape; what names the operation.
template <class A, class B>
void expect_same_shape(const Tensor<A>& a, const Tensor<B>& b, const char* what) {
  expect<ShapeError>(a.shape() == b.shape(), what, ": shapes differ: ", a.shape(), " vs ",
                     b.shape());
}

}  // namespace zero
