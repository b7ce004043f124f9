#pragma once
// The device seam: Compute<Device> resolves to a backend, the one place that says how the engine
// allocates buffers (plain and pinned), orders work (streams and events) and runs the few
// element-wise kernels its own flow needs (folding a gradient into an fp32 accumulator, rounding
// a master slice for a gather, clearing, the sum of squares for the global norm, the int8 packing
// of ZeRO++'s quantized weights and gradients). It also makes
// what the model's layers run on: their kernel set (nn/kernels.hpp: zero::ops::cpu on the host,
// zero::ops::cuda on a device's compute stream) and the activation arenas in the same memory.
// The flow in engine.hpp is written
// once over this interface, and calls the kernels on its backend object (one per engine: a
// device backend's kernels run on its streams), never through the type.
//
// HostBackend is synchronous: its streams order nothing and its events are complete when
// recorded, so the engine's "comm waits for compute" points cost nothing here. CudaBackend
// (zero/engine/cuda_backend.cuh, nvcc only) fills in the same members with the stream-ordered
// pool, a compute and a communication stream and device kernels; it specialises backend_for<Cuda>
// where it is included, and elsewhere Compute<Cuda> stops the build with the message below.
//
// A backend may also have fused_executor(): the optim::FusedExecutor that runs a built-in
// optimizer's passes on its device (CudaBackend's kernels). The engine then keeps the optimizer's
// states in the backend's buffers beside the master slices. HostBackend has none: the host's
// threads run the passes (optim/cpu/fused_driver.hpp).

#include <algorithm>
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

#include <optim/grad_norm.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/ops/cpu/error_feedback.hpp>
#include <zero/ops/cpu/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>

namespace zero::engine {

/// How a fold of a gradient into an accumulator treats what the accumulator held: add to it, or
/// start it as if it were zero, without reading it (the first fold of an accumulation window,
/// which spares the clear and the read: under Offload<CPU> both cross the bus).
enum class Fold : unsigned char { add, start };

/// The host backend: aligned heap buffers, synchronous streams, loops over spans.
struct HostBackend {
  using Device = Host;
  /// A buffer the units compute on.
  template <class E>
  using DeviceBuffer = Buffer<E, Host>;
  /// A buffer device copies can reach without staging (host memory already is).
  template <class E>
  using PinnedBuffer = Buffer<E, Host>;
  using Stream = HostStream;
  using Event = HostEvent;
  /// Where the model's units find their kernels.
  static constexpr DeviceKind kernels = DeviceKind::host;
  /// The communicator reads host memory (LocalComm, MpiComm): the engine's collectives on host
  /// values go to it directly (HostValueComm).
  static constexpr bool comm_reads_host_memory = true;

  /// Takes the communicator's stream as the stream collectives run on: null for a communicator
  /// of host memory, the only kind the host engine can use (ConfigError otherwise).
  void use_comm_stream(void* stream) {
    expect<ConfigError>(
        stream == nullptr,
        "Engine (Compute<Host>): the communicator moves device memory (NcclComm, "
        "CudaLocalComm); the host engine's buffers are host memory, so use LocalComm "
        "or MpiComm, or Compute<Cuda>");
  }
  /// The stream the units compute on.
  Stream& compute_stream() { return compute_; }
  /// The stream collectives run on.
  Stream& comm_stream() { return comm_; }
  /// Bytes the compute device has free for the engine, checked against the layout's figure before
  /// the engine allocates; none here (host memory is the operating system's to give, and it may
  /// swap rather than fail).
  std::optional<std::size_t> free_device_bytes() const { return std::nullopt; }
  /// The device this rank computes on, as a number equal on the ranks that share its memory
  /// (the engine multiplies its figure by their count) and different elsewhere; read only where
  /// free_device_bytes() reports a figure. One host: 0.
  std::uint64_t device_identity() const { return 0; }
  /// A zeroed buffer of n elements for the units and the flow, ordered on the compute stream
  /// (every buffer the engine holds is made here, never by DeviceBuffer's own constructor).
  template <class E>
  DeviceBuffer<E> make_buffer(std::size_t n) {
    return DeviceBuffer<E>(n, Host::default_alignment, compute_);
  }
  /// A zeroed buffer of n elements in host memory that the device's copies and kernels reach
  /// directly (page-locked on a GPU): where Offload<CPU> keeps the master slices and gradient
  /// shards that the host optimizer updates. Plain host memory here.
  template <class E>
  PinnedBuffer<E> make_pinned_buffer(std::size_t n) {
    return PinnedBuffer<E>(n, Host::default_alignment, compute_);
  }
  /// Blocks the host until the compute issued so far is done (Offload<CPU>'s optimizer reads on
  /// the host the gradient shards the device wrote). Synchronous here.
  void host_waits_for_compute() {}
  /// The activation arena of a micro-step: bytes of the memory the units compute on.
  std::unique_ptr<BumpArena> make_arena(std::size_t bytes, std::string name) {
    return std::make_unique<Arena<Host>>(bytes, std::move(name));
  }
  /// The kernels the model's layers run (nn/kernels.hpp): zero::ops::cpu here.
  template <class T>
  std::unique_ptr<nn::Kernels<T>> make_layer_kernels() {
    return std::make_unique<nn::HostKernels<T>>();
  }
  /// Makes work issued next on the communication stream wait for the compute issued so far (a
  /// reduction must not read a gradient the backward is still writing). Synchronous here.
  void comm_waits_for_compute() {
    Event e;
    e.record(compute_);
  }
  /// Makes compute issued next wait for everything issued on the communication stream so far
  /// (what a blocking collective on staged host values left there). A collective the flow
  /// waited for through its Work needs no such wait: a device communicator's Work completes only
  /// once the op's data is on the device. Synchronous here.
  void compute_waits_for_comm() {
    Event e;
    e.record(comm_);
  }
  /// Makes compute issued next wait for the DMA copies issued on the communication stream so far
  /// (comm_copy_async), which no Work tracks, but not for the collectives issued there since.
  /// Synchronous here.
  void compute_waits_for_comm_copies() {
    Event e;
    e.record(comm_);
  }

