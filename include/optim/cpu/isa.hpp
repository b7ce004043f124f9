#pragma once
// Which vector instruction set the CPU optimizer kernels use. The choice is made at run time from
// the CPU's features (__builtin_cpu_supports), never from the build host's flags, so a binary
// built without -march=native still runs its AVX-512 or AVX2 kernels where the CPU has them, and
// a test can force each path the running CPU supports.

#include <string_view>

#include <zero/core/error.hpp>

namespace zero::optim {

/// Instruction set of the host kernels; `automatic` picks the widest the CPU supports.
enum class Isa { automatic, scalar, avx2, avx512 };

/// Lower-case name of isa ("scalar", "avx2", ...).
constexpr std::string_view name_of(Isa isa) {
  switch (isa) {
    case Isa::automatic:
      return "automatic";
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

/// True when this translation unit has the vector kernels. They rely on GCC's flatten inlining
/// to run the shared rule templates inside AVX code; an unoptimised build (-O0) does not inline,
/// and calls between AVX and non-AVX functions that pass vectors by value break the ABI, so
/// such builds (and nvcc's device pass) use the scalar kernels only.
constexpr bool vector_kernels_compiled() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__OPTIMIZE__) && \
    !defined(__CUDA_ARCH__)
  return true;
#else
  return false;
#endif
}

/// True when the running CPU can execute isa's kernels (AVX2 kernels also need FMA and F16C)
/// and this build has them (vector_kernels_compiled()).
inline bool cpu_supports(Isa isa) {
  if (isa != Isa::scalar && isa != Isa::automatic && !vector_kernels_compiled()) return false;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  switch (isa) {
    case Isa::automatic:
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  return false;
#else
  return isa == Isa::scalar || isa == Isa::automatic;
#endif
}

/// The widest instruction set the running CPU supports.
inline Isa best_isa() {
  if (cpu_supports(Isa::avx512)) return Isa::avx512;
  if (cpu_supports(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

/// The concrete instruction set for a request: `automatic` becomes best_isa(); a forced one the
/// CPU lacks is an error rather than a silent fallback, because tests force paths on purpose.
inline Isa resolve_isa(Isa requested) {
  if (requested == Isa::automatic) return best_isa();
  expect<Error>(
      cpu_supports(requested), "zero::optim: instruction set '", name_of(requested),
      "' was requested but this CPU does not support it, or this build is unoptimised (-O0) ",
      "and has only scalar kernels (best available: '", name_of(best_isa()), "')");
  return requested;
}

}  // namespace zero::optim
