#pragma once
// Run-time instruction-set dispatch for the host op kernels, the optimizer's rule (optim/cpu/
// isa.hpp) applied to the ops: a kernel body is written once as a template over an Ops type
// (optim/cpu/vector_ops.hpp: ScalarHostOps, Avx2Ops, Avx512Ops) and entered through
// kernel_for<Body>(), which returns the scalar, AVX2 or AVX-512 instantiation for the ISA chosen
// once per process (the widest the CPU has). The vector entries carry
// __attribute__((target(...), flatten)), so the library needs no -mavx2 or -march=native.
//
// Bit-identical results on every path: bodies use only the vocabulary's correctly rounded
// operations (+ - * / sqrt fma min max), never a plain product fed into a plain add (nothing for
// a compiler to contract), and do the same operations in the same order in every lane; the
// scalar path is the same body at width 1. Reductions that cross lanes keep a fixed number of
// partial sums (reduction_lanes), independent of the vector width.
//
// Threads: a caller splits the work into fixed chunks and calls the kernel from parallel_for
// (OpenMP outlines its region into a function without the target attribute, so the dispatch is
// inside it, not around it).

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <optim/cpu/isa.hpp>
#include <optim/cpu/vector_ops.hpp>
#include <zero/core/dtype.hpp>

namespace zero::ops::cpu {

using optim::Isa;

namespace detail {
inline std::atomic<Isa>& host_isa_slot() {
  static std::atomic<Isa> isa{optim::best_isa()};
  return isa;
}
}  // namespace detail

/// The instruction set the host op kernels run: the widest the CPU supports unless a test set
/// another (set_host_isa).
inline Isa host_isa() {
  return detail::host_isa_slot().load(std::memory_order_relaxed);
}

/// Makes the host op kernels run isa from now on (`automatic`: the widest); an ISA the CPU
/// lacks is an Error. Returns the previous one. For tests and benchmarks that compare paths.
inline Isa set_host_isa(Isa isa) {
  return detail::host_isa_slot().exchange(optim::resolve_isa(isa), std::memory_order_relaxed);
}

namespace detail {

template <class Body, class... Args>
void kernel_scalar(Args... args) {
  Body::template run<optim::ScalarHostOps>(args...);
}

#if defined(ZERO_OPTIM_HAVE_X86)
template <class Body, class... Args>
ZERO_OPTIM_TARGET_AVX2 __attribute__((flatten)) void kernel_avx2(Args... args) {
  Body::template run<optim::Avx2Ops>(args...);
}

template <class Body, class... Args>
ZERO_OPTIM_TARGET_AVX512 __attribute__((flatten)) void kernel_avx512(Args... args) {
  Body::template run<optim::Avx512Ops>(args...);
}
#endif

}  // namespace detail

/// The entry of Body (a struct with `template <class O> static void run(Args...)`) for the
/// current host_isa(); call it inside parallel_for, once per fixed chunk.
template <class Body, class... Args>
auto kernel_for() -> void (*)(Args...) {
#if defined(ZERO_OPTIM_HAVE_X86)
  switch (host_isa()) {
    case Isa::avx512:
      return &detail::kernel_avx512<Body, Args...>;
    case Isa::avx2:
      return &detail::kernel_avx2<Body, Args...>;
    default:
      break;
  }
#endif
  return &detail::kernel_scalar<Body, Args...>;
}

/// O's lanes of the storage-type values at p, widened to float (exactly).
template <class O, class T>
inline typename O::V load_lanes(const T* p) {
  return O::load(p);
}

/// Stores O's lanes at p, rounded to T (nearest even) for 16-bit types.
template <class O, class T>
inline void store_lanes(T* p, const typename O::V& x) {
  if constexpr (std::is_same_v<T, bf16>) {
    O::store_bf16(reinterpret_cast<std::uint16_t*>(p), x);
  } else if constexpr (std::is_same_v<T, f16>) {
    O::store_f16(reinterpret_cast<std::uint16_t*>(p), x);
  } else {
    static_assert(std::is_same_v<T, float>, "the dispatched kernels store float, bf16 or f16");
    O::store(p, x);
  }
}

/// True for the storage types the dispatched kernels take (float compute); f64 keeps the
/// scalar reference kernels.
template <class T>
inline constexpr bool dispatched_type =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

/// Elements per chunk of an elementwise kernel (a multiple of every vector width); fixed, so the
/// split never depends on the thread count.
inline constexpr std::int64_t elementwise_chunk = 4096;

}  // namespace zero::ops::cpu
