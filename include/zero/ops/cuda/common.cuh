#pragma once
// zero-requires: cuda
// What every kernel in zero::ops::cuda shares: the element rule "store in T, compute in float"
// (the host kernels' rule, through zero::convert, so rounding is the one in core/bfloat16.hpp and
// core/float16.hpp), launch sizing, block-wide reductions over CUB, and stream-ordered scratch
// memory from the device's pool.
// Device kernels take f32, bf16 and f16 storage (f64 stays on the host).
#if !defined(__CUDACC__)
#error \
    "zero/ops/cuda/common.cuh needs nvcc; host-only code includes zero/ops/cpu/element_access.hpp"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

#include <zero/core/cuda_check.cuh>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::ops::cuda {

// ---- element access -----------------------------------------------------------------------------

/// True for the storage types the device kernels accept.
template <class T>
inline constexpr bool is_device_float =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

/// Widens a stored element to float (exact); the device twin of cpu::load.
template <class T>
__host__ __device__ __forceinline__ float load(T x) {
  return ::zero::convert<float>(x);
}

/// Rounds a float result to the storage type once (nearest even); the twin of cpu::store. On the
/// device, bf16 and f16 take the hardware's conversion (cvt.rn: IEEE round to nearest, ties to
/// even, subnormals kept, overflow to infinity) for every value but NaN, whose bits come from
/// nan_bits (the host keeps the payload's top bits; the hardware makes a canonical NaN). The
/// rounding rule is core/bfloat16.hpp's and core/float16.hpp's, bit for bit for every float
/// (convert_elements, whose tests compare with the host's bits, converts through here): 4
/// instructions an element in sm_90 SASS (the conversion, the NaN test and bits, a select)
/// where the bit manipulation took 7, issue slots that memory-bound kernels writing bf16 need.
template <class T>
__host__ __device__ __forceinline__ T store(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, bf16>) {
    const std::uint16_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    return bf16::from_bits(isnan(x) ? bf16::nan_bits(x) : bits);  // a select, not a branch
  } else if constexpr (std::is_same_v<T, f16>) {
    const std::uint16_t bits = __half_as_ushort(__float2half_rn(x));
    return f16::from_bits(isnan(x) ? f16::nan_bits(x) : bits);
  }
#endif
  return ::zero::convert<T>(x);
}

// ---- 16-byte packs
// -------------------------------------------------------------------------------

/// Elements of T in 16 bytes: one vector load or store (8 bf16/f16, 4 float).
template <class T>
inline constexpr int pack_size = static_cast<int>(16 / sizeof(T));

/// pack_size<T> elements loaded or stored at once; the elementwise kernels read and write through
/// it when every pointer is 16-byte aligned (a scalar loop takes the tail).
template <class T>
struct alignas(16) Pack {
  T v[pack_size<T>];
};

/// P consecutive elements of T as whole 16-byte packs (P a multiple of pack_size<T>): the unit a
/// kernel reads and writes when its operands have different widths (4 floats to a pack, 8 bf16).
template <class T, int P>
struct Chunk {
  static_assert(P % pack_size<T> == 0, "Chunk: P must be a whole number of packs");
  Pack<T> packs[P / pack_size<T>];
  __device__ __forceinline__ T& operator[](int k) {
    return packs[k / pack_size<T>].v[k % pack_size<T>];
  }
  __device__ __forceinline__ const T& operator[](int k) const {
    return packs[k / pack_size<T>].v[k % pack_size<T>];
  }
};

/// Elements per chunk of a kernel over the types Ts: the largest pack among them, so every
/// operand moves whole 16-byte packs (8 for bf16 with float: one bf16 pack, two float packs).
template <class... Ts>
inline constexpr int chunk_size = std::max({pack_size<Ts>...});

