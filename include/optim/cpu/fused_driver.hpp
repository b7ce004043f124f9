#pragma once
// The host fused pass: for each element, load the gradient (fp32/bf16/f16), multiply it by
// grad_scale (unscale and clip in one factor), apply an update rule (update_rules.hpp), store
// the parameter and states, and write the bf16/f16 copy, all while the element is in registers.
//
// The same template body runs with ScalarHostOps, Avx2Ops and Avx512Ops; the vector kernels are
// entry functions with __attribute__((target(...), flatten)) so the body and its ops inline into
// code compiled for that ISA, chosen at run time (cpu/isa.hpp). Tails shorter than a vector run
// the scalar ops inside the same kernel; because the rules have nothing for a compiler to
// contract (lane_ops.hpp), every path gives the same bits.
//
// Threads: work is cut into fixed chunks inside each group and shared by
// `#pragma omp parallel for schedule(static)`; the update is elementwise, so results do not
// depend on the thread count. Shards of fused_stream_min_elems and more write their bf16/f16
// copy with non-temporal stores (the same bits; each thread fences its chunk's stores).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#include <omp.h>
#endif

#include <optim/cpu/isa.hpp>
#include <optim/cpu/vector_ops.hpp>
#include <optim/fused_executor.hpp>
#include <optim/fused_io.hpp>
#include <optim/lane_ops.hpp>
#include <optim/param_groups.hpp>
#include <zero/core/dtype.hpp>

namespace zero::optim {
namespace detail {

/// Elements per unit of work shared among threads (a multiple of every vector width).
inline constexpr std::size_t fused_chunk_elems = 16384;

/// Shards of at least this many elements write their bf16/f16 copy past the cache (non-temporal
/// stores): the copy is written once and read next by someone else (a DMA copy up to the GPU, the
/// next forward), and a plain store reads each line into the cache before writing it. On a
/// 2-core EPYC a memory-bound loop with AdamW's traffic (30 bytes an element, 124M elements) took
/// 8% less time this way; optim_bench's AdamW, bound by those 2 cores' arithmetic, took between
/// 0.7% less and 1.8% more (it prints both; docs/optimizers.md). Smaller shards keep plain stores,
/// whose lines stay in the cache for their readers (StepOptions::stream_lowp turns it off).
inline constexpr std::size_t fused_stream_min_elems = std::size_t{1} << 20;

/// O with its bf16/f16 stores going past the cache: each vector is rounded by O's own store into
/// a register-sized scratch, then copied out with O::stream_u16 (the same bits).
template <class O>
struct StreamingLowp : O {
  using V = typename O::V;
  static void store_bf16(std::uint16_t* p, const V& x) {
    streamed(p, [&](std::uint16_t* r) { O::store_bf16(r, x); });
  }
  static void store_bf16_stochastic(std::uint16_t* p, const V& x, const std::uint32_t* bits) {
    streamed(p, [&](std::uint16_t* r) { O::store_bf16_stochastic(r, x, bits); });
  }
  static void store_f16(std::uint16_t* p, const V& x) {
    streamed(p, [&](std::uint16_t* r) { O::store_f16(r, x); });
  }

