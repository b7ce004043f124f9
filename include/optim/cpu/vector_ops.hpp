#pragma once
// The Ops vocabulary of update_rules.hpp for host kernels: one scalar lane, AVX2 (8 floats) and
// AVX-512 (16 floats), with the loads and stores of the fused pass (fp32/bf16/f16 gradients,
// bf16/f16 write-back with round-to-nearest-even or stochastic rounding).
//
// The vector functions carry __attribute__((target(...))), so this header compiles without
// -mavx2/-mavx512f; they are inlined only into the kernels of cpu/fused_driver.hpp, which carry
// the same target and are entered after a run-time CPU check (cpu/isa.hpp). Every conversion
// gives the bits of the scalar one in zero/core/bfloat16.hpp and float16.hpp (tested).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// nvcc's device pass must not see the vector types: the update rules are __host__ __device__
// templates, and instantiating them with an x86 vector type is an error in device code, so a .cu
// file that includes both the host optimizers and the CUDA ones sees only the scalar host path
// while compiling for the device (the host pass still gets every ISA).
// Unoptimised builds get no vector kernels either (see vector_kernels_compiled in isa.hpp).
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__) && defined(__OPTIMIZE__)
#include <immintrin.h>
#define ZERO_OPTIM_HAVE_X86 1
#endif

#include <optim/lane_ops.hpp>
#include <zero/core/dtype.hpp>

namespace zero::optim {

/// ScalarOps plus the host loads and stores of the fused pass, one element at a time.
struct ScalarHostOps : ScalarOps {
  /// One float.
  static float load(const float* p) { return *p; }
  /// Stores one float.
  static void store(float* p, float x) { *p = x; }
  /// One bf16 gradient, widened exactly.
  static float load(const bf16* p) { return bf16::to_float(p->bits); }
  /// One f16 gradient, widened exactly.
  static float load(const f16* p) { return f16::to_float(p->bits); }
  /// x rounded to bf16, nearest even.
  static void store_bf16(std::uint16_t* p, float x) { *p = bf16::round_nearest_even(x); }
  /// x rounded to bf16 stochastically with the 16 random bits in bits[0].
  static void store_bf16_stochastic(std::uint16_t* p, float x, const std::uint32_t* bits) {
    *p = bf16::round_stochastic(x, bits[0]);
  }
  /// x rounded to f16, nearest even.
  static void store_f16(std::uint16_t* p, float x) { *p = f16::round_nearest_even(x); }

  // For the host op kernels (ops/cpu/vector_math.hpp): each as the vector instructions do it.
  /// a < b ? a : b (b when either is NaN, as minps).
  static float min(float a, float b) { return a < b ? a : b; }
  /// a > b ? a : b (b when either is NaN, as maxps).
  static float max(float a, float b) { return a > b ? a : b; }
  /// x rounded to the nearest integer, ties to even (the default rounding mode).
  static float round_nearest(float x) { return std::nearbyint(x); }
  /// x * 2^n for an integral n in [-126, 127], exactly (n's bits as the exponent of a float); a
  /// NaN n (from a NaN x) gives x * 1, what the vector forms' conversion of NaN to INT_MIN makes.
  static float scale_pow2(float x, float n) {
    if (n != n) return x * 1.0f;
    const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
    float p;
    std::memcpy(&p, &bits, sizeof p);
    return x * p;
  }
  /// a where mask[0] is all ones, b where it is 0 (the only two values a mask word takes).
  static float select(const std::uint32_t* mask, float a, float b) { return mask[0] != 0 ? a : b; }
  /// |x| (the sign bit cleared, NaN kept NaN).
  static float abs(float x) { return std::fabs(x); }
  /// One int8 code, widened exactly.
  static float load_int8(const std::int8_t* p) { return static_cast<float>(*p); }
  /// x, an integer in [-128, 127], as an int8 code.
  static void store_int8(std::int8_t* p, float x) { *p = static_cast<std::int8_t>(x); }
};

#if defined(ZERO_OPTIM_HAVE_X86)

/// The target of the AVX2 kernels (F16C for f16 conversions, FMA for the fused multiply-adds).
#define ZERO_OPTIM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
/// The target of the AVX-512 kernels (AVX-512F; the AVX2 set for the 256-bit helpers).
#define ZERO_OPTIM_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

/// Eight floats in an AVX register.
struct Avx2Vec {
  __m256 v;
};

/// AVX2 + FMA + F16C: eight lanes.
struct Avx2Ops {
  using V = Avx2Vec;
  static constexpr int width = 8;

