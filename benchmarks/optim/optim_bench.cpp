// Fused AdamW step (fp32 gradient, bf16 write-back) on a flat shard, beside a STREAM-style triad
// over the same number of elements and threads in the same run, because absolute bandwidth on a
// shared machine drifts. One JSON object per line.
//
//   OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ./optim_bench [--elements N] [--repeats R]
//                                                          [--isa scalar|avx2|avx512]
//
// Bytes are counted as STREAM does (no write-allocate traffic): AdamW moves 30 bytes per element
// (param read+write 8, grad read 4, m read+write 8, v read+write 8, bf16 write 2), the triad
// a = b + s*c moves 12. The two alternate R times; the best of each is reported. AdamW runs twice
// a round: as by default (the bf16 copy written past the cache, StepOptions::stream_lowp) and
// with plain stores, the baseline of that choice.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>

#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#include <omp.h>
#endif

#include <optim/adam.hpp>
#include <zero/core/buffer.hpp>
#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

using zero::bench::line;

namespace {

using zero::bench::best_seconds;

int threads() {
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Fills with a cheap pattern in parallel, so pages are first touched by the threads that use them.
void fill(float* p, long long n, float base) {
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (long long i = 0; i < n; ++i) p[i] = base + static_cast<float>(i % 1024) * 1e-3f;
}

void triad(float* a, const float* b, const float* c, float s, long long n) {
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (long long i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace

int main(int argc, char** argv) {
  long long n = 100'000'000;
  int repeats = 5;
  zero::optim::Isa isa = zero::optim::Isa::automatic;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--elements") {
      n = zero::bench::integer_arg("optim_bench", flag,
                                   zero::bench::value_arg("optim_bench", argc, argv, i));
    } else if (flag == "--repeats") {
      repeats = static_cast<int>(zero::bench::integer_arg(
          "optim_bench", flag, zero::bench::value_arg("optim_bench", argc, argv, i), 1, 1 << 20));
    } else if (flag == "--isa") {
      const zero::optim::Isa isas[] = {zero::optim::Isa::automatic, zero::optim::Isa::scalar,
                                       zero::optim::Isa::avx2, zero::optim::Isa::avx512};
      isa = isas[zero::bench::choice_arg("optim_bench", flag,
                                         zero::bench::value_arg("optim_bench", argc, argv, i),
                                         {"automatic", "scalar", "avx2", "avx512"})];
    } else {
      std::fprintf(stderr, "usage: %s [--elements N] [--repeats R] [--isa scalar|avx2|avx512]\n",
                   argv[0]);
      return 2;
    }
  }
  const auto count = static_cast<std::size_t>(n);
  const zero::optim::Isa used = zero::optim::resolve_isa(isa);
  const std::string config = "\"elements\": " + std::to_string(n) +
                             ", \"threads\": " + std::to_string(threads()) + ", \"isa\": \"" +
                             std::string(zero::optim::name_of(used)) + "\"";

  // Allocated without initialising (a std::vector would zero them on this thread), so that
  // fill() and the first step are what touch the pages, on the threads that later use them.
  const auto a = std::make_unique_for_overwrite<float[]>(count);
  const auto b = std::make_unique_for_overwrite<float[]>(count);
  const auto c = std::make_unique_for_overwrite<float[]>(count);
  fill(a.get(), n, 0.0f);
  fill(b.get(), n, 1.0f);
  fill(c.get(), n, 2.0f);
  const auto param = std::make_unique_for_overwrite<float[]>(count);
  const auto grad = std::make_unique_for_overwrite<float[]>(count);
  const auto low = std::make_unique_for_overwrite<zero::bf16[]>(count);
  fill(param.get(), n, 0.5f);
  fill(grad.get(), n, -0.25f);
  zero::optim::AdamW opt(count, zero::optim::AdamHyper{1e-4, 0.9, 0.999, 1e-8, 0.01});
  auto io = zero::optim::FusedIo::over<float>(std::span<float>(param.get(), count),
                                              std::span<const float>(grad.get(), count))
                .write_back(std::span<zero::bf16>(low.get(), count));
  io.scale_grad(1.0f / 1024.0f);
  const zero::optim::StepOptions options{isa, 0};
  zero::optim::StepOptions cached = options;  // the bf16 copy through the cache
  cached.stream_lowp = false;
  // Untimed first step: it writes the bf16 copy's pages first. The optimizer states were
  // zeroed on this thread by AdamW's constructor (Buffer), so their pages were not.
  opt.step(io, options);

  // Triad and AdamW alternate, so both see the same load from whatever else runs on the machine.
  double triad_s = 1e30, adamw_s = 1e30, cached_s = 1e30;
  for (int r = 0; r < repeats; ++r) {
    triad_s =
        std::min(triad_s, best_seconds(1, [&] { triad(a.get(), b.get(), c.get(), 0.5f, n); }));
    adamw_s = std::min(adamw_s, best_seconds(1, [&] { opt.step(io, options); }));
    cached_s = std::min(cached_s, best_seconds(1, [&] { opt.step(io, cached); }));
  }
  const double triad_gbps = 12.0 * static_cast<double>(n) / triad_s / 1e9;
  line("stream_triad", config, triad_gbps, "GB/s");
  const double gbps = 30.0 * static_cast<double>(n) / adamw_s / 1e9;
  char extra[160];
  std::snprintf(extra, sizeof extra, ", \"ms\": %.2f, \"fraction_of_triad\": %.3f", adamw_s * 1e3,
                gbps / triad_gbps);
  line("adamw_fused_bf16_writeback_bandwidth", config, gbps, "GB/s", extra);
  line("adamw_fused_bf16_writeback_rate", config, static_cast<double>(n) / adamw_s, "elements/s");
  // The baseline of the copy's non-temporal stores (StepOptions::stream_lowp): plain stores.
  std::snprintf(extra, sizeof extra, ", \"ms\": %.2f, \"streamed_over_cached\": %.3f",
                cached_s * 1e3, adamw_s / cached_s);
  line("adamw_fused_bf16_writeback_cached_stores_bandwidth", config,
       30.0 * static_cast<double>(n) / cached_s / 1e9, "GB/s", extra);
  return 0;
}