/// Chunked map, grid-stride: for each whole chunk c (elements [c P, c P + P) of n),
/// out's chunk = chunk_op(c P, in's chunks...) read and written as 16-byte packs, then
/// out[i] = element_op(i, in[i]...) for the tail; every pointer must be 16-byte aligned.
/// chunk_op returns a Chunk<T, P>; element_op a T. out may alias an input.
template <int P, class T, class ChunkOp, class ElementOp, class... In>
__device__ __forceinline__ void map_chunks(T* out, std::int64_t n, const ChunkOp& chunk_op,
                                           const ElementOp& element_op, const In*... in) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t chunks = n / P;
  for (std::int64_t c = first; c < chunks; c += stride) {
    reinterpret_cast<Chunk<T, P>*>(out)[c] =
        chunk_op(c * P, reinterpret_cast<const Chunk<In, P>*>(in)[c]...);
  }
  for (std::int64_t i = chunks * P + first; i < n; i += stride) out[i] = element_op(i, in[i]...);
}

/// out[i] = op(in[i]...) for i < n, grid-stride (out may alias an input). Packed: every pointer
/// is 16-byte aligned, and whole chunks of chunk_size<T, In...> elements move as 16-byte packs;
/// the tail goes one element at a time. op maps the inputs' elements to a T.
template <class T, bool Packed, class Op, class... In>
__device__ __forceinline__ void map_elements(T* out, std::int64_t n, const Op& op,
                                             const In*... in) {
  const auto element_op = [&](std::int64_t, const In&... values) { return op(values...); };
  if constexpr (Packed) {
    constexpr int P = chunk_size<T, In...>;
    const auto chunk_op = [&](std::int64_t, const Chunk<In, P>&... values) {
      Chunk<T, P> result;
#pragma unroll
      for (int k = 0; k < P; ++k) result[k] = op(values[k]...);
      return result;
    };
    map_chunks<P>(out, n, chunk_op, element_op, in...);
  } else {
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
    const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
    for (std::int64_t i = first; i < n; i += stride) out[i] = op(in[i]...);
  }
}

/// True when every pointer is 16-byte aligned.
inline bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

/// Packs per lane (1, 2, 4 or 8, the counts with_lane_packs compiles) a kernel that holds a row of
/// packs 16-byte packs in the registers of lanes threads needs, or 0 when that is over 8.
inline int lane_packs_for(std::int64_t packs, std::int64_t lanes) {
  const std::int64_t per_lane = (packs + lanes - 1) / lanes;
  for (int n : {1, 2, 4, 8}) {
    if (per_lane <= n) return n;
  }
  return 0;
}

/// Calls fn(k, i) for each of the Packs packs i = lane + lanes k of a row of packs that this lane
/// holds (i < packs): a warp's lanes (lanes 32) or a block's threads (lanes blockDim.x).
template <int Packs, class Fn>
__device__ __forceinline__ void for_lane_packs(int lane, int packs, Fn&& fn, int lanes = 32) {
#pragma unroll
  for (int k = 0; k < Packs; ++k) {
    const int i = lane + lanes * k;
    if (i < packs) fn(k, i);
  }
}

/// Calls fn(std::integral_constant<int, Packs>{}) for Packs = packs in {1, 2, 4, 8} and returns
/// true; false for any other count (the caller's kernels that hold no row take it).
template <class Fn>
bool with_lane_packs(int packs, Fn&& fn) {
  switch (packs) {
    case 1:
      fn(std::integral_constant<int, 1>{});
      return true;
    case 2:
      fn(std::integral_constant<int, 2>{});
      return true;
    case 4:
      fn(std::integral_constant<int, 4>{});
      return true;
    case 8:
      fn(std::integral_constant<int, 8>{});
      return true;
    default:
      return false;
  }
}

// ---- launch sizing ------------------------------------------------------------------------------