  /// dst = src: host memory into the memory the units compute on (initial values). A plain copy
  /// here; spans of equal size.
  template <class E>
  static void copy_from_host(std::span<E> dst, std::span<const E> src) {
    copy_checked(dst, src, "HostBackend::copy_from_host");
  }
  /// dst = src: the units' memory into host memory (values read back). A plain copy here.
  template <class E>
  static void copy_to_host(std::span<E> dst, std::span<const E> src) {
    copy_checked(dst, src, "HostBackend::copy_to_host");
  }
  /// dst = src in the compute stream's order, without waiting for it: pinned host memory into
  /// the units' memory (Offload<CPU>'s gathers, and a later micro-step's fold copying its pinned
  /// gradient shard up to add to it). src must stay unchanged until the compute stream has
  /// passed the copy. A plain copy here.
  template <class E>
  static void copy_async(std::span<E> dst, std::span<const E> src) {
    copy_checked(dst, src, "HostBackend::copy_async");
  }
  /// dst = src by DMA in the communication stream's order, without waiting for it: Offload<CPU>
  /// moves a gradient shard folded in the units' memory down into its pinned host shard this
  /// way, beside the compute stream's backward. Call comm_waits_for_compute() first when compute
  /// wrote src; src must stay unchanged, and dst unread, until compute_waits_for_comm_copies()
  /// has ordered compute after the copy. A plain copy here.
  template <class E>
  static void comm_copy_async(std::span<E> dst, std::span<const E> src) {
    copy_checked(dst, src, "HostBackend::comm_copy_async");
  }

