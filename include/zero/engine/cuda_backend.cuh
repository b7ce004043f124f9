#pragma once
// zero-requires: cuda
// CudaBackend: the device seam of backend.hpp on one CUDA device, and the backend Compute<Cuda>
// names once this header is included (backend_for<Cuda> below; include it before anything
// instantiates backend_t<Cuda>, or the primary template's static_assert fires).
//
// One backend per rank. It owns two non-blocking streams: the compute stream (the units' kernels
// and the flow's own element-wise kernels) and the communication stream (collectives), so a
// unit's reduce-scatter can overlap the next unit's backward and a stage-3 gather can run ahead
// of its use. comm_waits_for_compute() orders them with an event, never with a host wait.
//
// Every element-wise kernel runs on the compute stream: each reads or writes what the units'
// kernels produce or consume there (gradients, accumulators, master slices rounded for a
// gather), so stream order alone makes them safe; they are members (not static, as HostBackend's
// are) because they need that stream. Work the comm stream writes and compute then reads (a
// reduced shard folded into the fp32 shard, gathered params) still needs the opposite ordering.
// Of the element-wise calls only sum_of_squares, which returns its value, synchronises the host;
// so do the copies from and to pageable host memory, host_waits_for_compute, and a pinned
// buffer's zero-fill and free.
//
// Rounding equals HostBackend's bit for bit: accumulate adds convert<A>(g) (factor 1) or
// convert<A>(convert<double>(g) * factor) (the product in double, rounded through zero::convert),
// convert_into is zero::convert, scale rounds the double product once. sum_of_squares sums the
// exact double squares in CUB's order (ops/cuda/reduce.cuh): equal to the host's to double
// rounding, not bit for bit, and +inf when any element is Inf or NaN.
//
// Buffers: DeviceBuffer<E> is Buffer<E, Cuda> (the device's stream-ordered pool), ordered on the
// stream given at construction. A buffer the backend's streams use must be allocated and freed
// on compute_stream() (Buffer(n, Cuda::default_alignment, backend.compute_stream())): the legacy
// default stream that Buffer uses otherwise does not order against non-blocking streams. Such
// buffers must also be freed before the backend (its streams) is destroyed.
#if !defined(__CUDACC__)
#error "zero/engine/cuda_backend.cuh needs nvcc; host-only code uses HostBackend (backend.hpp)"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include <optim/cuda/fused_executor.cuh>
#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/cuda_pinned_host.cuh>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/backend.hpp>
#include <zero/nn/cuda_kernels.cuh>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/convert.cuh>
#include <zero/ops/cuda/error_feedback.cuh>
#include <zero/ops/cuda/int4_blocks.cuh>
#include <zero/ops/cuda/int8_blocks.cuh>
#include <zero/ops/cuda/reduce.cuh>

namespace zero::engine {

namespace cuda_backend_detail {

/// acc[i] += convert<A>(g[i]) (Start: acc[i] = A{} + ..., acc not read), grid-stride:
/// HostBackend::accumulate's factor-1 loop.
template <class A, class G, Fold F>
__global__ void accumulate_kernel(A* acc, const G* g, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    acc[i] = (F == Fold::add ? acc[i] : A{}) + ::zero::convert<A>(g[i]);
  }
}

/// acc[i] += convert<A>(convert<double>(g[i]) * factor): the product in double, rounded once.
template <class A, class G, Fold F>
__global__ void accumulate_scaled_kernel(A* acc, const G* g, double factor, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    acc[i] = (F == Fold::add ? acc[i] : A{}) +
             ::zero::convert<A>(::zero::convert<double>(g[i]) * factor);
  }
}

/// v[i] = E(v[i] * factor) with the product in double, as HostBackend::scale.
template <class E>
__global__ void scale_kernel(E* v, double factor, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    v[i] = static_cast<E>(static_cast<double>(v[i]) * factor);
  }
}

/// v[i] = E{} (all-zero bits for zero's element types), grid-stride.
template <class E>
__global__ void clear_kernel(E* v, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    v[i] = E{};
  }
}

