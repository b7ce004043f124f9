// The Cuda device, Buffer/Arena on it, streams and events, and the 16-bit conversions on the
// device: the same header code must give the same bits on host and device, and match CUDA's own
// round-to-nearest conversions.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <catch2/catch.hpp>

#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/cuda_device.cuh>
#include <zero/core/cuda_types.cuh>
#include <zero/core/dtype.hpp>

using namespace zero;

namespace {

__global__ void convert_on_device(const float* in, std::uint16_t* ours_bf16,
                                  std::uint16_t* cuda_bf16, std::uint16_t* ours_f16,
                                  std::uint16_t* cuda_f16, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  ours_bf16[i] = bf16::round_nearest_even(in[i]);
  cuda_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  ours_f16[i] = f16::round_nearest_even(in[i]);
  cuda_f16[i] = __half_as_ushort(__float2half_rn(in[i]));
}

__global__ void widen_on_device(float* bf16_out, float* f16_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  bf16_out[i] = bf16::to_float(static_cast<std::uint16_t>(i));
  f16_out[i] = f16::to_float(static_cast<std::uint16_t>(i));
}

__global__ void add_one(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}

template <class T>
std::vector<T> to_host(const Buffer<T, Cuda>& b) {
  std::vector<T> h(b.size());
  ZERO_CUDA_CHECK(cudaMemcpy(h.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

bool same_bits(float a, float b) {
  std::uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

}  // namespace

TEST_CASE("16-bit conversions give the same bits on host and device", "[cuda][dtype]") {
  std::vector<float> in;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    in.push_back(bf16::to_float(static_cast<std::uint16_t>(b)));
    in.push_back(f16::to_float(static_cast<std::uint16_t>(b)));
  }
  for (std::uint32_t b = 0; b < (1u << 22); ++b) in.push_back(std::bit_cast<float>(b * 1021u + 7u));
  const int n = static_cast<int>(in.size());
  Buffer<float, Cuda> d_in(in.size());
  Buffer<std::uint16_t, Cuda> a(in.size()), b(in.size()), c(in.size()), d(in.size());
  ZERO_CUDA_CHECK(cudaMemcpy(d_in.data(), in.data(), d_in.bytes(), cudaMemcpyHostToDevice));
  convert_on_device<<<(n + 255) / 256, 256>>>(d_in.data(), a.data(), b.data(), c.data(), d.data(),
                                              n);
  ZERO_CUDA_CHECK(cudaGetLastError());
  const auto ours_bf = to_host(a), cuda_bf = to_host(b), ours_h = to_host(c), cuda_h = to_host(d);
  std::int64_t host_mismatch = 0, cuda_mismatch = 0;
  for (int i = 0; i < n; ++i) {
    host_mismatch += ours_bf[i] != bf16::round_nearest_even(in[i]);
    host_mismatch += ours_h[i] != f16::round_nearest_even(in[i]);
    if (in[i] == in[i]) {  // CUDA's NaN payloads differ from ours; both are NaN
      cuda_mismatch += ours_bf[i] != cuda_bf[i];
      cuda_mismatch += ours_h[i] != cuda_h[i];
    }
  }
  CHECK(host_mismatch == 0);
  CHECK(cuda_mismatch == 0);

  Buffer<float, Cuda> wide_bf(65536), wide_h(65536);
  widen_on_device<<<256, 256>>>(wide_bf.data(), wide_h.data());
  ZERO_CUDA_CHECK(cudaGetLastError());
  const auto wb = to_host(wide_bf), wh = to_host(wide_h);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    REQUIRE(same_bits(wb[i], bf16::to_float(static_cast<std::uint16_t>(i))));
    REQUIRE(same_bits(wh[i], f16::to_float(static_cast<std::uint16_t>(i))));
  }
}

TEST_CASE("Buffer and Arena on the Cuda device, ordered by streams and events", "[cuda]") {
  CudaStream stream;
  Buffer<float, Cuda> x(1 << 20, Cuda::default_alignment, stream);
  stream.synchronize();
  auto h = to_host(x);
  CHECK(std::count(h.begin(), h.end(), 0.0f) == static_cast<long>(h.size()));  // zero-filled

  add_one<<<(1 << 20) / 256, 256, 0, stream.native()>>>(x.data(), 1 << 20);
  CudaEvent done;
  done.record(stream);
  CudaStream other;
  done.wait_on(other);  // other sees the kernel's result without a host sync
  std::vector<float> back(1 << 20);
  Cuda::copy(back.data(), x.data(), x.bytes(), other);
  other.synchronize();
  CHECK(done.ready());
  CHECK(std::count(back.begin(), back.end(), 1.0f) == (1 << 20));

  Arena<Cuda> arena(1 << 16, "device scratch");
  auto t = arena.allocate<bf16>({64, 64});
  CHECK(t.device() == DeviceKind::cuda);
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 256 == 0);
  CHECK_THROWS_AS(arena.allocate<float>({1 << 16}), OutOfMemoryError);
  CHECK_THROWS_AS(t.at(0), ShapeError);  // host element access refuses device memory
}

TEST_CASE("CUDA errors become zero::CudaError naming the call", "[cuda]") {
  CHECK_THROWS_AS(ZERO_CUDA_CHECK(cudaSetDevice(1 << 20)), CudaError);
  CHECK_THROWS_WITH(ZERO_CUDA_CHECK(cudaSetDevice(1 << 20)), Catch::Contains("cudaSetDevice"));
  cudaGetLastError();  // clear the sticky-free error state for later tests
  CHECK_THROWS_AS((Buffer<float, Cuda>(std::size_t{1} << 45)), OutOfMemoryError);
  // The failed allocation leaves no error behind for the next kernel launch's check to report
  // as its own (a caller may recover from the OutOfMemoryError with a smaller buffer).
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  cudaGetLastError();
}
