#pragma once
// Element access for host kernels: "store in T, compute in float". A kernel over storage type T
// loads each element into compute_type_t<T> (float for bf16/f16, T itself for f32/f64), does all
// arithmetic and reductions there, and rounds once (nearest even) when it stores a result. For
// f32/f64 load and store are the identity and ComputeBuffer works in place, so those kernels run
// exactly the operations they ran before half types were supported: their results are unchanged
// bit for bit.

#include <cstdint>
#include <memory>
#include <type_traits>

#include <zero/core/dtype.hpp>

namespace zero::ops::cpu {

/// Widens a stored element to the compute type (exact).
template <class T>
inline compute_type_t<T> load(const T& x) {
  if constexpr (is_half_type<T>) {
    return static_cast<float>(x);
  } else {
    return x;
  }
}

/// Rounds a computed value to the storage type once (round to nearest, ties to even).
template <class T>
inline T store(compute_type_t<T> x) {
  if constexpr (is_half_type<T>) {
    return T(x);
  } else {
    return x;
  }
}

/// Working storage in the compute type for n elements of a kernel's output or temporaries.
/// When T is its own compute type the buffer is the storage itself (no copy, no allocation);
/// for half types it is an uninitialised float array that gather() fills from the storage and
/// scatter() rounds back once, so a result accumulated over many steps is rounded a single time.
template <class T>
class ComputeBuffer {
 public:
  using value_type = compute_type_t<T>;
  /// True when the buffer aliases the storage.
  static constexpr bool in_place = std::is_same_v<value_type, T>;

  /// A buffer for storage[0, n) (storage may be null for pure scratch).
  ComputeBuffer(T* storage, std::int64_t n) : storage_(storage), n_(n) {
    if constexpr (in_place) {
      data_ = storage;
    } else {
      owned_ = std::make_unique_for_overwrite<value_type[]>(static_cast<std::size_t>(n));
      data_ = owned_.get();
    }
  }

  value_type* data() const { return data_; }
  value_type& operator[](std::int64_t i) const { return data_[i]; }

  /// Copies the storage into the buffer (nothing to do in place).
  void gather() const {
    if constexpr (!in_place) {
      for (std::int64_t i = 0; i < n_; ++i) data_[i] = load(storage_[i]);
    }
  }
  /// Rounds the buffer into the storage (nothing to do in place).
  void scatter() const {
    if constexpr (!in_place) {
      for (std::int64_t i = 0; i < n_; ++i) storage_[i] = store<T>(data_[i]);
    }
  }

 private:
  T* storage_;
  std::int64_t n_;
  value_type* data_ = nullptr;
  std::unique_ptr<value_type[]> owned_;
};

}  // namespace zero::ops::cpu
