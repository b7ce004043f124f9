// zero::engine::CudaBackend against HostBackend on the same inputs: the flow's element-wise
// kernels bit for bit (accumulate, convert_into, scale, clear, ZeRO++'s int8 and int4 packing in
// runs, its reading back and its sum of runs) and sum_of_squares to 1e-12 relative, +inf on
// Inf/NaN; the streams and the event between them (a copy on the comm stream sees what a compute
// kernel wrote, and without the event it does not); buffers from the pool and page-locked host
// memory. The no-device error is in test_engine_backend_no_device.cu (this executable's main skips
// before any test when no GPU is visible).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/cuda_pinned_host.cuh>
#include <zero/core/dtype.hpp>
#include <zero/engine/backend.hpp>
#include <zero/engine/cuda_backend.cuh>
#include <zero/engine/engine_options.hpp>
#include <zero/nn/cuda_kernels.cuh>

#include "ops_test_util.hpp"

// No `using namespace zero`: zero::cuda would make CUB's unqualified cuda::std ambiguous in
// nvcc's generated kernel stubs (sum_of_squares instantiates cub::DeviceReduce).
using zero::bf16;
using zero::convert;
using zero::f16;
using zero::engine::CudaBackend;
using zero::engine::HostBackend;

static_assert(std::is_same_v<zero::engine::backend_t<zero::Cuda>, CudaBackend>,
              "including cuda_backend.cuh makes Compute<Cuda> name CudaBackend");
static_assert(std::is_same_v<zero::engine::backend_t<zero::Host>, HostBackend>);
static_assert(CudaBackend::kernels == zero::DeviceKind::cuda);
static_assert(std::is_same_v<CudaBackend::Stream, zero::CudaStream> &&
              std::is_same_v<CudaBackend::Event, zero::CudaEvent>);

namespace {

template <class T>
using DeviceBuffer = CudaBackend::DeviceBuffer<T>;

/// A device copy of h, allocated and filled on the backend's compute stream.
template <class T>
DeviceBuffer<T> upload(CudaBackend& backend, const std::vector<T>& h) {
  DeviceBuffer<T> d(h.size(), typename DeviceBuffer<T>::Uninitialized{},
                    zero::Cuda::default_alignment, backend.compute_stream());
  if (!h.empty()) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(d.data(), h.data(), h.size() * sizeof(T),
                                    cudaMemcpyHostToDevice, backend.compute_stream().native()));
  }
  backend.compute_stream().synchronize();
  return d;
}

/// The device buffer's elements, after the compute stream's work.
template <class T>
std::vector<T> download(CudaBackend& backend, const DeviceBuffer<T>& d) {
  std::vector<T> h(d.size());
  if (!h.empty()) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost,
                                    backend.compute_stream().native()));
  }
  backend.compute_stream().synchronize();
  return h;
}

template <class T>
std::span<T> span_of(DeviceBuffer<T>& d) {
  return {d.data(), d.size()};
}
template <class T>
std::span<const T> const_span_of(const DeviceBuffer<T>& d) {
  return {d.data(), d.size()};
}

/// n values of T: uniform in [-scale, scale) from seed, with edge values spread over the front
/// (signed zeros, an f32 subnormal, values past f16's range, a large value near f32's limit).
template <class T>
std::vector<T> inputs(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::vector<T> v = zero::test::random_vector<T>(n, seed, -scale, scale);
  const float edges[] = {0.0f, -0.0f, 1e-40f, -3.5e-42f, 70000.0f, -1e5f, 1.0009765625f, 3e38f};
  for (std::size_t i = 0; i < std::size(edges) && 7 * i < n; ++i) v[7 * i] = convert<T>(edges[i]);
  return v;
}

/// Checks that got and want hold the same bits, reporting the first differences. Two NaNs are
/// the same whatever their bits: an invalid operation's NaN is the hardware's (x86 gives
/// 0xFFC00000, a GPU 0x7FFFFFFF; 0 * inf reading back a block scaled by an infinity).
template <class T>
void check_same_bits(const std::vector<T>& got, const std::vector<T>& want,
                     const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  std::string first;
  const auto is_nan = [](T x) { return std::isnan(convert<double>(x)); };
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
    if (is_nan(got[i]) && is_nan(want[i])) continue;
    if (bad < 5) {
      first += " [" + std::to_string(i) + "] got " + std::to_string(convert<double>(got[i])) +
               " want " + std::to_string(convert<double>(want[i])) + ";";
    }
    ++bad;
  }
  INFO(what << ": " << bad << " of " << got.size() << " elements differ:" << first);
  CHECK(bad == 0);
}

const std::size_t sizes[] = {1, 1000, 65537};

/// Blocks until *release is non-zero (set by the host), or about give_up_cycles have passed;
/// then writes out[i] = i + 1 (or -1 when it gave up, so a broken test fails instead of hanging).
__global__ void write_when_released(float* out, int n, const volatile int* release,
                                    long long give_up_cycles) {
  if (threadIdx.x == 0) {
    const long long start = clock64();
    while (*release == 0 && clock64() - start < give_up_cycles) {
    }
  }
  __syncthreads();
  const bool gave_up = *release == 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    out[i] = gave_up ? -1.0f : static_cast<float>(i + 1);
  }
}