  /// acc[i] += factor * g[i], in acc's type (the product rounded once); Fold::start writes
  /// A{} + factor * g[i], the same bits as adding to a cleared acc (a negative zero becomes +0).
  template <class A, class G>
  static void accumulate(std::span<A> acc, std::span<const G> g, double factor = 1.0,
                         Fold fold = Fold::add) {
    const auto fold_into = [&](auto term) {
      if (fold == Fold::add) {
        for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += term(i);
      } else {
        for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = A{} + term(i);
      }
    };
    if (factor == 1.0) {
      fold_into([&](std::size_t i) { return convert<A>(g[i]); });
    } else {
      fold_into([&](std::size_t i) { return convert<A>(convert<double>(g[i]) * factor); });
    }
  }
  /// out[i] = in[i], rounded to out's type.
  template <class O, class I>
  static void convert_into(std::span<O> out, std::span<const I> in) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = convert<O>(in[i]);
  }
  /// v[i] = factor * v[i].
  template <class E>
  static void scale(std::span<E> v, double factor) {
    for (E& x : v) x = static_cast<E>(x * factor);
  }
  /// Sets every element to zero.
  template <class E>
  static void clear(std::span<E> v) {
    for (E& x : v) x = E{};
  }
  /// Sum of squares of v, or +inf when v holds an Inf/NaN (a deterministic pass).
  template <class E>
  static double sum_of_squares(std::span<const E> v) {
    if constexpr (std::is_same_v<E, float>) {
      const optim::GradStats st = optim::grad_stats(v.data(), DType::f32, v.size());
      return st.finite ? st.sum_sq : std::numeric_limits<double>::infinity();
    } else {
      double sum = 0;
      for (E x : v) sum += static_cast<double>(x) * static_cast<double>(x);
      return sum;
    }
  }
  /// slot[0] = sum_of_squares(v), in the compute stream's order without waiting for it; slot
  /// is in the units' memory (a DeviceBuffer's). Offload<CPU> takes each unit's sum where its
  /// gradient shard passes through the units' memory on its way down, so the host never reads
  /// the pinned shards for the global norm.
  template <class E>
  static void sum_of_squares_into(std::span<double> slot, std::span<const E> v) {
    expect<ShapeError>(!slot.empty(), "HostBackend::sum_of_squares_into: an empty slot");
    slot[0] = sum_of_squares(v);
  }
  /// out = in cut into `runs` equal runs, each packed as block-wise int8 codes and scales, one
  /// after another (ZeRO++'s quantized weights, one run; its quantized gradients, a run for each
  /// rank; core/int8_blocks.hpp). columns > 1 takes rows of `columns` runs column by column
  /// (quant::int8_source_run).
  template <class E>
  static void quantize_int8(std::span<std::uint8_t> out, std::span<const E> in,
                            std::int64_t runs = 1, std::int64_t columns = 1) {
    ops::cpu::quantize_int8_blocks(in, out, runs, columns);
  }
  /// out = the values the `runs` packed runs in stand for, one run's after another.
  template <class E>
  static void dequantize_int8(std::span<E> out, std::span<const std::uint8_t> in,
                              std::int64_t runs = 1) {
    ops::cpu::dequantize_int8_blocks(in, out, runs);
  }
  /// out = factor * the sums of the packed runs in, added in f32 (the reduction of ZeRO++'s
  /// quantized gradients): out holds `outputs` runs; in whole blocks of `outputs` packed runs,
  /// whose run o out's run o sums.
  template <class E>
  static void sum_int8(std::span<E> out, std::span<const std::uint8_t> in, float factor,
                       std::int64_t outputs = 1) {
    ops::cpu::sum_int8_blocks(in, out, factor, outputs);
  }
  /// quantize_int8 with 4-bit codes, two a byte (ZeRO++'s quantized gradients at DeepSpeed's
  /// width; core/int4_blocks.hpp).
  template <class E>
  static void quantize_int4(std::span<std::uint8_t> out, std::span<const E> in,
                            std::int64_t runs = 1, std::int64_t columns = 1) {
    ops::cpu::quantize_int4_blocks(in, out, runs, columns);
  }
  /// sum_int8 over int4 packed runs.
  template <class E>
  static void sum_int4(std::span<E> out, std::span<const std::uint8_t> in, float factor,
                       std::int64_t outputs = 1) {
    ops::cpu::sum_int4_blocks(in, out, factor, outputs);
  }
  /// quantize_int8 (bits 8) or quantize_int4 (bits 4) of in plus the error kept for it in error,
  /// which then holds the next error (ZeRO++'s LoCo; core/error_feedback.hpp): error holds
  /// `runs` int8 packed runs of in's runs in source order, zeroed for none.
  template <class E>
  static void quantize_with_feedback(std::span<std::uint8_t> out, std::span<const E> in,
                                     std::span<std::uint8_t> error, quant::ErrorFeedback feedback,
                                     int bits, std::int64_t runs = 1, std::int64_t columns = 1) {
    ops::cpu::quantize_with_feedback(in, out, error, feedback, bits, runs, columns);
  }

 private:
  template <class E>
  static void copy_checked(std::span<E> dst, std::span<const E> src, const char* op) {
    expect<ShapeError>(dst.size() == src.size(), op, ": ", src.size(), " elements into ",
                       dst.size());
    std::copy(src.begin(), src.end(), dst.begin());
  }

  Stream compute_, comm_;
};

namespace detail {
template <class>
inline constexpr bool no_backend_for = false;
}  // namespace detail

/// The backend of Compute<Device>; specialised per device.
template <class Device>
struct backend_for {
  static_assert(detail::no_backend_for<Device>,
                "zero::Engine: Compute<Cuda> needs the CUDA engine backend: include "
                "<zero/engine/cuda_backend.cuh> (compiled by nvcc) before naming it, or use "
                "Compute<Host>");
};
/// The host backend serves Compute<Host>.
template <>
struct backend_for<Host> {
  using type = HostBackend;
};
/// The backend type of Compute<Device>.
template <class Device>
using backend_t = typename backend_for<Device>::type;

}  // namespace zero::engine