/// The most dynamic shared memory a block may opt in to on the current device
/// (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KiB on sm_90, 163 on sm_80, 99 on sm_86/sm_89),
/// asked once per device.
inline std::size_t shared_bytes_optin() {
  int device = 0;
  ZERO_CUDA_CHECK(cudaGetDevice(&device));
  constexpr int remembered = 64;
  static std::array<std::atomic<int>, remembered> asked{};  // 0: not asked yet
  if (device < remembered) {
    if (const int bytes = asked[device].load(std::memory_order_relaxed); bytes != 0) return bytes;
  }
  int bytes = 0;
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (device < remembered) asked[device].store(bytes, std::memory_order_relaxed);
  return static_cast<std::size_t>(bytes);
}

/// Threads per block of the elementwise kernels.
inline constexpr int elementwise_threads = 256;

/// Blocks for n elements at threads per block, capped for a grid-stride loop.
inline unsigned grid_for(std::int64_t n, int threads = elementwise_threads) {
  const std::int64_t blocks = (n + threads - 1) / threads;
  constexpr std::int64_t cap = 65535LL * 16;  // enough to fill any GPU; the loop does the rest
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

/// Throws ShapeError naming op when a size does not fit the int the kernels index with.
inline void expect_int_range(std::int64_t n, const char* op) {
  expect<ShapeError>(n >= 0 && n <= 0x7fffffffLL, op, ": size ", n,
                     " is outside [0, 2^31); split the call");
}

// ---- warp and block reductions ------------------------------------------------------------------

/// All lanes of a full warp get the sum of v.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

/// All lanes of a full warp get the maximum of v.
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

/// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; results below the normal range
/// are 0; 2^-inf is 0). The softmax kernels of bf16 and f16 take exp(x - m) as
/// exp2_approx(x log2e - m log2e), the subtraction folded into one multiply-add (FlashAttention-2's
/// form): expf's accurate expansion costs about ten float instructions an element.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
inline constexpr float log2e = 1.4426950408889634f;

/// Maximum for cub::BlockReduce (CCCL 3 dropped cub::Max).
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// Every thread of the block gets cub::BlockReduce<float, Threads>'s reduction of v by op. Safe to
/// call repeatedly: the trailing barrier protects the shared storage of the next call.
template <int Threads, class Op>
__device__ __forceinline__ float block_all_reduce(float v, Op op) {
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float result;
  const float r = Reduce(temp).Reduce(v, op);
  if (threadIdx.x == 0) result = r;
  __syncthreads();
  const float out = result;
  __syncthreads();
  return out;
}

/// Sum for block_all_reduce.
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// ---- scratch memory -----------------------------------------------------------------------------

/// bytes from the device's default pool (cudaMallocAsync) ordered on stream (null for 0); an
/// OutOfMemoryError naming who when the pool cannot give them.
inline void* allocate_async(std::size_t bytes, cudaStream_t stream, const char* who) {
  void* p = nullptr;
  if (bytes == 0) return p;
  const cudaError_t status = cudaMallocAsync(&p, bytes, stream);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not the next kernel check's error: the caller may recover
    raise<OutOfMemoryError>(who, ": out of device memory allocating ", bytes, " bytes");
  }
  ZERO_CUDA_CHECK(status);
  return p;
}

/// Stream-ordered scratch from the device's default pool (cudaMallocAsync), returned to the pool
/// on the same stream when it goes out of scope: safe for kernels queued on that stream before.
class DeviceScratch {
 public:
  /// bytes of scratch (none for 0), ordered on stream.
  DeviceScratch(std::size_t bytes, cudaStream_t stream)
      : data_(allocate_async(bytes, stream, "ops::cuda scratch")), stream_(stream) {}
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  /// Takes other's memory (other is left empty).
  DeviceScratch(DeviceScratch&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), stream_(other.stream_) {}
  DeviceScratch& operator=(DeviceScratch&&) = delete;
  ~DeviceScratch() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  /// The memory as U*.
  template <class U>
  U* as() const {
    return static_cast<U*>(data_);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace zero::ops::cuda