/// write_when_released launched from the host, with the pinned flag that releases it.
class HeldKernel {
 public:
  explicit HeldKernel(CudaBackend::Stream& stream)
      : release_(1, zero::CudaPinnedHost::default_alignment, stream) {
    int clock_khz = 0, device = 0;
    ZERO_CUDA_CHECK(cudaGetDevice(&device));
    ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
    give_up_cycles_ = 20LL * 1000 * clock_khz;  // about 20 s
    ZERO_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&on_device_), release_.data(), 0));
  }
  /// Serialising modes would deadlock the host against the kernel: tests skip under them.
  static bool launches_serialised() {
    const char* blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
    return blocking != nullptr && std::string(blocking) == "1";
  }
  /// Holds the next launch until release().
  void hold() { __atomic_store_n(release_.data(), 0, __ATOMIC_SEQ_CST); }
  void release() { __atomic_store_n(release_.data(), 1, __ATOMIC_SEQ_CST); }
  /// Writes out[i] = i + 1 on stream once released.
  void launch(CudaBackend::Stream& stream, float* out, int n) {
    write_when_released<<<1, 256, 0, stream.native()>>>(out, n, on_device_, give_up_cycles_);
    ZERO_CUDA_CHECK(cudaGetLastError());
  }

 private:
  CudaBackend::PinnedBuffer<int> release_;
  int* on_device_ = nullptr;
  long long give_up_cycles_ = 0;
};

}  // namespace

TEST_CASE("CudaBackend owns two distinct streams", "[cuda][engine]") {
  CudaBackend backend;
  CHECK(backend.compute_stream().native() != nullptr);
  CHECK(backend.comm_stream().native() != nullptr);
  CHECK(backend.compute_stream().native() != backend.comm_stream().native());
  // The streams live on the heap: references taken before a move still name them after it.
  cudaStream_t compute = backend.compute_stream().native();
  CudaBackend::Stream* address = &backend.compute_stream();
  CudaBackend moved = std::move(backend);
  CHECK(&moved.compute_stream() == address);
  CHECK(moved.compute_stream().native() == compute);
}

TEMPLATE_TEST_CASE("CudaBackend::accumulate equals HostBackend bit for bit", "[cuda][engine]",
                   float, bf16, f16) {
  using G = TestType;
  CudaBackend backend;
  for (const zero::engine::Fold first : {zero::engine::Fold::add, zero::engine::Fold::start}) {
    for (const double factor : {1.0, 0.5, 1.0 / 3.0, 0.1, -2.75}) {
      for (const std::size_t n : sizes) {
        const std::vector<float> acc0 = inputs<float>(n, 11, 4.0f);
        const std::vector<G> g = inputs<G>(n, 12);
        std::vector<float> want = acc0;
        // The first fold adds to acc0 or, Fold::start, ignores it (a window's first fold).
        HostBackend::accumulate(std::span<float>(want), std::span<const G>(g), factor, first);

        DeviceBuffer<float> acc = upload(backend, acc0);
        const DeviceBuffer<G> dg = upload(backend, g);
        backend.accumulate(span_of(acc), const_span_of(dg), factor, first);
        check_same_bits(
            download(backend, acc), want,
            "first accumulate n=" + std::to_string(n) + " factor=" + std::to_string(factor));
        // Twice, so the second call adds into a device-made sum.
        HostBackend::accumulate(std::span<float>(want), std::span<const G>(g), factor);
        backend.accumulate(span_of(acc), const_span_of(dg), factor);
        check_same_bits(download(backend, acc), want,
                        "accumulate n=" + std::to_string(n) + " factor=" + std::to_string(factor));
      }
    }
  }
}

TEST_CASE("CudaBackend::accumulate refuses mismatched sizes and pageable memory",
          "[cuda][engine]") {
  CudaBackend backend;
  DeviceBuffer<float> acc = upload(backend, std::vector<float>(8, 1.0f));
  const DeviceBuffer<bf16> g = upload(backend, std::vector<bf16>(7, bf16(1.0f)));
  CHECK_THROWS_AS(backend.accumulate(span_of(acc), const_span_of(g)), zero::ShapeError);

  int pageable_access = 0, device = 0;
  ZERO_CUDA_CHECK(cudaGetDevice(&device));
  ZERO_CUDA_CHECK(
      cudaDeviceGetAttribute(&pageable_access, cudaDevAttrPageableMemoryAccess, device));
  if (pageable_access == 0) {
    std::vector<float> host(8, 1.0f);
    CHECK_THROWS_WITH(backend.clear(std::span<float>(host)),
                      Catch::Contains("pageable host memory") && Catch::Contains("clear"));
  }
  // Empty spans launch nothing and touch no pointer.
  backend.accumulate(std::span<float>(), std::span<const bf16>());
  CHECK(backend.sum_of_squares(std::span<const float>()) == 0.0);
}