 private:
  template <class Round>
  static void streamed(std::uint16_t* p, const Round& round) {
    alignas(64) std::uint16_t rounded[O::width];
    round(rounded);
    O::stream_u16(p, rounded);
  }
};

/// The low-precision store of one vector starting at element i.
template <class O, class V>
inline void store_lowp(const FusedIo& io, std::size_t i, const V& p, std::uint32_t step) {
  auto* out = static_cast<std::uint16_t*>(io.lowp) + i;
  if (io.lowp_dtype == DType::f16) {
    O::store_f16(out, p);
  } else if (io.rounding == Rounding::nearest_even) {
    O::store_bf16(out, p);
  } else {
    // One Philox call per group of rounding_group elements, not one per lane.
    std::uint32_t bits[O::width];
    std::uint64_t group = ~std::uint64_t{0};
    Philox4x32::Counter words{};
    for (int lane = 0; lane < O::width; ++lane) {
      const std::uint64_t index = io.first_index + i + static_cast<std::uint64_t>(lane);
      if (index / rounding_group != group) {
        group = index / rounding_group;
        words = rounding_words(io.rounding_key, step, group);
      }
      bits[lane] = rounding_bits_in(words, index);
    }
    O::store_bf16_stochastic(out, p, bits);
  }
}

/// The gradient vector at element i, widened to float and multiplied by scale.
template <class O, class V>
inline V load_grad(const FusedIo& io, std::size_t i, const V& scale) {
  switch (io.grad_dtype) {
    case DType::bf16:
      return O::mul(O::load(static_cast<const bf16*>(io.grad) + i), scale);
    case DType::f16:
      return O::mul(O::load(static_cast<const f16*>(io.grad) + i), scale);
    default:
      return O::mul(O::load(static_cast<const float*>(io.grad) + i), scale);
  }
}

/// Applies rule to elements [begin, end) with ops O (scalar ops for the tail).
template <class O, class Rule>
inline void fused_range(const Rule& rule, const FusedIo& io, float* const* states,
                        std::size_t begin, std::size_t end, std::uint32_t step) {
  using V = typename O::V;
  constexpr int n = Rule::states > 0 ? Rule::states : 1;
  const V scale = O::set1(io.grad_scale);
  std::size_t i = begin;
  for (; i + O::width <= end; i += O::width) {
    V p = O::load(io.param + i);
    V g = p;
    if constexpr (Rule::reads_grad) g = load_grad<O>(io, i, scale);
    V s[n];
    for (int k = 0; k < Rule::states; ++k) s[k] = O::load(states[k] + i);
    rule.template apply<O>(p, g, s);
    if constexpr (Rule::writes_param) {
      O::store(io.param + i, p);
      if (io.lowp != nullptr) store_lowp<O>(io, i, p, step);
    }
    if constexpr (Rule::writes_states) {
      for (int k = 0; k < Rule::states; ++k) O::store(states[k] + i, s[k]);
    }
  }
  if constexpr (O::width > 1) {
    if (i < end) fused_range<ScalarHostOps>(rule, io, states, i, end, step);
  }
}

/// Scalar kernel entry.
template <class Rule>
void fused_chunk_scalar(const Rule& rule, const FusedIo& io, float* const* states,
                        std::size_t begin, std::size_t end, std::uint32_t step) {
  fused_range<ScalarHostOps>(rule, io, states, begin, end, step);
}

#if defined(ZERO_OPTIM_HAVE_X86)
/// AVX2 kernel entry: flatten inlines the body and its ops into AVX2 code. Stream: the copy's
/// stores go past the cache (StreamingLowp), fenced at the chunk's end.
template <class Rule, bool Stream>
ZERO_OPTIM_TARGET_AVX2 __attribute__((flatten)) void fused_chunk_avx2(
    const Rule& rule, const FusedIo& io, float* const* states, std::size_t begin, std::size_t end,
    std::uint32_t step) {
  if constexpr (Stream) {
    fused_range<StreamingLowp<Avx2Ops>>(rule, io, states, begin, end, step);
    Avx2Ops::store_fence();
  } else {
    fused_range<Avx2Ops>(rule, io, states, begin, end, step);
  }
}

/// AVX-512 kernel entry: flatten inlines the body and its ops into AVX-512 code.
template <class Rule, bool Stream>
ZERO_OPTIM_TARGET_AVX512 __attribute__((flatten)) void fused_chunk_avx512(
    const Rule& rule, const FusedIo& io, float* const* states, std::size_t begin, std::size_t end,
    std::uint32_t step) {
  if constexpr (Stream) {
    fused_range<StreamingLowp<Avx512Ops>>(rule, io, states, begin, end, step);
    Avx512Ops::store_fence();
  } else {
    fused_range<Avx512Ops>(rule, io, states, begin, end, step);
  }
}
#endif

/// One unit of work: a chunk of one group.
struct FusedWork {
  std::size_t rule;   ///< index into the rules (one per group)
  std::size_t begin;  ///< first element
  std::size_t end;    ///< one past the last
};

/// OpenMP threads for a request (0: the OpenMP default).
inline int thread_count(int requested) {
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

}  // namespace detail

/// Runs one fused pass: rules[k] over ranges[k] of the shard described by io, with the state
/// buffers states (each numel floats, in the rule's order); step selects the stochastic-rounding
/// stream. Threads share fixed chunks; the result does not depend on their number. With
/// options.executor set, the executor runs the pass instead (fused_executor.hpp).
template <class Rule>
void run_fused(std::span<const Rule> rules, std::span<const Range> ranges, const FusedIo& io,
               std::span<float* const> states, std::uint32_t step, const StepOptions& options) {
  expect<Error>(rules.size() == ranges.size(), "zero::optim::run_fused: ", rules.size(),
                " rules for ", ranges.size(), " ranges");
  if constexpr (Rule::states > 0) {  // (a rule without states takes any list)
    expect<Error>(states.size() >= static_cast<std::size_t>(Rule::states),
                  "zero::optim::run_fused: the rule needs ", Rule::states, " state buffers, got ",
                  states.size());
  }
  if (options.executor != nullptr) {
    const std::vector<AnyRule> any(rules.begin(), rules.end());
    options.executor->run(any, ranges, io, states, step);
    return;
  }
  std::vector<detail::FusedWork> work;
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    for (std::size_t b = ranges[k].offset; b < ranges[k].end(); b += detail::fused_chunk_elems) {
      work.push_back({k, b, std::min(ranges[k].end(), b + detail::fused_chunk_elems)});
    }
  }
  using Kernel =
      void (*)(const Rule&, const FusedIo&, float* const*, std::size_t, std::size_t, std::uint32_t);
  Kernel kernel = &detail::fused_chunk_scalar<Rule>;
#if defined(ZERO_OPTIM_HAVE_X86)
  const bool stream =
      options.stream_lowp && io.lowp != nullptr && io.numel >= detail::fused_stream_min_elems;
  switch (resolve_isa(options.isa)) {
    case Isa::avx512:
      kernel = stream ? &detail::fused_chunk_avx512<Rule, true>
                      : &detail::fused_chunk_avx512<Rule, false>;
      break;
    case Isa::avx2:
      kernel =
          stream ? &detail::fused_chunk_avx2<Rule, true> : &detail::fused_chunk_avx2<Rule, false>;
      break;
    default:
      break;
  }
#else
  (void)resolve_isa(options.isa);
#endif
  float* const* state_ptrs = states.data();
  const auto count = static_cast<std::int64_t>(work.size());
  [[maybe_unused]] const int threads = detail::thread_count(options.threads);
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
  for (std::int64_t w = 0; w < count; ++w) {
    const detail::FusedWork& item = work[static_cast<std::size_t>(w)];
    kernel(rules[item.rule], io, state_ptrs, item.begin, item.end, step);
  }
}

}  // namespace zero::optim
