#pragma once
// Error feedback for quantized gradients: ZeRO++'s LoCo (zeropp_loco_param), which keeps what a
// packing lost and adds it to the next gradient packed at the same place, so the losses do not
// pile up step after step. A packing with feedback of a block of values g, with the error e kept
// for them:
//   c = g + e                             (the compensated values; one rounding, an fma)
//   codes, scale = the packing of c       (core/int8_blocks.hpp or int4_blocks.hpp)
//   e' = beta e + (1 - beta) (c - q scale)  (err_beta: how much of the old error stays)
// and e' is kept, block-wise int8 (core/int8_blocks.hpp's packing, as DeepSpeed keeps it: about a
// byte a value), for the next packing of the same values. An error that is not finite (a gradient
// that overflowed) is kept as 0, so one bad step does not poison every later one. The rules are
// __host__ __device__ helpers with explicit fused multiply-adds, so the host's kernel
// (ops/cpu/error_feedback.hpp) and the device's (ops/cuda/error_feedback.cuh) give the same bits.

#include <cmath>
#include <cstdint>

#include <zero/core/error.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/core/macros.hpp>

namespace zero::quant {

/// LoCo's parameters: err_beta, and 1 - err_beta rounded once (the host computes it, so every
/// kernel multiplies by the same float).
struct ErrorFeedback {
  float beta = 0.8f;
  float rest = 0.2f;

  static ErrorFeedback with_beta(float beta) { return {beta, 1.0f - beta}; }
};

/// Checks a packing with feedback, with a ShapeError naming op otherwise: bits 8 or 4, `values`
/// values cut into `runs` equal runs (rows of `columns`) packing into `bytes` bytes at that width,
/// and their kept errors, int8 runs in source order, in `kept_bytes`; returns a run's values. The
/// host's kernel and the device backend both check with it.
inline std::int64_t feedback_run_values(const char* op, int bits, std::int64_t values,
                                        std::int64_t runs, std::int64_t bytes,
                                        std::int64_t kept_bytes, std::int64_t columns = 1) {
  expect<ShapeError>(bits == 8 || bits == 4, op, ": ", bits, " bits; codes are 8 or 4 bits");
  const std::int64_t n = bits == 8 ? int8_run_values(op, values, runs, bytes, columns)
                                   : int4_run_values(op, values, runs, bytes, columns);
  const std::string kept = std::string(op) + " (the kept error)";
  int8_run_values(kept.c_str(), values, runs, kept_bytes);
  return n;
}

/// g + e, where e is the kept error's code e_code under e_scale (0 and 0 for no error): one fused
/// multiply-add, the one a sum of runs adds a code's value with.
ZERO_HOST_DEVICE float compensated(float g, std::int8_t e_code, float e_scale) {
  return int8_add_value(g, e_code, e_scale);
}

/// The error to keep for a compensated value c packed as code q under scale, the old error being
/// e: beta e + rest (c - q scale), each step rounded once (c - q scale and the last addition are
/// fused multiply-adds); 0 when that is not finite.
ZERO_HOST_DEVICE float next_error(float e, float c, std::int8_t q, float scale,
                                  ErrorFeedback feedback) {
#if defined(__CUDA_ARCH__)
  const float lost = __fmaf_rn(-static_cast<float>(q), scale, c);
  const float next = __fmaf_rn(feedback.beta, e, __fmul_rn(feedback.rest, lost));
  return isfinite(next) ? next : 0.0f;
#else
  const float lost = std::fma(-static_cast<float>(q), scale, c);
  const float next = std::fma(feedback.beta, e, feedback.rest * lost);
  return std::isfinite(next) ? next : 0.0f;
#endif
}

}  // namespace zero::quant