TEST_CASE("CudaBackend::convert_into equals HostBackend bit for bit", "[cuda][engine]") {
  CudaBackend backend;
  auto check_pair = [&](auto out_tag, auto in_tag, const char* name) {
    using O = decltype(out_tag);
    using I = decltype(in_tag);
    for (const std::size_t n : sizes) {
      // Values up to 4e5 reach f16's overflow to infinity and its subnormals (x 2^-24).
      std::vector<I> in = inputs<I>(n, 21, 4e5f);
      for (std::size_t i = 1; i < n; i += 5) in[i] = convert<I>(convert<float>(in[i]) * 1e-9f);
      std::vector<O> want(n);
      HostBackend::convert_into(std::span<O>(want), std::span<const I>(in));

      DeviceBuffer<O> out = upload(backend, std::vector<O>(n));
      const DeviceBuffer<I> din = upload(backend, in);
      backend.convert_into(span_of(out), const_span_of(din));
      check_same_bits(download(backend, out), want,
                      std::string("convert_into ") + name + " n=" + std::to_string(n));
    }
  };
  check_pair(bf16{}, float{}, "f32->bf16");
  check_pair(f16{}, float{}, "f32->f16");
  check_pair(float{}, bf16{}, "bf16->f32");
  check_pair(float{}, f16{}, "f16->f32");
  check_pair(float{}, float{}, "f32->f32");
  check_pair(f16{}, bf16{}, "bf16->f16");
}

TEST_CASE("CudaBackend::scale equals HostBackend bit for bit", "[cuda][engine]") {
  CudaBackend backend;
  for (const double factor : {0.5, 1.0 / 3.0, 1e-3, -2.5, 1e30, 0.0}) {
    for (const std::size_t n : sizes) {
      const std::vector<float> v0 = inputs<float>(n, 31, 8.0f);
      std::vector<float> want = v0;
      HostBackend::scale(std::span<float>(want), factor);

      DeviceBuffer<float> v = upload(backend, v0);
      backend.scale(span_of(v), factor);
      check_same_bits(download(backend, v), want,
                      "scale n=" + std::to_string(n) + " factor=" + std::to_string(factor));
    }
  }
}

TEMPLATE_TEST_CASE("CudaBackend::quantize_int8 and dequantize_int8 equal HostBackend bit for bit",
                   "[cuda][engine]", float, bf16, f16) {
  CudaBackend backend;
  for (const std::size_t n : sizes) {
    const std::vector<TestType> values = inputs<TestType>(n, 47, 0.1f);
    std::vector<std::uint8_t> want(
        static_cast<std::size_t>(zero::quant::int8_packed_bytes(static_cast<std::int64_t>(n))));
    HostBackend::quantize_int8(std::span<std::uint8_t>(want), std::span<const TestType>(values));
    std::vector<TestType> want_back(n);
    HostBackend::dequantize_int8(std::span<TestType>(want_back),
                                 std::span<const std::uint8_t>(want));

    const DeviceBuffer<TestType> v = upload(backend, values);
    DeviceBuffer<std::uint8_t> packed = upload(backend, std::vector<std::uint8_t>(want.size()));
    backend.quantize_int8(span_of(packed), const_span_of(v));
    check_same_bits(download(backend, packed), want, "quantize_int8 n=" + std::to_string(n));
    DeviceBuffer<TestType> back = upload(backend, std::vector<TestType>(n));
    backend.dequantize_int8(span_of(back), const_span_of(packed));
    check_same_bits(download(backend, back), want_back, "dequantize_int8 n=" + std::to_string(n));
  }
}

TEMPLATE_TEST_CASE(
    "CudaBackend's int8 runs and their sums (ZeRO++ qgZ) equal HostBackend bit for "
    "bit",
    "[cuda][engine]", float, bf16, f16) {
  CudaBackend backend;
  // runs, packed column by column from rows of `columns` (qgZ's first hop under hpZ), and summed
  // in blocks of `outputs` runs (its partial sums; 1: the mean of every run).
  struct Layout {
    std::int64_t runs, columns, outputs;
  };
  for (const Layout l :
       {Layout{1, 1, 1}, Layout{3, 1, 1}, Layout{8, 1, 1}, Layout{8, 2, 4}, Layout{6, 3, 2}}) {
    for (const std::size_t n : sizes) {
      const std::string what = " n=" + std::to_string(n) + " runs=" + std::to_string(l.runs) +
                               " columns=" + std::to_string(l.columns) +
                               " outputs=" + std::to_string(l.outputs);
      const auto whole = n * static_cast<std::size_t>(l.runs);
      const std::vector<TestType> values = inputs<TestType>(whole, 53, 0.1f);
      const auto packed_bytes =
          static_cast<std::size_t>(l.runs) *
          static_cast<std::size_t>(zero::quant::int8_packed_bytes(static_cast<std::int64_t>(n)));
      std::vector<std::uint8_t> want(packed_bytes);
      HostBackend::quantize_int8(std::span<std::uint8_t>(want), std::span<const TestType>(values),
                                 l.runs, l.columns);
      std::vector<TestType> want_back(whole);
      HostBackend::dequantize_int8(std::span<TestType>(want_back),
                                   std::span<const std::uint8_t>(want), l.runs);
      const float factor = static_cast<float>(l.outputs) / static_cast<float>(l.runs);
      std::vector<TestType> want_sums(n * static_cast<std::size_t>(l.outputs));
      HostBackend::sum_int8(std::span<TestType>(want_sums), std::span<const std::uint8_t>(want),
                            factor, l.outputs);

      const DeviceBuffer<TestType> v = upload(backend, values);
      DeviceBuffer<std::uint8_t> packed = upload(backend, std::vector<std::uint8_t>(packed_bytes));
      backend.quantize_int8(span_of(packed), const_span_of(v), l.runs, l.columns);
      check_same_bits(download(backend, packed), want, "quantize_int8" + what);
      DeviceBuffer<TestType> back = upload(backend, std::vector<TestType>(whole));
      backend.dequantize_int8(span_of(back), const_span_of(packed), l.runs);
      check_same_bits(download(backend, back), want_back, "dequantize_int8" + what);
      DeviceBuffer<TestType> sums = upload(backend, std::vector<TestType>(want_sums.size()));
      backend.sum_int8(span_of(sums), const_span_of(packed), factor, l.outputs);
      check_same_bits(download(backend, sums), want_sums, "sum_int8" + what);
    }
  }
}

