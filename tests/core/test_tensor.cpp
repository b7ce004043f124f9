// Shape, Tensor views, Buffer ownership and alignment, and the Arena allocator.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <thread>
#include <utility>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>

using namespace zero;

TEST_CASE("Shape extents, strides and errors", "[unit][tensor]") {
  const Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s[-1] == 4);
  CHECK(s.stride(0) == 12);
  CHECK(s.stride(2) == 1);
  CHECK(s.drop_front() == Shape{3, 4});
  CHECK(Shape{}.numel() == 1);
  CHECK(s.to_string() == "[2, 3, 4]");
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5, 6, 7}), ShapeError);
  CHECK_THROWS_WITH((Shape{2, -1}), Catch::Contains("negative"));
  CHECK_THROWS_AS(s[3], ShapeError);
  // 2^32 * 2^31 = 2^63 does not fit in int64; a zero extent anywhere still gives 0.
  const std::int64_t big = std::int64_t{1} << 32;
  CHECK_THROWS_WITH((Shape{big, big / 2}.numel()), Catch::Contains("overflows int64"));
  CHECK(Shape{big, big / 4}.numel() == std::int64_t{1} << 62);
  CHECK(Shape{big, big, 0}.numel() == 0);
}

TEST_CASE("A byte count that would wrap is refused, not allocated small", "[unit][tensor]") {
  // 2^62 doubles are 2^65 bytes: the product wraps to 0 in size_t.
  const std::size_t huge = std::size_t{1} << 62;
  CHECK_THROWS_AS(Buffer<double>(huge), OutOfMemoryError);
  CHECK_THROWS_AS(Buffer<double>(huge, Buffer<double>::Uninitialized{}), OutOfMemoryError);
  Host::Stream& stream = Host::default_stream();
  CHECK_THROWS_AS(Host::allocate(~std::size_t{0} - 8, 64, stream), OutOfMemoryError);
  Arena<> arena(4096);
  // numel 2^62 of 8 bytes: its byte count wraps to 0, which used to fit.
  const auto n = static_cast<std::int64_t>(huge);
  CHECK_THROWS_WITH(arena.allocate<double>({n}), Catch::Contains("cannot allocate"));
  CHECK(arena.used_bytes() == 0);
  CHECK(arena.allocate<double>({512}).numel() == 512);  // exactly the capacity still fits
  CHECK_THROWS_AS(arena.allocate<char>({1}), OutOfMemoryError);
}

TEST_CASE("Tensor views share storage and check their bounds", "[unit][tensor]") {
  Buffer<float> buf(24);
  Tensor<float> t = buf.view({2, 3, 4});
  for (std::int64_t i = 0; i < t.numel(); ++i) t.at(i) = static_cast<float>(i);
  CHECK(t[1].shape() == Shape{3, 4});
  CHECK(t[1][2].at(3) == 23.0f);
  CHECK(t.reshape({6, 4})[5].at(0) == 20.0f);
  CHECK(t.slice(10, 4).at(0) == 10.0f);
  Tensor<const float> ct = t;  // implicit conversion to const
  CHECK(ct.at(5) == 5.0f);
  CHECK(Tensor<float>::dtype() == DType::f32);
  CHECK_THROWS_WITH(t.reshape({5, 5}), Catch::Contains("[2, 3, 4]") && Catch::Contains("[5, 5]"));
  CHECK_THROWS_AS(t.slice(20, 5), ShapeError);
  CHECK_THROWS_AS(t[2], ShapeError);
  CHECK_THROWS_AS(buf.view({5, 5}), ShapeError);
  const Tensor<float> on_gpu(nullptr, Shape{4}, DeviceKind::cuda);
  CHECK_THROWS_WITH(on_gpu.at(0), Catch::Contains("cuda"));
}

TEST_CASE("Buffer is zeroed, aligned, and moves ownership", "[unit][tensor]") {
  Buffer<double> a(1000, 4096);
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 4096 == 0);
  for (double v : a.view()) CHECK(v == 0.0);
  a.view().at(3) = 7.0;
  Buffer<double> b = std::move(a);
  CHECK(a.data() == nullptr);  // NOLINT: moved-from state is specified
  CHECK(a.size() == 0);
  CHECK(b.view().at(3) == 7.0);
  CHECK(b.bytes() == 8000);
  Buffer<bf16> c(3);
  CHECK(reinterpret_cast<std::uintptr_t>(c.data()) % Host::default_alignment == 0);
  CHECK_THROWS_AS(Buffer<float>(4, 3), Error);
}

TEST_CASE("An arena's storage is not filled: pages it never reaches take no memory",
          "[unit][tensor]") {
  // Resident pages from /proc/self/statm (Linux); the test says nothing elsewhere.
  auto resident_bytes = []() -> long {
    std::ifstream statm("/proc/self/statm");
    long size = 0, resident = -1;
    statm >> size >> resident;
    return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
  };
  const long before = resident_bytes();
  if (before < 0) {
    WARN("no /proc/self/statm: resident memory not checked");
    return;
  }
  Arena<> arena(std::size_t{1} << 30, "large");  // 1 GiB reserved
  auto x = arena.allocate<float>({1024});
  for (float& v : x) v = 1.0f;
  const long after = resident_bytes();
  INFO("resident before " << before << ", after " << after);
  CHECK(after - before < (64L << 20));
  // The high-water mark starts again from the current position.
  CHECK(arena.peak_bytes() == 4096);
  arena.reset();
  arena.reset_peak();
  CHECK(arena.peak_bytes() == 0);
  Buffer<int> b(5, Buffer<int>::Uninitialized{});
  CHECK(b.size() == 5);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % Host::default_alignment == 0);
}

TEST_CASE("Arena hands out aligned views in stack order and never grows", "[unit][tensor]") {
  Arena<> arena(4096, "activations");
  auto x = arena.allocate<float>({10});
  auto y = arena.allocate<double>({3}, 512);
  CHECK(reinterpret_cast<std::uintptr_t>(x.data()) % 256 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(y.data()) % 512 == 0);
  CHECK(reinterpret_cast<std::byte*>(y.data()) >= reinterpret_cast<std::byte*>(x.data() + 10));
  const auto m = arena.mark();
  auto z = arena.allocate<float>({100});
  CHECK(arena.used_bytes() > m);
  arena.release(m);
  auto w = arena.allocate<float>({100});
  CHECK(w.data() == z.data());  // released memory is reused, not leaked
  const std::size_t peak = arena.peak_bytes();
  arena.reset();
  CHECK(arena.used_bytes() == 0);
  CHECK(arena.peak_bytes() == peak);
  CHECK_THROWS_AS(arena.allocate<float>({2000}), OutOfMemoryError);
  CHECK_THROWS_WITH(arena.allocate<float>({2000}),
                    Catch::Contains("activations") && Catch::Contains("2000 elements of 4 bytes") &&
                        Catch::Contains("of 4096 bytes in use"));
  CHECK_THROWS_AS(arena.release(100000), Error);
}