/// The current device after checking that one is visible and that this program has kernels for
/// its architecture; CudaError naming what is missing.
inline int require_device() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // leave no error behind for the next runtime call
    raise<CudaError>(
        "zero::engine::CudaBackend (Compute<Cuda>): no CUDA device is visible "
        "(cudaGetDeviceCount: ",
        status == cudaSuccess ? "0 devices" : cudaGetErrorString(status),
        "); it needs an NVIDIA GPU and a working driver (check nvidia-smi and "
        "CUDA_VISIBLE_DEVICES), or use Compute<Host>");
  }
  int device = 0;
  ZERO_CUDA_CHECK(cudaGetDevice(&device));
  // An architecture this program was not compiled for has no image of its kernels: say so now,
  // rather than at the first launch (cudaErrorNoKernelImageForDevice) in the middle of a step.
  cudaFuncAttributes attributes{};
  const cudaError_t image = cudaFuncGetAttributes(&attributes, clear_kernel<float>);
  if (image != cudaSuccess) {
    (void)cudaGetLastError();
    cudaDeviceProp prop{};
    const bool named = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
    raise<CudaError>("zero::engine::CudaBackend (Compute<Cuda>): device ", device, " (",
                     named ? prop.name : "unknown", ", compute capability ",
                     named ? std::to_string(prop.major) + "." + std::to_string(prop.minor) : "?",
                     ") runs none of this program's kernels (", cudaGetErrorString(image),
                     "): it was compiled for other architectures; add this one to "
                     "CUDA_ARCHITECTURES (zero builds for 80;90: A100, H100 and later)");
  }
  return device;
}

}  // namespace cuda_backend_detail

/// The CUDA backend: pool-allocated device buffers, page-locked host buffers, a compute and a
/// communication stream ordered by events, and the flow's element-wise kernels on the device.
class CudaBackend {
 public:
  using Device = Cuda;
  /// A buffer the units compute on: device memory from the stream-ordered pool.
  template <class E>
  using DeviceBuffer = Buffer<E, Cuda>;
  /// Page-locked host memory, which device copies reach by DMA without staging.
  template <class E>
  using PinnedBuffer = Buffer<E, CudaPinnedHost>;
  using Stream = CudaStream;
  using Event = CudaEvent;
  /// Where the model's units find their kernels.
  static constexpr DeviceKind kernels = DeviceKind::cuda;
  /// NcclComm moves device memory only, so the engine's collectives on host values (statistics,
  /// checkpoint sizes and text) are staged through device buffers (HostValueComm).
  static constexpr bool comm_reads_host_memory = false;