TEMPLATE_TEST_CASE(
    "CudaBackend's int4 runs and their sums (qgZ at 4 bits) equal HostBackend bit for bit",
    "[cuda][engine]", float, bf16, f16) {
  CudaBackend backend;
  struct Layout {
    std::int64_t runs, columns, outputs;
  };
  for (const Layout l : {Layout{1, 1, 1}, Layout{8, 1, 1}, Layout{8, 2, 4}, Layout{6, 3, 2}}) {
    for (const std::size_t n : sizes) {
      const std::string what = " n=" + std::to_string(n) + " runs=" + std::to_string(l.runs) +
                               " columns=" + std::to_string(l.columns) +
                               " outputs=" + std::to_string(l.outputs);
      const auto whole = n * static_cast<std::size_t>(l.runs);
      const std::vector<TestType> values = inputs<TestType>(whole, 57, 0.1f);
      const auto packed_bytes =
          static_cast<std::size_t>(l.runs) *
          static_cast<std::size_t>(zero::quant::int4_packed_bytes(static_cast<std::int64_t>(n)));
      std::vector<std::uint8_t> want(packed_bytes);
      HostBackend::quantize_int4(std::span<std::uint8_t>(want), std::span<const TestType>(values),
                                 l.runs, l.columns);
      const float factor = static_cast<float>(l.outputs) / static_cast<float>(l.runs);
      std::vector<TestType> want_sums(n * static_cast<std::size_t>(l.outputs));
      HostBackend::sum_int4(std::span<TestType>(want_sums), std::span<const std::uint8_t>(want),
                            factor, l.outputs);

      const DeviceBuffer<TestType> v = upload(backend, values);
      DeviceBuffer<std::uint8_t> packed = upload(backend, std::vector<std::uint8_t>(packed_bytes));
      backend.quantize_int4(span_of(packed), const_span_of(v), l.runs, l.columns);
      check_same_bits(download(backend, packed), want, "quantize_int4" + what);
      DeviceBuffer<TestType> sums = upload(backend, std::vector<TestType>(want_sums.size()));
      backend.sum_int4(span_of(sums), const_span_of(packed), factor, l.outputs);
      check_same_bits(download(backend, sums), want_sums, "sum_int4" + what);
    }
  }
}

