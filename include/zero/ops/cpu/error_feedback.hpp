#pragma once
// Packing with error feedback on the host (ZeRO++'s LoCo; core/error_feedback.hpp's rules): packs
// runs of values as int8 or int4 blocks (ops/cpu/int8_blocks.hpp, int4_blocks.hpp) after adding
// the error kept for them, and keeps the new error, block-wise int8, in the same buffer. The
// error buffer holds the `runs` runs in their source order (run r: values r n .. r n + n - 1 of
// the input), whatever order the packing takes them in, so an error stays with its values when
// the packing goes column by column. A zeroed buffer is no error (codes 0, scales 0).
//
// One quantization block at a time (quant_blocks), over the dispatched ISA's lanes: the
// compensated values into an f32 block, their largest magnitude, codes and scale (as the plain
// packing's kernels make them), the next error into a second f32 block (one fused multiply-add
// for the loss, one for the sum), then its int8 codes and scale into the error buffer. Work is
// cut into fixed chunks of whole blocks over the OpenMP threads; every ISA and thread count gives
// the rules' bits. The device's twin is ops/cuda/error_feedback.cuh.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include <zero/core/error.hpp>
#include <zero/core/error_feedback.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/ops/cpu/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>

namespace zero::ops::cpu {

namespace detail {

// Packs quantization blocks [begin, end) (quant_blocks) of `runs` packed runs of n values at Bits
// (8 or 4) with error feedback: each block of the source run quant::int8_source_run(j, runs,
// columns) compensated by its kept error (error: `runs` int8 packed runs in source order), packed
// into run j of out, and its next error kept in its place of error.
template <int Bits>
struct QuantizeFeedbackKernel {
  static_assert(Bits == 8 || Bits == 4, "error feedback packs int8 or int4 codes");

  template <class O, class T>
  static void run(const T* in, std::uint8_t* out, std::uint8_t* error,
                  quant::ErrorFeedback feedback, std::int64_t n, std::int64_t runs,
                  std::int64_t columns, std::int64_t begin, std::int64_t end) {
    constexpr float max_code = Bits == 8 ? 127.0f : quant::int4_max_code;
    const std::int64_t packed =
        Bits == 8 ? quant::int8_packed_bytes(n) : quant::int4_packed_bytes(n);
    const std::int64_t scales_at =
        Bits == 8 ? quant::int8_scales_offset(n) : quant::int4_scales_offset(n);
    alignas(64) float compensated[quant::int8_block];
    alignas(64) float next[quant::int8_block];
    alignas(64) std::int8_t codes[quant::int8_block];
    quant_blocks(
        n, begin, end, [&](std::int64_t j, std::int64_t b, std::int64_t first, std::int64_t count) {
          const std::int64_t source = quant::int8_source_run(j, runs, columns);
          const T* x = in + source * n + first;
          std::uint8_t* kept = error + source * quant::int8_packed_bytes(n);
          auto* kept_codes = reinterpret_cast<std::int8_t*>(kept + first);
          const float kept_scale = quant::int8_scale_at(kept, n, b);
          quant_lanes<O>(0, count, [&](auto ops, std::int64_t i) {  // quant::compensated
            using P = decltype(ops);
            P::store(compensated + i, P::fma(P::load_int8(kept_codes + i), P::set1(kept_scale),
                                             quant_load_values<P>(x + i)));
          });
          std::uint8_t* run = out + j * packed;
          const float scale = quant_block_codes<O>(compensated, count, max_code, codes);
          std::memcpy(run + scales_at + 4 * b, &scale, 4);
          quant_lanes<O>(0, count, [&](auto ops, std::int64_t i) {  // quant::next_error
            using P = decltype(ops);
            const auto lost =
                P::fma(P::load_int8(codes + i), P::set1(-scale), P::load(compensated + i));
            const auto old = P::mul(P::load_int8(kept_codes + i), P::set1(kept_scale));
            P::store(next + i,
                     P::fma(P::set1(feedback.beta), old, P::mul(P::set1(feedback.rest), lost)));
          });
          if constexpr (Bits == 8) {
            std::copy_n(codes, count, reinterpret_cast<std::int8_t*>(run + first));
          } else {
            if (count % 2 != 0) codes[count] = 0;  // the padding nibble
            pack_int4(codes, count, run + first / 2);
          }
          for (std::int64_t i = 0; i < count; ++i) {
            if (!std::isfinite(next[i])) next[i] = 0.0f;
          }
          const float next_scale = quant_block_codes<O>(next, count, 127.0f, kept_codes);
          std::memcpy(kept + quant::int8_scales_offset(n) + 4 * b, &next_scale, 4);
        });
  }
};

}  // namespace detail

/// out = in cut into `runs` equal runs, each packed at `bits` (8: core/int8_blocks.hpp, 4:
/// int4_blocks.hpp) after adding the error kept for it in `error`, which then holds the new error
/// (core/error_feedback.hpp; error: `runs` int8 packed runs of in's runs in source order, zeroed
/// for none). With columns > 1, in's runs are rows of `columns` runs and out takes them column by
/// column (quant::int8_source_run), as the plain packing does.
template <class T>
void quantize_with_feedback(std::span<const T> in, std::span<std::uint8_t> out,
                            std::span<std::uint8_t> error, quant::ErrorFeedback feedback, int bits,
                            std::int64_t runs = 1, std::int64_t columns = 1) {
  const std::int64_t n = quant::feedback_run_values(
      "quantize_with_feedback", bits, static_cast<std::int64_t>(in.size()), runs,
      static_cast<std::int64_t>(out.size()), static_cast<std::int64_t>(error.size()), columns);
  const auto launch = [&](auto body) {
    const auto kernel =
        detail::quant_kernel<decltype(body), T, const T*, std::uint8_t*, std::uint8_t*,
                             quant::ErrorFeedback, std::int64_t, std::int64_t, std::int64_t,
                             std::int64_t, std::int64_t>();
    parallel_chunks(runs * quant::int8_blocks(n), detail::quant_chunk_blocks, runs * n,
                    [&](std::int64_t begin, std::int64_t end) {
                      kernel(in.data(), out.data(), error.data(), feedback, n, runs, columns, begin,
                             end);
                    });
  };
  if (bits == 8) {
    launch(detail::QuantizeFeedbackKernel<8>{});
  } else {
    launch(detail::QuantizeFeedbackKernel<4>{});
  }
}

}  // namespace zero::ops::cpu