  /// All lanes equal to x.
  ZERO_OPTIM_TARGET_AVX2 static V set1(float x) { return {_mm256_set1_ps(x)}; }
  /// a + b per lane.
  ZERO_OPTIM_TARGET_AVX2 static V add(const V& a, const V& b) { return {_mm256_add_ps(a.v, b.v)}; }
  /// a - b per lane.
  ZERO_OPTIM_TARGET_AVX2 static V sub(const V& a, const V& b) { return {_mm256_sub_ps(a.v, b.v)}; }
  /// a * b per lane.
  ZERO_OPTIM_TARGET_AVX2 static V mul(const V& a, const V& b) { return {_mm256_mul_ps(a.v, b.v)}; }
  /// a / b per lane.
  ZERO_OPTIM_TARGET_AVX2 static V div(const V& a, const V& b) { return {_mm256_div_ps(a.v, b.v)}; }
  /// a * b + c per lane, one rounding.
  ZERO_OPTIM_TARGET_AVX2 static V fma(const V& a, const V& b, const V& c) {
    return {_mm256_fmadd_ps(a.v, b.v, c.v)};
  }
  /// c - a * b per lane, one rounding.
  ZERO_OPTIM_TARGET_AVX2 static V fnma(const V& a, const V& b, const V& c) {
    return {_mm256_fnmadd_ps(a.v, b.v, c.v)};
  }
  /// Correctly rounded square root per lane.
  ZERO_OPTIM_TARGET_AVX2 static V sqrt(const V& a) { return {_mm256_sqrt_ps(a.v)}; }
  /// +1, -1, or x itself (zeros, NaN) per lane, as ScalarOps::sign.
  ZERO_OPTIM_TARGET_AVX2 static V sign(const V& x) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 r = _mm256_blendv_ps(x.v, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x.v, zero, _CMP_GT_OQ));
    return {_mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x.v, zero, _CMP_LT_OQ))};
  }

  /// Loads the lanes from p.
  ZERO_OPTIM_TARGET_AVX2 static V load(const float* p) { return {_mm256_loadu_ps(p)}; }
  /// Stores the lanes to p.
  ZERO_OPTIM_TARGET_AVX2 static void store(float* p, const V& x) { _mm256_storeu_ps(p, x.v); }
  /// Loads bf16 values, widened exactly.
  ZERO_OPTIM_TARGET_AVX2 static V load(const bf16* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  /// Loads f16 values, widened exactly (F16C).
  ZERO_OPTIM_TARGET_AVX2 static V load(const f16* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  /// Packs eight 32-bit lanes holding 16-bit values into eight uint16 at p.
  ZERO_OPTIM_TARGET_AVX2 static void store_u16(std::uint16_t* p, __m256i lanes) {
    // packus works within 128-bit halves; the permute gathers the two useful quarters.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  /// Bits of bf16 round-to-nearest-even, as bf16::round_nearest_even, in 32-bit lanes.
  ZERO_OPTIM_TARGET_AVX2 static __m256i bf16_nearest_bits(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, is_nan);
  }
  /// Stores the lanes rounded to bf16, nearest even.
  ZERO_OPTIM_TARGET_AVX2 static void store_bf16(std::uint16_t* p, const V& x) {
    store_u16(p, bf16_nearest_bits(_mm256_castps_si256(x.v)));
  }
  /// Stores the lanes rounded to bf16 stochastically with 16 random bits per lane.
  ZERO_OPTIM_TARGET_AVX2 static void store_bf16_stochastic(std::uint16_t* p, const V& x,
                                                           const std::uint32_t* bits) {
    const __m256i u = _mm256_castps_si256(x.v);
    const __m256i random = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits)), _mm256_set1_epi32(0xffff));
    const __m256i stochastic = _mm256_srli_epi32(_mm256_add_epi32(u, random), 16);
    // Inf and NaN round to nearest (the random carry would corrupt them).
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i special = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f7fffff));
    store_u16(p, _mm256_blendv_epi8(stochastic, bf16_nearest_bits(u), special));
  }
  /// Stores the lanes rounded to f16, nearest even (F16C).
  ZERO_OPTIM_TARGET_AVX2 static void store_f16(std::uint16_t* p, const V& x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
  /// Copies the width uint16 at src to p past the cache (a non-temporal store: the line is not
  /// read first) when p is 16-byte aligned, else with a plain store. store_fence orders them.
  ZERO_OPTIM_TARGET_AVX2 static void stream_u16(std::uint16_t* p, const std::uint16_t* src) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if (reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
    }
  }
  /// Makes this thread's non-temporal stores visible before its later stores.
  ZERO_OPTIM_TARGET_AVX2 static void store_fence() { _mm_sfence(); }
  /// Per lane as ScalarHostOps::min.
  ZERO_OPTIM_TARGET_AVX2 static V min(const V& a, const V& b) { return {_mm256_min_ps(a.v, b.v)}; }
  /// Per lane as ScalarHostOps::max.
  ZERO_OPTIM_TARGET_AVX2 static V max(const V& a, const V& b) { return {_mm256_max_ps(a.v, b.v)}; }
  /// Per lane as ScalarHostOps::round_nearest.
  ZERO_OPTIM_TARGET_AVX2 static V round_nearest(const V& x) {
    return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  /// Per lane as ScalarHostOps::scale_pow2.
  ZERO_OPTIM_TARGET_AVX2 static V scale_pow2(const V& x, const V& n) {
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(x.v, _mm256_castsi256_ps(e))};
  }
  /// Per lane as ScalarHostOps::select (mask: one word per lane).
  ZERO_OPTIM_TARGET_AVX2 static V select(const std::uint32_t* mask, const V& a, const V& b) {
    const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask));
    return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(m))};
  }
  /// Per lane as ScalarHostOps::abs.
  ZERO_OPTIM_TARGET_AVX2 static V abs(const V& x) {
    return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x.v)};
  }
  /// Loads eight int8 codes, widened exactly.
  ZERO_OPTIM_TARGET_AVX2 static V load_int8(const std::int8_t* p) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes))};
  }
  /// Stores eight lanes, integers in [-128, 127], as int8 codes at p.
  ZERO_OPTIM_TARGET_AVX2 static void store_int8(std::int8_t* p, const V& x) {
    const __m256i words = _mm256_cvtps_epi32(x.v);
    const __m128i halves =
        _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(halves, halves));
  }
};