TEMPLATE_TEST_CASE(
    "CudaBackend's packing with error feedback (LoCo) equals HostBackend bit for bit, its kept "
    "errors too",
    "[cuda][engine]", float, bf16, f16) {
  CudaBackend backend;
  struct Layout {
    std::int64_t runs, columns;
  };
  for (const int bits : {8, 4}) {
    for (const Layout l : {Layout{1, 1}, Layout{8, 2}, Layout{6, 3}}) {
      for (const std::size_t n : sizes) {
        const std::string what = " bits=" + std::to_string(bits) + " n=" + std::to_string(n) +
                                 " runs=" + std::to_string(l.runs) +
                                 " columns=" + std::to_string(l.columns);
        const auto whole = n * static_cast<std::size_t>(l.runs);
        const auto run = static_cast<std::int64_t>(n);
        const auto packed_bytes =
            static_cast<std::size_t>(l.runs * (bits == 8 ? zero::quant::int8_packed_bytes(run)
                                                         : zero::quant::int4_packed_bytes(run)));
        const auto kept_bytes =
            static_cast<std::size_t>(l.runs * zero::quant::int8_packed_bytes(run));
        std::vector<std::uint8_t> want_kept(kept_bytes, 0);
        DeviceBuffer<std::uint8_t> kept = upload(backend, want_kept);
        const auto feedback = zero::quant::ErrorFeedback::with_beta(0.8f);
        for (int round = 0; round < 2; ++round) {  // the second packing reads the first's errors
          const std::vector<TestType> values =
              inputs<TestType>(whole, 61u + static_cast<std::uint32_t>(round), 0.1f);
          std::vector<std::uint8_t> want(packed_bytes);
          HostBackend::quantize_with_feedback(
              std::span<std::uint8_t>(want), std::span<const TestType>(values),
              std::span<std::uint8_t>(want_kept), feedback, bits, l.runs, l.columns);
          const DeviceBuffer<TestType> v = upload(backend, values);
          DeviceBuffer<std::uint8_t> packed =
              upload(backend, std::vector<std::uint8_t>(packed_bytes));
          backend.quantize_with_feedback(span_of(packed), const_span_of(v), span_of(kept), feedback,
                                         bits, l.runs, l.columns);
          check_same_bits(download(backend, packed), want, "quantize_with_feedback" + what);
          check_same_bits(download(backend, kept), want_kept, "kept errors" + what);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("CudaBackend packs a block of NaNs alone as HostBackend does: scale 0, codes 0",
                   "[cuda][engine]", float, bf16, f16) {
  // A run of 600: its first block (256) all NaN, the second with one NaN among finite values,
  // the last partial. The host's largest magnitude skips NaNs from 0; a reduction over fmaxf
  // gives NaN for a block of NaNs alone.
  CudaBackend backend;
  const std::size_t n = 600;
  std::vector<TestType> values = inputs<TestType>(n, 67, 0.1f);
  for (std::size_t i = 0; i < 256; ++i) values[i] = convert<TestType>(std::nanf(""));
  values[300] = convert<TestType>(std::nanf(""));
  const auto run = static_cast<std::int64_t>(n);
  const DeviceBuffer<TestType> v = upload(backend, values);
  for (const int bits : {8, 4}) {
    const std::string what = " bits=" + std::to_string(bits);
    const auto bytes = static_cast<std::size_t>(bits == 8 ? zero::quant::int8_packed_bytes(run)
                                                          : zero::quant::int4_packed_bytes(run));
    std::vector<std::uint8_t> want(bytes);
    DeviceBuffer<std::uint8_t> packed = upload(backend, std::vector<std::uint8_t>(bytes));
    if (bits == 8) {
      HostBackend::quantize_int8(std::span<std::uint8_t>(want), std::span<const TestType>(values));
      backend.quantize_int8(span_of(packed), const_span_of(v));
    } else {
      HostBackend::quantize_int4(std::span<std::uint8_t>(want), std::span<const TestType>(values),
                                 1, 1);
      backend.quantize_int4(span_of(packed), const_span_of(v), 1, 1);
    }
    check_same_bits(download(backend, packed), want, "quantize" + what);
    // With LoCo's error feedback (fresh kept errors: the compensated values are the inputs).
    const auto kept_bytes = static_cast<std::size_t>(zero::quant::int8_packed_bytes(run));
    std::vector<std::uint8_t> want_kept(kept_bytes, 0);
    DeviceBuffer<std::uint8_t> kept = upload(backend, want_kept);
    std::vector<std::uint8_t> want_fed(bytes);
    HostBackend::quantize_with_feedback(std::span<std::uint8_t>(want_fed),
                                        std::span<const TestType>(values),
                                        std::span<std::uint8_t>(want_kept),
                                        zero::quant::ErrorFeedback::with_beta(0.8f), bits, 1, 1);
    DeviceBuffer<std::uint8_t> fed = upload(backend, std::vector<std::uint8_t>(bytes));
    backend.quantize_with_feedback(span_of(fed), const_span_of(v), span_of(kept),
                                   zero::quant::ErrorFeedback::with_beta(0.8f), bits, 1, 1);
    check_same_bits(download(backend, fed), want_fed, "quantize_with_feedback" + what);
    check_same_bits(download(backend, kept), want_kept, "kept errors" + what);
  }
}

TEMPLATE_TEST_CASE("CudaBackend::clear equals HostBackend", "[cuda][engine]", float, bf16, f16) {
  CudaBackend backend;
  for (const std::size_t n : sizes) {
    std::vector<TestType> want = inputs<TestType>(n, 41);
    DeviceBuffer<TestType> v = upload(backend, want);
    HostBackend::clear(std::span<TestType>(want));
    backend.clear(span_of(v));
    check_same_bits(download(backend, v), want, "clear n=" + std::to_string(n));
  }
}

TEMPLATE_TEST_CASE("CudaBackend::sum_of_squares matches the host to 1e-12, +inf on Inf/NaN",
                   "[cuda][engine]", float, bf16, f16) {
  using E = TestType;
  CudaBackend backend;
  for (const std::size_t n : sizes) {
    const std::vector<E> v = zero::test::random_vector<E>(n, 51, -3.0f, 3.0f);
    double want = 0.0;
    if constexpr (std::is_same_v<E, float>) {
      want = HostBackend::sum_of_squares(std::span<const float>(v));
    } else {  // HostBackend sums f32 and f64 only: the exact squares in double, in order
      for (const E x : v) want += convert<double>(x) * convert<double>(x);
    }
    const DeviceBuffer<E> d = upload(backend, v);
    const double got = backend.sum_of_squares(const_span_of(d));
    INFO("n=" << n << " got " << got << " want " << want);
    CHECK(std::fabs(got - want) <= 1e-12 * std::fabs(want));

    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
    for (const float special : specials) {
      for (const std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
        std::vector<E> bad = v;
        bad[at] = convert<E>(special);
        const DeviceBuffer<E> dbad = upload(backend, bad);
        const double s = backend.sum_of_squares(const_span_of(dbad));
        INFO("special " << special << " at " << at);
        CHECK(s == std::numeric_limits<double>::infinity());
        if constexpr (std::is_same_v<E, float>) {
          CHECK(HostBackend::sum_of_squares(std::span<const float>(bad)) == s);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("CudaBackend::sum_of_squares_into writes sum_of_squares' value into a slot",
                   "[cuda][engine]", float, bf16) {
  // Offload<CPU> takes each unit's shard sum this way; the engine's norm then equals the one
  // without offload, which calls sum_of_squares on the same values.
  using E = TestType;
  CudaBackend backend;
  DeviceBuffer<double> slots = backend.make_buffer<double>(3);
  for (const std::size_t n : sizes) {
    std::vector<E> v = zero::test::random_vector<E>(n, 52, -3.0f, 3.0f);
    const DeviceBuffer<E> d = upload(backend, v);
    backend.sum_of_squares_into(std::span<double>(slots.data() + 1, 1), const_span_of(d));
    const std::vector<double> got = download(backend, slots);
    INFO("n=" << n);
    CHECK(got[0] == 0.0);
    CHECK(got[1] == backend.sum_of_squares(const_span_of(d)));
    CHECK(got[2] == 0.0);
    v[n / 2] = convert<E>(std::numeric_limits<float>::infinity());
    const DeviceBuffer<E> dbad = upload(backend, v);
    backend.sum_of_squares_into(std::span<double>(slots.data() + 1, 1), const_span_of(dbad));
    CHECK(!std::isfinite(download(backend, slots)[1]));
    CHECK_THROWS_AS(backend.sum_of_squares_into(std::span<double>(), const_span_of(d)),
                    zero::ShapeError);
  }
  backend.sum_of_squares_into(std::span<double>(slots.data(), 1), std::span<const E>());
  CHECK(download(backend, slots)[0] == 0.0);
}

namespace {

// A kernel on `producer` blocks until the host releases it, then writes 1..n; a copy on
// `consumer` (copy(backend, dst, src)) issued after order(backend) must wait for it and see those
// values, and the same copy without order() (the negative control) must read the zeros from
// before. The order is decided by the event alone, not by timing.
template <class Order, class Copy>
void check_copy_order(CudaBackend& backend, CudaBackend::Stream& producer,
                      CudaBackend::Stream& consumer, Order&& order, Copy&& copy, const char* what) {
  if (HeldKernel::launches_serialised()) {
    WARN("CUDA_LAUNCH_BLOCKING=1 serialises launches: stream-ordering test skipped");
    return;
  }
  constexpr int n = 4099;
  HeldKernel held(producer);
  CudaBackend::PinnedBuffer<float> seen(n, zero::CudaPinnedHost::default_alignment, consumer);
  DeviceBuffer<float> written = backend.make_buffer<float>(n);
  backend.compute_stream().synchronize();

  auto run = [&](bool ordered) {
    held.hold();
    // Zeroed before the run starts, so an unordered copy reads zeros, not the last run's values.
    ZERO_CUDA_CHECK(cudaMemsetAsync(written.data(), 0, written.bytes(), producer.native()));
    producer.synchronize();
    held.launch(producer, written.data(), n);
    if (ordered) order(backend);
    copy(backend, std::span<float>(seen.data(), n), std::span<const float>(written.data(), n));
    if (ordered) {
      // The copy cannot have run: the kernel it waits for is still blocked.
      CHECK(cudaStreamQuery(consumer.native()) == cudaErrorNotReady);
      held.release();
      consumer.synchronize();
    } else {
      consumer.synchronize();  // nothing orders it after the blocked kernel
      held.release();
    }
    producer.synchronize();
    return std::vector<float>(seen.data(), seen.data() + n);
  };

  INFO(what);
  std::vector<float> want(n);
  for (int i = 0; i < n; ++i) want[static_cast<std::size_t>(i)] = static_cast<float>(i + 1);
  check_same_bits(run(true), want, "the copy ordered after the kernel");
  check_same_bits(run(false), std::vector<float>(n, 0.0f), "the copy without the event");
}

// check_copy_order with a plain cudaMemcpyAsync on `consumer`.
template <class Order>
void check_stream_order(CudaBackend& backend, CudaBackend::Stream& producer,
                        CudaBackend::Stream& consumer, Order&& order, const char* what) {
  check_copy_order(
      backend, producer, consumer, std::forward<Order>(order),
      [&consumer](CudaBackend&, std::span<float> dst, std::span<const float> src) {
        ZERO_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(),
                                        cudaMemcpyDeviceToHost, consumer.native()));
      },
      what);
}

}  // namespace

TEST_CASE("comm_waits_for_compute orders a comm-stream copy after a compute kernel",
          "[cuda][engine]") {
  CudaBackend backend;
  check_stream_order(
      backend, backend.compute_stream(), backend.comm_stream(),
      [](CudaBackend& b) { b.comm_waits_for_compute(); }, "comm waits for compute");
}

TEST_CASE("comm_copy_async copies on the comm stream, after compute once ordered",
          "[cuda][engine]") {
  // Offload<CPU> folds a gradient shard into device staging on the compute stream and copies it
  // down into pinned memory with comm_copy_async: the copy must be on the comm stream (the
  // consumer synchronised below) and wait for the fold only through comm_waits_for_compute.
  CudaBackend backend;
  check_copy_order(
      backend, backend.compute_stream(), backend.comm_stream(),
      [](CudaBackend& b) { b.comm_waits_for_compute(); },
      [](CudaBackend& b, std::span<float> dst, std::span<const float> src) {
        b.comm_copy_async(dst, src);
      },
      "comm_copy_async after comm waits for compute");
  auto device = backend.make_buffer<float>(8);
  CudaBackend::PinnedBuffer<float> host(4, zero::CudaPinnedHost::default_alignment,
                                        backend.compute_stream());
  CHECK_THROWS_AS(backend.comm_copy_async(std::span<float>(host.data(), 4),
                                          std::span<const float>(device.data(), 8)),
                  zero::ShapeError);
}

TEST_CASE("compute_waits_for_comm orders a compute-stream copy after a comm kernel",
          "[cuda][engine]") {
  // What a gather or a reduction on the comm stream writes, the units and the optimizer read on
  // the compute stream.
  CudaBackend backend;
  check_stream_order(
      backend, backend.comm_stream(), backend.compute_stream(),
      [](CudaBackend& b) { b.compute_waits_for_comm(); }, "compute waits for comm");
}

TEST_CASE("compute_waits_for_comm_copies orders compute after the comm stream's copies only",
          "[cuda][engine]") {
  // Offload<CPU>'s copies down go on the comm stream between collectives, and the engine orders
  // compute after the copies alone. A kernel on comm that blocks until the host releases it
  // stands for the work before a copy (which compute then waits for), and for a collective
  // issued after the last copy (which must not hold compute back).
  if (HeldKernel::launches_serialised()) {
    WARN("CUDA_LAUNCH_BLOCKING=1 serialises launches: stream-ordering test skipped");
    return;
  }
  CudaBackend backend;
  constexpr int n = 1000;
  HeldKernel held(backend.compute_stream());
  CudaBackend::PinnedBuffer<float> seen(n, zero::CudaPinnedHost::default_alignment,
                                        backend.compute_stream());
  DeviceBuffer<float> written = backend.make_buffer<float>(n),
                      staged = backend.make_buffer<float>(n),
                      blocked = backend.make_buffer<float>(n);
  backend.compute_stream().synchronize();
  std::vector<float> want(n);
  for (int i = 0; i < n; ++i) want[static_cast<std::size_t>(i)] = static_cast<float>(i + 1);

  // Ordered: the blocked kernel, the copy after it, compute after the copy.
  held.hold();
  held.launch(backend.comm_stream(), written.data(), n);
  backend.comm_copy_async(std::span<float>(staged.data(), n),
                          std::span<const float>(written.data(), n));
  backend.compute_waits_for_comm_copies();
  ZERO_CUDA_CHECK(cudaMemcpyAsync(seen.data(), staged.data(), n * sizeof(float),
                                  cudaMemcpyDeviceToHost, backend.compute_stream().native()));
  CHECK(cudaStreamQuery(backend.compute_stream().native()) == cudaErrorNotReady);
  held.release();
  backend.compute_stream().synchronize();
  check_same_bits(std::vector<float>(seen.data(), seen.data() + n), want,
                  "compute after comm_copy_async");

  // Not ordered after what comm was given since the last copy.
  held.hold();
  backend.comm_copy_async(std::span<float>(staged.data(), n),
                          std::span<const float>(written.data(), n));
  held.launch(backend.comm_stream(), blocked.data(), n);
  backend.compute_waits_for_comm_copies();
  backend.clear(std::span<float>(staged.data(), n));  // compute's next work
  // Compute finishes while the kernel after the copy is still blocked (polled up to 10 s).
  cudaError_t compute_state = cudaErrorNotReady;
  for (int i = 0; i < 10000 && compute_state == cudaErrorNotReady; ++i) {
    compute_state = cudaStreamQuery(backend.compute_stream().native());
    if (compute_state == cudaErrorNotReady) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  const cudaError_t comm_state = cudaStreamQuery(backend.comm_stream().native());
  held.release();
  backend.comm_stream().synchronize();
  CHECK(compute_state == cudaSuccess);
  CHECK(comm_state == cudaErrorNotReady);
}

TEST_CASE("CudaBackend::free_device_bytes reports the device's free memory, and a buffer takes it",
          "[cuda][engine]") {
  CudaBackend backend;
  std::size_t free = 0, total = 0;
  ZERO_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const std::optional<std::size_t> reported = backend.free_device_bytes();
  REQUIRE(reported.has_value());
  CHECK(*reported > 0);
  CHECK(*reported <= total);
}

TEST_CASE("CudaBackend::make_buffer: zeroed pool memory ordered on the compute stream",
          "[cuda][engine]") {
  CudaBackend backend;
  DeviceBuffer<float> b = backend.make_buffer<float>(5000);
  CHECK(&b.stream() == &backend.compute_stream());
  cudaPointerAttributes attributes{};
  ZERO_CUDA_CHECK(cudaPointerGetAttributes(&attributes, b.data()));
  CHECK(attributes.type == cudaMemoryTypeDevice);
  std::vector<float> host(5000, 1.0f);
  ZERO_CUDA_CHECK(cudaMemcpyAsync(host.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost,
                                  backend.compute_stream().native()));
  backend.compute_stream().synchronize();
  check_same_bits(host, std::vector<float>(5000, 0.0f), "make_buffer zero-fills");
}

TEST_CASE("CudaBackend buffers: pool memory on the compute stream, page-locked host memory",
          "[cuda][engine]") {
  CudaBackend backend;
  DeviceBuffer<float> d(1000, zero::Cuda::default_alignment, backend.compute_stream());
  CudaBackend::PinnedBuffer<float> p(1000, zero::CudaPinnedHost::default_alignment,
                                     backend.compute_stream());
  cudaPointerAttributes attributes{};
  ZERO_CUDA_CHECK(cudaPointerGetAttributes(&attributes, d.data()));
  CHECK(attributes.type == cudaMemoryTypeDevice);
  ZERO_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p.data()));
  CHECK(attributes.type == cudaMemoryTypeHost);
  // Both start zeroed; a device write reaches the pinned buffer by a stream-ordered copy.
  CHECK(p.data()[999] == 0.0f);
  std::vector<float> ones(1000, 1.0f);
  ZERO_CUDA_CHECK(cudaMemcpyAsync(d.data(), ones.data(), d.bytes(), cudaMemcpyHostToDevice,
                                  backend.compute_stream().native()));
  backend.scale(span_of(d), 3.0);
  zero::CudaPinnedHost::copy(p.data(), d.data(), d.bytes(), backend.compute_stream());
  backend.compute_stream().synchronize();
  CHECK(p.data()[0] == 3.0f);
  CHECK(p.data()[999] == 3.0f);
}

TEST_CASE("CudaBackend gives the layers device kernels on its compute stream and device arenas",
          "[cuda][engine]") {
  CudaBackend backend;
  const std::unique_ptr<zero::nn::Kernels<bf16>> kernels = backend.make_layer_kernels<bf16>();
  REQUIRE(kernels != nullptr);
  CHECK(kernels->device() == zero::DeviceKind::cuda);
  const auto* cuda_kernels = dynamic_cast<const zero::nn::CudaKernels<bf16>*>(kernels.get());
  REQUIRE(cuda_kernels != nullptr);
  CHECK(cuda_kernels->stream() == backend.compute_stream().native());

  const std::unique_ptr<zero::BumpArena> arena = backend.make_arena(1 << 20, "activations");
  CHECK(arena->device() == zero::DeviceKind::cuda);
  CHECK(arena->capacity_bytes() == (1 << 20));
  const zero::Tensor<std::int32_t> ids = arena->allocate<std::int32_t>({64});
  cudaPointerAttributes attributes{};
  ZERO_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ids.data()));
  CHECK(attributes.type == cudaMemoryTypeDevice);

  // A micro-batch's tokens and targets go into the arena, in device memory, on the set's stream.
  std::vector<std::int32_t> tokens(64), targets(64);
  for (int i = 0; i < 64; ++i) {
    tokens[static_cast<std::size_t>(i)] = i;
    targets[static_cast<std::size_t>(i)] = 63 - i;
  }
  const zero::engine::MicroBatch batch{tokens.data(), targets.data(), 4, 16};
  const zero::nn::StepContext<bf16> ctx = batch.context<bf16>(*arena, true, 0, kernels.get());
  REQUIRE(ctx.tokens != tokens.data());
  std::vector<std::int32_t> got(64);
  backend.compute_stream().synchronize();
  ZERO_CUDA_CHECK(
      cudaMemcpy(got.data(), ctx.tokens, 64 * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  CHECK(got == tokens);
  ZERO_CUDA_CHECK(
      cudaMemcpy(got.data(), ctx.targets, 64 * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  CHECK(got == targets);
}

TEST_CASE("CudaBackend copies between host and device memory for the engine", "[cuda][engine]") {
  CudaBackend backend;
  auto device = backend.make_buffer<float>(1000);
  std::vector<float> values(1000), back(1000, -1.0f);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  backend.copy_from_host(std::span<float>(device.data(), 1000), std::span<const float>(values));
  values.assign(1000, 7.0f);  // the source may be reused once the call returns
  backend.copy_to_host(std::span<float>(back), std::span<const float>(device.data(), 1000));
  for (std::size_t i = 0; i < back.size(); ++i) REQUIRE(back[i] == static_cast<float>(i) * 0.5f);
  CHECK_THROWS_AS(backend.copy_to_host(std::span<float>(back).first(10),
                                       std::span<const float>(device.data(), 1000)),
                  zero::ShapeError);
}
