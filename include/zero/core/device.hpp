#pragma once
// Device kinds and the Host device. A device type gives allocate/deallocate/copy/fill and its
// Stream and Event types; the engine and buffers are written once against this interface.
// The Cuda device lives in zero/core/cuda_device.cuh and is only seen by nvcc.

#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include <zero/core/error.hpp>

namespace zero {

/// Where memory lives.
enum class DeviceKind : unsigned char { host, cuda };

/// Name of a device kind ("host", "cuda").
constexpr const char* name_of(DeviceKind kind) {
  return kind == DeviceKind::host ? "host" : "cuda";
}

/// Host work is synchronous: a host stream orders nothing and never has pending work.
struct HostStream {
  /// Waits for pending work: none on the host.
  void synchronize() const {}
};

/// A host event is complete as soon as it is recorded.
struct HostEvent {
  /// Marks the point in stream; host work before it is already done.
  void record(const HostStream&) {}
  /// Blocks until the event completes: immediately on the host.
  void synchronize() const {}
  /// True when the work before the event has finished.
  bool ready() const { return true; }
};

/// The CPU: aligned heap memory and synchronous copies.
struct Host {
  static constexpr DeviceKind kind = DeviceKind::host;
  using Stream = HostStream;
  using Event = HostEvent;
  /// Alignment used when none is given: a cache line, which also fits AVX-512 loads.
  static constexpr std::size_t default_alignment = 64;

  /// The stream used when the caller gives none.
  static Stream& default_stream() {
    static Stream stream;  // stateless
    return stream;
  }
  /// Allocates bytes aligned to alignment (a power of two); throws OutOfMemoryError.
  static void* allocate(std::size_t bytes, std::size_t alignment, Stream&) {
    expect<Error>(alignment != 0 && (alignment & (alignment - 1)) == 0,
                  "Host::allocate: alignment ", alignment, " is not a power of two");
    if (bytes == 0) return nullptr;
    expect<OutOfMemoryError>(bytes <= std::numeric_limits<std::size_t>::max() - alignment,
                             "Host::allocate: ", bytes, " bytes is more than memory can hold");
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    void* p = std::aligned_alloc(alignment, rounded);
    expect<OutOfMemoryError>(p != nullptr, "Host::allocate: could not allocate ", bytes,
                             " bytes aligned to ", alignment);
    return p;
  }
  /// Frees memory from allocate.
  static void deallocate(void* p, std::size_t, Stream&) noexcept { std::free(p); }
  /// Copies bytes (host to host).
  static void copy(void* dst, const void* src, std::size_t bytes, Stream&) {
    if (bytes != 0) std::memmove(dst, src, bytes);
  }
  /// Sets bytes to value.
  static void fill_bytes(void* dst, int value, std::size_t bytes, Stream&) {
    if (bytes != 0) std::memset(dst, value, bytes);
  }
};

/// What Buffer and Arena need of a device type.
template <class D>
concept Device = requires(void* p, const void* cp, std::size_t n, typename D::Stream& s) {
  { D::kind } -> std::convertible_to<DeviceKind>;
  { D::default_alignment } -> std::convertible_to<std::size_t>;
  { D::default_stream() } -> std::same_as<typename D::Stream&>;
  { D::allocate(n, n, s) } -> std::same_as<void*>;
  D::deallocate(p, n, s);
  D::copy(p, cp, n, s);
  D::fill_bytes(p, 0, n, s);
};

static_assert(Device<Host>);

}  // namespace zero
