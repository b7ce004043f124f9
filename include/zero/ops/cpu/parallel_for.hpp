#pragma once
// Parallel loops for host kernels: OpenMP when the translation unit is compiled with it
// (link zero::openmp), a plain loop otherwise. Every kernel gives each iteration a disjoint
// output, so results are bit-identical for any thread count.

#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace zero::ops::cpu {

/// Calls body(i) for i in [0, n), split statically over the OpenMP threads.
template <class Body>
inline void parallel_for(std::int64_t n, Body&& body) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) body(i);
#else
  for (std::int64_t i = 0; i < n; ++i) body(i);
#endif
}

/// Total work (elements) below which parallel_chunks runs its chunks in a plain loop: an OpenMP
/// region costs microseconds, more than a few thousand elements of vector work.
inline constexpr std::int64_t serial_work_elems = 32768;

/// Calls body(begin, end) for the fixed chunks [k chunk, min(n, (k + 1) chunk)) of [0, n): over
/// the OpenMP threads when work_elems (the kernel's whole work) reaches serial_work_elems, in a
/// plain loop otherwise. The chunks never depend on the thread count, nor do the results.
template <class Body>
inline void parallel_chunks(std::int64_t n, std::int64_t chunk, std::int64_t work_elems,
                            Body&& body) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  const auto run = [&](std::int64_t k) {
    body(k * chunk, k * chunk + chunk < n ? k * chunk + chunk : n);
  };
  if (chunks > 1 && work_elems >= serial_work_elems) {
    parallel_for(chunks, run);
  } else {
    for (std::int64_t k = 0; k < chunks; ++k) run(k);
  }
}

/// Rows a task of a row-wise kernel takes (parallel_chunks' chunk) over rows of width
/// elements: about 16K elements, at least one row.
inline std::int64_t rows_per_task(std::int64_t width) {
  return width >= 16384 ? 1 : 16384 / (width > 0 ? width : 1);
}

/// Number of threads host kernels use.
inline int num_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace zero::ops::cpu