/// Sixteen floats in an AVX-512 register.
struct Avx512Vec {
  __m512 v;
};

/// AVX-512F: sixteen lanes.
struct Avx512Ops {
  using V = Avx512Vec;
  static constexpr int width = 16;
  // GCC 12 warns (-Wmaybe-uninitialized, a false positive fixed in GCC 13) inside the unmasked
  // AVX-512 intrinsics that start from _mm512_undefined_*; the zero-masked forms with an
  // all-ones mask compile to the same instructions without it.
  static constexpr __mmask16 all16 = 0xffff;

  /// All lanes equal to x.
  ZERO_OPTIM_TARGET_AVX512 static V set1(float x) { return {_mm512_set1_ps(x)}; }
  /// a + b per lane.
  ZERO_OPTIM_TARGET_AVX512 static V add(const V& a, const V& b) {
    return {_mm512_add_ps(a.v, b.v)};
  }
  /// a - b per lane.
  ZERO_OPTIM_TARGET_AVX512 static V sub(const V& a, const V& b) {
    return {_mm512_sub_ps(a.v, b.v)};
  }
  /// a * b per lane.
  ZERO_OPTIM_TARGET_AVX512 static V mul(const V& a, const V& b) {
    return {_mm512_mul_ps(a.v, b.v)};
  }
  /// a / b per lane.
  ZERO_OPTIM_TARGET_AVX512 static V div(const V& a, const V& b) {
    return {_mm512_div_ps(a.v, b.v)};
  }
  /// a * b + c per lane, one rounding.
  ZERO_OPTIM_TARGET_AVX512 static V fma(const V& a, const V& b, const V& c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  /// c - a * b per lane, one rounding.
  ZERO_OPTIM_TARGET_AVX512 static V fnma(const V& a, const V& b, const V& c) {
    return {_mm512_fnmadd_ps(a.v, b.v, c.v)};
  }
  /// Correctly rounded square root per lane.
  ZERO_OPTIM_TARGET_AVX512 static V sqrt(const V& a) { return {_mm512_maskz_sqrt_ps(all16, a.v)}; }
  /// +1, -1, or x itself (zeros, NaN) per lane, as ScalarOps::sign.
  ZERO_OPTIM_TARGET_AVX512 static V sign(const V& x) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 r =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, zero, _CMP_GT_OQ), x.v, _mm512_set1_ps(1.0f));
    return {
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, zero, _CMP_LT_OQ), r, _mm512_set1_ps(-1.0f))};
  }

  /// Loads the lanes from p.
  ZERO_OPTIM_TARGET_AVX512 static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  /// Stores the lanes to p.
  ZERO_OPTIM_TARGET_AVX512 static void store(float* p, const V& x) { _mm512_storeu_ps(p, x.v); }
  /// Loads bf16 values, widened exactly.
  ZERO_OPTIM_TARGET_AVX512 static V load(const bf16* p) {
    const __m512i wide =
        _mm512_maskz_cvtepu16_epi32(all16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, wide, 16))};
  }
  /// Loads f16 values, widened exactly (F16C).
  ZERO_OPTIM_TARGET_AVX512 static V load(const f16* p) {
    return {_mm512_maskz_cvtph_ps(all16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  /// Narrows sixteen 32-bit lanes holding 16-bit values into sixteen uint16 at p.
  ZERO_OPTIM_TARGET_AVX512 static void store_u16(std::uint16_t* p, __m512i lanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(all16, lanes));
  }
  /// Bits of bf16 round-to-nearest-even, as bf16::round_nearest_even, in 32-bit lanes.
  ZERO_OPTIM_TARGET_AVX512 static __m512i bf16_nearest_bits(__m512i u) {
    const __m512i lsb =
        _mm512_and_si512(_mm512_maskz_srli_epi32(all16, u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_maskz_srli_epi32(
        all16, _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __m512i quiet =
        _mm512_or_si512(_mm512_maskz_srli_epi32(all16, u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(is_nan, rounded, quiet);
  }
  /// Stores the lanes rounded to bf16, nearest even.
  ZERO_OPTIM_TARGET_AVX512 static void store_bf16(std::uint16_t* p, const V& x) {
    store_u16(p, bf16_nearest_bits(_mm512_castps_si512(x.v)));
  }
  /// Stores the lanes rounded to bf16 stochastically with 16 random bits per lane.
  ZERO_OPTIM_TARGET_AVX512 static void store_bf16_stochastic(std::uint16_t* p, const V& x,
                                                             const std::uint32_t* bits) {
    const __m512i u = _mm512_castps_si512(x.v);
    const __m512i random = _mm512_and_si512(_mm512_loadu_si512(bits), _mm512_set1_epi32(0xffff));
    const __m512i stochastic = _mm512_maskz_srli_epi32(all16, _mm512_add_epi32(u, random), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 special = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f7fffff));
    store_u16(p, _mm512_mask_blend_epi32(special, stochastic, bf16_nearest_bits(u)));
  }
  /// Stores the lanes rounded to f16, nearest even (F16C).
  ZERO_OPTIM_TARGET_AVX512 static void store_f16(std::uint16_t* p, const V& x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_maskz_cvtps_ph(all16, x.v, _MM_FROUND_TO_NEAREST_INT));
  }
  /// Copies the width uint16 at src to p past the cache (a non-temporal store: the line is not
  /// read first) when p is 32-byte aligned, else with a plain store. store_fence orders them.
  ZERO_OPTIM_TARGET_AVX512 static void stream_u16(std::uint16_t* p, const std::uint16_t* src) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if (reinterpret_cast<std::uintptr_t>(p) % 32 == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
    }
  }
  /// Makes this thread's non-temporal stores visible before its later stores.
  ZERO_OPTIM_TARGET_AVX512 static void store_fence() { _mm_sfence(); }
  /// Per lane as ScalarHostOps::min.
  ZERO_OPTIM_TARGET_AVX512 static V min(const V& a, const V& b) {
    return {_mm512_maskz_min_ps(all16, a.v, b.v)};
  }
  /// Per lane as ScalarHostOps::max.
  ZERO_OPTIM_TARGET_AVX512 static V max(const V& a, const V& b) {
    return {_mm512_maskz_max_ps(all16, a.v, b.v)};
  }
  /// Per lane as ScalarHostOps::round_nearest.
  ZERO_OPTIM_TARGET_AVX512 static V round_nearest(const V& x) {
    return {_mm512_maskz_roundscale_ps(all16, x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  /// Per lane as ScalarHostOps::scale_pow2.
  ZERO_OPTIM_TARGET_AVX512 static V scale_pow2(const V& x, const V& n) {
    const __m512i e = _mm512_maskz_slli_epi32(
        all16, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(all16, n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_mul_ps(x.v, _mm512_castsi512_ps(e))};
  }
  /// Per lane as ScalarHostOps::select (mask: one word per lane).
  ZERO_OPTIM_TARGET_AVX512 static V select(const std::uint32_t* mask, const V& a, const V& b) {
    const __m512i m = _mm512_loadu_si512(mask);
    return {_mm512_mask_blend_ps(_mm512_test_epi32_mask(m, m), b.v, a.v)};
  }
  /// Per lane as ScalarHostOps::abs.
  ZERO_OPTIM_TARGET_AVX512 static V abs(const V& x) {
    return {_mm512_castsi512_ps(
        _mm512_and_epi32(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7fffffff)))};
  }
  /// Loads sixteen int8 codes, widened exactly.
  ZERO_OPTIM_TARGET_AVX512 static V load_int8(const std::int8_t* p) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_maskz_cvtepi32_ps(all16, _mm512_maskz_cvtepi8_epi32(all16, codes))};
  }
  /// Stores sixteen lanes, integers in [-128, 127], as int8 codes at p.
  ZERO_OPTIM_TARGET_AVX512 static void store_int8(std::int8_t* p, const V& x) {
    const __m128i codes = _mm512_maskz_cvtsepi32_epi8(all16, _mm512_maskz_cvtps_epi32(all16, x.v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), codes);
  }
};

#endif  // ZERO_OPTIM_HAVE_X86

}  // namespace zero::optim