  /// Two streams on the current device; CudaError when no device is visible (never a host
  /// fallback).
  CudaBackend() {
    Cuda::keep_pool_memory();  // unit buffers and scratch come from the device's pool
    int pageable = 0;
    ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device_));
    pageable_access_ = pageable != 0;
  }

  /// Takes the communicator's stream (NcclComm's, or a CudaLocalComm rank's) as the stream
  /// collectives run on, so comm_waits_for_compute() orders the ops the engine issues after the
  /// compute that produced their buffers. ConfigError for a communicator of host memory
  /// (LocalComm, MpiComm), whose copies cannot reach device buffers.
  void use_comm_stream(void* stream) {
    expect<ConfigError>(stream != nullptr,
                        "Engine (Compute<Cuda>): the communicator moves host memory (LocalComm, "
                        "MpiComm); device buffers need NcclComm, or CudaLocalComm for ranks as "
                        "threads on one GPU");
    comm_ = std::make_unique<Stream>(Stream::view(static_cast<cudaStream_t>(stream)));
  }
  /// The stream the units compute on (the address stays valid when the backend moves).
  Stream& compute_stream() { return *compute_; }
  /// The stream collectives run on.
  Stream& comm_stream() { return *comm_; }
  /// Makes work issued next on the communication stream wait for the compute issued so far (a
  /// reduction must not read a gradient the backward is still writing): an event recorded on
  /// compute and waited for on comm, on the device; the host does not block.
  void comm_waits_for_compute() {
    compute_done_.record(*compute_);
    compute_done_.wait_on(*comm_);
  }
  /// Makes compute issued next wait for everything issued on the communication stream so far (a
  /// blocking collective on staged host values): an event recorded on comm and waited for on
  /// compute, on the device. Not needed after a collective's Work completed: its data is then on
  /// the device, and a wait for the whole stream would also wait for the collectives issued
  /// there since (the next units' reductions, a prefetched gather).
  void compute_waits_for_comm() {
    comm_done_.record(*comm_);
    comm_done_.wait_on(*compute_);
  }
  /// Makes compute issued next wait for the DMA copies issued on the communication stream so far
  /// (comm_copy_async records an event after each): on the device, and only as far as the last
  /// copy, so collectives issued on the stream after it stay unordered.
  void compute_waits_for_comm_copies() { copies_done_.wait_on(*compute_); }
  /// Bytes free on the device now (cudaMemGetInfo), which the engine checks its layout's figure
  /// against before allocating. The pool's idle memory goes back to the driver first: the pool
  /// keeps what is freed to it (Cuda::keep_pool_memory), which cudaMemGetInfo counts as used, so
  /// an engine built after another (or after a setup that failed) would see too little.
  std::optional<std::size_t> free_device_bytes() const {
    cudaMemPool_t pool = nullptr;
    ZERO_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    ZERO_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
    std::size_t free = 0, total = 0;
    ZERO_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }
  /// The device this rank computes on, as a number equal on every rank (thread or process) of
  /// the job that shares its memory and different elsewhere: 48 bits of its UUID.
  std::uint64_t device_identity() const {
    cudaDeviceProp prop{};
    ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    std::uint64_t id = 0;
    for (int i = 0; i < 6; ++i) {
      id = (id << 8) | static_cast<unsigned char>(prop.uuid.bytes[i]);
    }
    return id;
  }
  /// A zeroed device buffer of n elements from the pool, allocated, filled and (when dropped)
  /// freed in the compute stream's order. Such buffers must be destroyed before the backend.
  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    return DeviceBuffer<E>(n, Cuda::default_alignment, *compute_);
  }
  /// A zeroed buffer of n elements of page-locked host memory (Offload<CPU>'s master slices and
  /// gradient shards): the host optimizer updates it in place, and the compute stream's kernels
  /// read and write it directly over the bus (unified addressing maps it into the device's
  /// address space). Freed once the compute stream's earlier work is done.
  template <class E>
  PinnedBuffer<E> make_pinned_buffer(std::size_t n) {
    return PinnedBuffer<E>(n, CudaPinnedHost::default_alignment, *compute_);
  }
  /// Where the optimizer's fused passes run when its states are in device memory (no offload):
  /// kernels on the compute stream (optim/cuda/fused_executor.cuh), after the reductions the
  /// compute stream waited for.
  const optim::FusedExecutor* fused_executor() const { return executor_.get(); }
  /// Blocks the host until the compute stream's work so far is done (before the host optimizer
  /// reads what the device wrote into pinned memory).
  void host_waits_for_compute() { compute_->synchronize(); }
  /// dst (device) = src (host), on the compute stream; returns once src may be reused (the
  /// compute stream has caught up), since the engine hands over short-lived host buffers.
  template <class E>
  void copy_from_host(std::span<E> dst, std::span<const E> src) {
    copy_waiting(dst, src, "CudaBackend::copy_from_host");
  }
  /// dst (host) = src (device), after the compute issued so far; returns with dst filled.
  template <class E>
  void copy_to_host(std::span<E> dst, std::span<const E> src) {
    copy_waiting(dst, src, "CudaBackend::copy_to_host");
  }
  /// dst = src by DMA (cudaMemcpyAsync) in the compute stream's order, without a host wait:
  /// Offload<CPU>'s gathers copy the pinned compute copy of a master slice up this way. src must
  /// stay unchanged until the compute stream has passed the copy (the host optimizer rewrites it
  /// only after host_waits_for_compute()).
  template <class E>
  void copy_async(std::span<E> dst, std::span<const E> src) {
    copy_on(*compute_, dst, src, "CudaBackend::copy_async");
  }
  /// dst = src by DMA (cudaMemcpyAsync) in the communication stream's order, without a host
  /// wait: Offload<CPU> copies a gradient shard folded in device memory down into its pinned
  /// host shard this way, so the transfer overlaps the next units' backward on the compute
  /// stream. Call comm_waits_for_compute() first when compute wrote src; src must stay
  /// unchanged, and dst unread, until compute_waits_for_comm_copies() has ordered compute after
  /// it.
  template <class E>
  void comm_copy_async(std::span<E> dst, std::span<const E> src) {
    copy_on(*comm_, dst, src, "CudaBackend::comm_copy_async");
    copies_done_.record(*comm_);
  }
  /// The activation arena of a micro-step: bytes of device memory, ordered on the compute stream.
  std::unique_ptr<BumpArena> make_arena(std::size_t bytes, std::string name) {
    try {
      return std::make_unique<Arena<Cuda>>(bytes, name, *compute_);
    } catch (const OutOfMemoryError& e) {
      // The pool's message names only a byte count: say which arena, and what sizes it.
      raise<OutOfMemoryError>("CudaBackend: the ", bytes, "-byte arena '", name,
                              "' does not fit in device memory (", e.what(),
                              "); lower EngineOptions::activation_bytes (train_gpt: "
                              "--activation-mb) or the micro-batch, or checkpoint activations");
    }
  }
  /// The layers' kernels: zero::ops::cuda on the compute stream (nn::CudaKernels; element types
  /// f32, bf16, f16).
  template <class T>
  std::unique_ptr<nn::Kernels<T>> make_layer_kernels() {
    return std::make_unique<nn::CudaKernels<T>>(compute_->native());
  }

  /// acc[i] += factor * g[i], in acc's type (the product rounded once), on the compute stream;
  /// Fold::start writes A{} + factor * g[i] without reading acc (HostBackend::accumulate).
  template <class A, class G>
  void accumulate(std::span<A> acc, std::span<const G> g, double factor = 1.0,
                  Fold fold = Fold::add) {
    static_assert(std::is_same_v<A, float>,
                  "CudaBackend::accumulate: the accumulator is f32 on the device (f64 reference "
                  "engines run on Compute<Host>)");
    static_assert(ops::cuda::is_device_float<G>,
                  "CudaBackend::accumulate: gradients are f32, bf16 or f16 on the device");
    expect<ShapeError>(acc.size() == g.size(), "CudaBackend::accumulate: acc has ", acc.size(),
                       " elements, g ", g.size(), "; they must match");
    if (acc.empty()) return;
    expect_device_memory(acc.data(), "accumulate", "acc");
    expect_device_memory(g.data(), "accumulate", "g");
    const auto n = static_cast<std::int64_t>(acc.size());
    const unsigned blocks = ops::cuda::grid_for(n);
    const auto launch = [&]<Fold F>(std::integral_constant<Fold, F>) {
      if (factor == 1.0) {
        cuda_backend_detail::accumulate_kernel<A, G, F>
            <<<blocks, ops::cuda::elementwise_threads, 0, compute_->native()>>>(acc.data(),
                                                                                g.data(), n);
      } else {
        cuda_backend_detail::accumulate_scaled_kernel<A, G, F>
            <<<blocks, ops::cuda::elementwise_threads, 0, compute_->native()>>>(
                acc.data(), g.data(), factor, n);
      }
    };
    if (fold == Fold::add) {
      launch(std::integral_constant<Fold, Fold::add>{});
    } else {
      launch(std::integral_constant<Fold, Fold::start>{});
    }
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
  /// out[i] = in[i], rounded to out's type (zero::convert), on the compute stream.
  template <class O, class I>
  void convert_into(std::span<O> out, std::span<const I> in) {
    static_assert(ops::cuda::is_device_float<O> && ops::cuda::is_device_float<I>,
                  "CudaBackend::convert_into: f32, bf16 and f16 on the device");
    expect<ShapeError>(out.size() == in.size(), "CudaBackend::convert_into: out has ", out.size(),
                       " elements, in ", in.size(), "; they must match");
    if (out.empty()) return;
    expect_device_memory(out.data(), "convert_into", "out");
    expect_device_memory(in.data(), "convert_into", "in");
    ops::cuda::convert_elements<O, I>(out.data(), in.data(), static_cast<std::int64_t>(out.size()),
                                      compute_->native());
  }
  /// v[i] = factor * v[i], on the compute stream.
  template <class E>
  void scale(std::span<E> v, double factor) {
    static_assert(std::is_same_v<E, float>,
                  "CudaBackend::scale: scales f32 accumulators and gradients on the device");
    if (v.empty()) return;
    expect_device_memory(v.data(), "scale", "v");
    const auto n = static_cast<std::int64_t>(v.size());
    cuda_backend_detail::scale_kernel<E>
        <<<ops::cuda::grid_for(n), ops::cuda::elementwise_threads, 0, compute_->native()>>>(
            v.data(), factor, n);
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
  /// Sets every element to zero (all-zero bits, which is E{} for zero's element types), on the
  /// compute stream.
  template <class E>
  void clear(std::span<E> v) {
    static_assert(std::is_arithmetic_v<E> || is_half_type<E>,
                  "CudaBackend::clear: zero's element types, whose zero is all-zero bits");
    if (v.empty()) return;
    if (checked_memory_type(v.data(), "clear", "v") == cudaMemoryTypeHost) {
      // Offload<CPU>'s pinned shards, which cudaMemsetAsync is not documented to take: a kernel
      // writes them.
      const auto n = static_cast<std::int64_t>(v.size());
      cuda_backend_detail::clear_kernel<E>
          <<<ops::cuda::grid_for(n), ops::cuda::elementwise_threads, 0, compute_->native()>>>(
              v.data(), n);
      ZERO_CUDA_CHECK(cudaGetLastError());
      return;
    }
    ZERO_CUDA_CHECK(cudaMemsetAsync(v.data(), 0, v.size_bytes(), compute_->native()));
  }
  /// Sum of squares of v in double, or +inf when v holds an Inf/NaN. Runs on the compute stream
  /// and blocks the host until that stream is done (it returns the value).
  template <class E>
  double sum_of_squares(std::span<const E> v) {
    static_assert(ops::cuda::is_device_float<E>,
                  "CudaBackend::sum_of_squares: f32, bf16 and f16 on the device");
    if (v.empty()) return 0.0;
    expect_device_memory(v.data(), "sum_of_squares", "v");
    // Squares of f32/bf16/f16 are exact in double and cannot overflow, so the sum is finite
    // exactly when every element is (reduce.cuh).
    const ops::cuda::DeviceGradStats st =
        ops::cuda::grad_stats(v.data(), static_cast<std::int64_t>(v.size()), compute_->native());
    return st.finite ? st.sum_sq : std::numeric_limits<double>::infinity();
  }

  /// slot[0] (device) = the sum of squares of v in double, on the compute stream without a host
  /// wait (sum_of_squares' reduction, so the same value): Offload<CPU> takes each unit's sum from
  /// the device copy of its gradient shard on the way down. An Inf/NaN element makes it Inf or
  /// NaN (sum_of_squares maps both to +inf; the engine does the same when it reads the slots).
  template <class E>
  void sum_of_squares_into(std::span<double> slot, std::span<const E> v) {
    static_assert(ops::cuda::is_device_float<E>,
                  "CudaBackend::sum_of_squares_into: f32, bf16 and f16 on the device");
    expect<ShapeError>(!slot.empty(), "CudaBackend::sum_of_squares_into: an empty slot");
    expect_device_memory(slot.data(), "sum_of_squares_into", "slot");
    if (!v.empty()) expect_device_memory(v.data(), "sum_of_squares_into", "v");
    ops::cuda::sum_squares(slot.data(), v.data(), static_cast<std::int64_t>(v.size()),
                           compute_->native());
  }
  /// out = in cut into `runs` equal runs, each packed as block-wise int8 codes and scales, one
  /// after another (ZeRO++'s quantized weights and gradients; core/int8_blocks.hpp), on the
  /// compute stream: HostBackend's bits. columns > 1 takes rows of `columns` runs column by
  /// column (quant::int8_source_run).
  template <class E>
  void quantize_int8(std::span<std::uint8_t> out, std::span<const E> in, std::int64_t runs = 1,
                     std::int64_t columns = 1) {
    const std::int64_t n =
        quant::int8_run_values("CudaBackend::quantize_int8", static_cast<std::int64_t>(in.size()),
                               runs, static_cast<std::int64_t>(out.size()), columns);
    if (n == 0) return;
    expect_device_memory(out.data(), "quantize_int8", "out");
    expect_device_memory(in.data(), "quantize_int8", "in");
    ops::cuda::quantize_int8_blocks<E>(in.data(), out.data(), n, runs, columns, compute_->native());
  }
  /// out = the values the `runs` packed runs in stand for, one run's after another, on the
  /// compute stream.
  template <class E>
  void dequantize_int8(std::span<E> out, std::span<const std::uint8_t> in, std::int64_t runs = 1) {
    const std::int64_t n = quant::int8_run_values("CudaBackend::dequantize_int8",
                                                  static_cast<std::int64_t>(out.size()), runs,
                                                  static_cast<std::int64_t>(in.size()));
    if (n == 0) return;
    expect_device_memory(out.data(), "dequantize_int8", "out");
    expect_device_memory(in.data(), "dequantize_int8", "in");
    ops::cuda::dequantize_int8_blocks<E>(in.data(), out.data(), n, runs, compute_->native());
  }
  /// out = factor * the sums of the packed runs in, added in f32 (the reduction of ZeRO++'s
  /// quantized gradients), on the compute stream: HostBackend's bits. out holds `outputs` runs;
  /// in whole blocks of `outputs` packed runs, whose run o out's run o sums.
  template <class E>
  void sum_int8(std::span<E> out, std::span<const std::uint8_t> in, float factor,
                std::int64_t outputs = 1) {
    const std::int64_t n =
        quant::int8_sum_values("CudaBackend::sum_int8", static_cast<std::int64_t>(out.size()),
                               outputs, static_cast<std::int64_t>(in.size()));
    if (n == 0) return;
    expect_device_memory(out.data(), "sum_int8", "out");
    expect_device_memory(in.data(), "sum_int8", "in");
    const std::int64_t blocks =
        static_cast<std::int64_t>(in.size()) / (outputs * quant::int8_packed_bytes(n));
    ops::cuda::sum_int8_blocks<E>(in.data(), out.data(), n, outputs, blocks, factor,
                                  compute_->native());
  }
  /// quantize_int8 with 4-bit codes, two a byte (core/int4_blocks.hpp), on the compute stream:
  /// HostBackend's bits.
  template <class E>
  void quantize_int4(std::span<std::uint8_t> out, std::span<const E> in, std::int64_t runs = 1,
                     std::int64_t columns = 1) {
    const std::int64_t n =
        quant::int4_run_values("CudaBackend::quantize_int4", static_cast<std::int64_t>(in.size()),
                               runs, static_cast<std::int64_t>(out.size()), columns);
    if (n == 0) return;
    expect_device_memory(out.data(), "quantize_int4", "out");
    expect_device_memory(in.data(), "quantize_int4", "in");
    ops::cuda::quantize_int4_blocks<E>(in.data(), out.data(), n, runs, columns, compute_->native());
  }
  /// sum_int8 over int4 packed runs, on the compute stream: HostBackend's bits.
  template <class E>
  void sum_int4(std::span<E> out, std::span<const std::uint8_t> in, float factor,
                std::int64_t outputs = 1) {
    const std::int64_t n =
        quant::int4_sum_values("CudaBackend::sum_int4", static_cast<std::int64_t>(out.size()),
                               outputs, static_cast<std::int64_t>(in.size()));
    if (n == 0) return;
    expect_device_memory(out.data(), "sum_int4", "out");
    expect_device_memory(in.data(), "sum_int4", "in");
    const std::int64_t blocks =
        static_cast<std::int64_t>(in.size()) / (outputs * quant::int4_packed_bytes(n));
    ops::cuda::sum_int4_blocks<E>(in.data(), out.data(), n, outputs, blocks, factor,
                                  compute_->native());
  }
  /// quantize_int8 (bits 8) or quantize_int4 (bits 4) of in plus the error kept for it in error,
  /// which then holds the next error (ZeRO++'s LoCo), on the compute stream: HostBackend's bits.
  template <class E>
  void quantize_with_feedback(std::span<std::uint8_t> out, std::span<const E> in,
                              std::span<std::uint8_t> error, quant::ErrorFeedback feedback,
                              int bits, std::int64_t runs = 1, std::int64_t columns = 1) {
    const std::int64_t n = quant::feedback_run_values(
        "CudaBackend::quantize_with_feedback", bits, static_cast<std::int64_t>(in.size()), runs,
        static_cast<std::int64_t>(out.size()), static_cast<std::int64_t>(error.size()), columns);
    if (n == 0) return;
    expect_device_memory(out.data(), "quantize_with_feedback", "out");
    expect_device_memory(in.data(), "quantize_with_feedback", "in");
    expect_device_memory(error.data(), "quantize_with_feedback", "error");
    ops::cuda::quantize_with_feedback<E>(in.data(), out.data(), error.data(), feedback, bits, n,
                                         runs, columns, compute_->native());
  }

 private:
  // dst = src in the compute stream's order, then a wait for it (host memory on one side). The
  // runtime infers the direction from the pointers: under Offload<CPU> the units' side of a copy
  // (a master slice) is itself pinned host memory.
  template <class E>
  void copy_waiting(std::span<E> dst, std::span<const E> src, const char* op) {
    copy_on(*compute_, dst, src, op);
    compute_->synchronize();
  }
  // dst = src by DMA in stream's order, without a host wait.
  template <class E>
  static void copy_on(Stream& stream, std::span<E> dst, std::span<const E> src, const char* op) {
    expect<ShapeError>(dst.size() == src.size(), op, ": ", src.size(), " elements into ",
                       dst.size());
    if (src.empty()) return;
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDefault,
                                    stream.native()));
  }
  // The kind of memory p is, with expect_device_memory's check made on the same (single)
  // query: clear needs the kind on every device, the other kernels only the check.
  cudaMemoryType checked_memory_type(const void* p, const char* op, const char* arg) const {
    cudaPointerAttributes attributes{};
    ZERO_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
    expect<CudaError>(pageable_access_ || attributes.type != cudaMemoryTypeUnregistered,
                      "CudaBackend::", op, ": ", arg, " (at ", p,
                      ") is pageable host memory, which this device cannot read; pass a "
                      "DeviceBuffer (or a PinnedBuffer)");
    return attributes.type;
  }
  // A kernel given pageable host memory faults with a sticky error that ends the context; say
  // which argument it was instead. Devices that read pageable memory (HMM, ATS) skip the check.
  void expect_device_memory(const void* p, const char* op, const char* arg) const {
    if (pageable_access_) return;
    (void)checked_memory_type(p, op, arg);
  }

  // First: the device check runs before any stream or event is created.
  int device_ = cuda_backend_detail::require_device();
  // On the heap: the references handed out (and kept by buffers) survive a move.
  std::unique_ptr<Stream> compute_ = std::make_unique<Stream>();
  std::unique_ptr<Stream> comm_ = std::make_unique<Stream>();
  std::unique_ptr<optim::cuda::CudaFusedExecutor> executor_ =
      std::make_unique<optim::cuda::CudaFusedExecutor>(compute_->native());
  Event compute_done_;
  Event comm_done_;
  Event copies_done_;  // recorded on comm after each comm_copy_async
  bool pageable_access_ = false;
};

/// The CUDA backend serves Compute<Cuda> wherever this header is included.
template <>
struct backend_for<Cuda> {
  using type = CudaBackend;
};

}  // namespace zero::engine
