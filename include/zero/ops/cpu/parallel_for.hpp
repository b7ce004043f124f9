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

/// Number of threads host kernels use.
inline int num_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace zero::ops::cpu
