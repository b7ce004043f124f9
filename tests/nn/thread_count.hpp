#pragma once
// Runs a piece of a test at a given OpenMP thread count (the determinism tests compare 1 and 2).

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace zero::testing {

/// fn() with OpenMP limited to `threads` on this thread; the previous count is restored after.
template <class Fn>
auto with_threads([[maybe_unused]] int threads, Fn&& fn) {
#if defined(_OPENMP)
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  auto result = fn();
  omp_set_num_threads(saved);
  return result;
#else
  return fn();
#endif
}

}  // namespace zero::testing
