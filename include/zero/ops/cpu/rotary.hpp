#pragma once
// Rotary position embedding (RoPE; Su et al., "RoFormer", 2021), in the "rotate half" form of
// Llama and the Hugging Face models: a head of hs channels is hs/2 pairs (i, i + hs/2), and the
// pair i of the row at position p turns by the angle p * theta^(-2i/hs):
//   out[i]        = x[i] cos - x[i + hs/2] sin
//   out[i + hs/2] = x[i + hs/2] cos + x[i] sin
// The backward turns the gradient back by the same angle (the rotation's transpose).
//
// The kernels work on rows of grouped qkv (grouped_qkv.hpp: layer_llama.hpp's attention
// projection, Megatron's layout for grouped-query attention): kv_heads groups, each `group` query
// heads, then one key head, then one value head, every head hs channels. The query and key heads
// turn, the value head is copied. Rows are (batch, position) pairs of seq_len positions each, at
// positions [first, first + seq_len) (first > 0: a sequence-parallel rank's block of every
// sequence). The angles come from rotary_table, in double, rounded once to the compute type; a
// frequency scaling (RopeScaling: Llama 3.1's, or linear position interpolation) applies there.
// float, bf16 and f16 compute each value as a rounded product and one fused multiply-add (a c - b s
// as fma(-b, s, a c)), on every ISA and on the device alike.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// A rope_scaling of Hugging Face's Llama config, by its rope_type:
/// - llama3 (Llama 3.1's, _compute_llama3_parameters): pairs whose wavelength 2 pi / f is below
///   original / high_freq_factor keep their frequency f, those above original / low_freq_factor
///   turn factor times slower, and those between blend the two by s = (original / wavelength -
///   low_freq_factor) / (high_freq_factor - low_freq_factor): (1 - s) f / factor + s f;
/// - linear (position interpolation, Chen et al. 2023; _compute_linear_scaling_rope_parameters):
///   every pair turns factor times slower, f / factor, as if position p were p / factor (the
///   other fields are unused).
/// factor 1 (the default) scales nothing.
struct RopeScaling {
  enum class Type { llama3, linear };
  Type type = Type::llama3;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;

  /// Hugging Face's rope_type of type.
  static const char* name_of(Type type) { return type == Type::linear ? "linear" : "llama3"; }
  /// True when it changes any frequency.
  bool active() const { return factor != 1.0; }
  /// Throws ConfigError naming the field of an unusable scaling.
  void validate() const {
    expect<ConfigError>(factor >= 1.0, "rope_scaling: factor ", factor, " must be >= 1");
    if (type == Type::linear) return;
    expect<ConfigError>(low_freq_factor > 0.0 && high_freq_factor > low_freq_factor,
                        "rope_scaling: low_freq_factor ", low_freq_factor, " and high_freq_factor ",
                        high_freq_factor, " must satisfy 0 < low < high");
    expect<ConfigError>(original_max_position_embeddings > 0,
                        "rope_scaling: original_max_position_embeddings ",
                        original_max_position_embeddings, " must be positive");
  }
  /// The scaled frequency of a pair whose frequency is f.
  double scaled(double f) const {
    if (!active()) return f;
    if (type == Type::linear) return f / factor;
    const double original = static_cast<double>(original_max_position_embeddings);
    const double wavelength = 2.0 * std::numbers::pi / f;
    if (wavelength < original / high_freq_factor) return f;
    if (wavelength > original / low_freq_factor) return f / factor;
    const double s =
        (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
    return (1.0 - s) * f / factor + s * f;
  }
};

/// cos and sin of the angle of every position in [first, first + seq_len) and pair i of a head of
/// head_size channels (even): each [seq_len, head_size / 2], angle p * f_i with
/// f_i = scaling.scaled(theta^(-2i / head_size)).
template <class A>
void rotary_table(A* cos_out, A* sin_out, std::int64_t first, std::int64_t seq_len,
                  std::int64_t head_size, double theta, const RopeScaling& scaling = {}) {
  expect<ShapeError>(head_size > 0 && head_size % 2 == 0, "rotary_table: head_size ", head_size,
                     " must be positive and even");
  expect<ConfigError>(theta > 1.0, "rotary_table: theta ", theta, " must be greater than 1");
  scaling.validate();
  const std::int64_t half = head_size / 2;
  for (std::int64_t i = 0; i < half; ++i) {
    const double inv_freq = scaling.scaled(
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_size)));
    for (std::int64_t t = 0; t < seq_len; ++t) {
      const double angle = static_cast<double>(first + t) * inv_freq;
      cos_out[t * half + i] = static_cast<A>(std::cos(angle));
      sin_out[t * half + i] = static_cast<A>(std::sin(angle));
    }
  }
}

namespace rotary_detail {
// Over every row of n: fn(row, position index t, head offset, rotates) for each head of the row.
template <class Fn>
void for_each_head(std::int64_t n, std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                   std::int64_t head_size, Fn&& fn) {
  const std::int64_t heads = kv_heads * (group + 2);
  const std::int64_t width = heads * head_size;
  parallel_for(n, [&](std::int64_t r) {
    const std::int64_t t = r % seq_len;
    for (std::int64_t h = 0; h < heads; ++h) {
      fn(r * width + h * head_size, t, h % (group + 2) <= group);
    }
  });
}

// The pairs [i, i + lanes) of one head (x's halves a and b) turned forward: a c - b s and
// b c + a s, each a rounded product and one fused multiply-add (the device's rotary.cuh computes
// the same two operations).
template <class O, class T>
inline void turn_at(T* out, const T* x, const float* c, const float* s, std::int64_t half,
                    std::int64_t i) {
  const auto a = load_lanes<O>(x + i), b = load_lanes<O>(x + half + i);
  const auto cos = O::load(c + i), sin = O::load(s + i);
  store_lanes<O>(out + i, O::fnma(b, sin, O::mul(a, cos)));
  store_lanes<O>(out + half + i, O::fma(a, sin, O::mul(b, cos)));
}

// The pairs [i, i + lanes) of one head's gradient turned back and added to dinp's (a start of
// zero when overwrite): a c + b s and b c - a s, as turn_at's operations.
template <class O, class T>
inline void turn_back_at(T* dinp, const T* d, const float* c, const float* s, std::int64_t half,
                         bool overwrite, std::int64_t i) {
  const auto a = load_lanes<O>(d + i), b = load_lanes<O>(d + half + i);
  const auto cos = O::load(c + i), sin = O::load(s + i);
  const auto zero = O::set1(0.0f);
  const auto lo = O::fma(b, sin, O::mul(a, cos)), hi = O::fnma(a, sin, O::mul(b, cos));
  store_lanes<O>(dinp + i, O::add(overwrite ? zero : load_lanes<O>(dinp + i), lo));
  store_lanes<O>(dinp + half + i, O::add(overwrite ? zero : load_lanes<O>(dinp + half + i), hi));
}

// dinp[i, i + lanes) (+)= d's: a value head's gradient passed through.
template <class O, class T>
inline void pass_at(T* dinp, const T* d, bool overwrite, std::int64_t i) {
  const auto zero = O::set1(0.0f);
  store_lanes<O>(dinp + i,
                 O::add(overwrite ? zero : load_lanes<O>(dinp + i), load_lanes<O>(d + i)));
}

// The grouped qkv rows [r0, r1) of rotary_forward (value heads copied).
struct Forward {
  template <class O, class T>
  static void run(T* out, const T* inp, const float* cos_t, const float* sin_t,
                  std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                  std::int64_t head_size, std::int64_t r0, std::int64_t r1) {
    const std::int64_t half = head_size / 2, heads = kv_heads * (group + 2);
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* c = cos_t + r % seq_len * half;
      const float* s = sin_t + r % seq_len * half;
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t o = (r * heads + h) * head_size;
        if (h % (group + 2) > group) {
          std::copy_n(inp + o, head_size, out + o);
          continue;
        }
        std::int64_t i = 0;
        for (; i + O::width <= half; i += O::width) turn_at<O>(out + o, inp + o, c, s, half, i);
        for (; i < half; ++i) turn_at<optim::ScalarHostOps>(out + o, inp + o, c, s, half, i);
      }
    }
  }
};

// The grouped qkv rows [r0, r1) of rotary_backward.
struct Backward {
  template <class O, class T>
  static void run(T* dinp, const T* dout, const float* cos_t, const float* sin_t,
                  std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                  std::int64_t head_size, bool overwrite, std::int64_t r0, std::int64_t r1) {
    using S = optim::ScalarHostOps;
    const std::int64_t half = head_size / 2, heads = kv_heads * (group + 2);
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* c = cos_t + r % seq_len * half;
      const float* s = sin_t + r % seq_len * half;
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t o = (r * heads + h) * head_size;
        std::int64_t i = 0;
        if (h % (group + 2) > group) {
          for (; i + O::width <= head_size; i += O::width)
            pass_at<O>(dinp + o, dout + o, overwrite, i);
          for (; i < head_size; ++i) pass_at<S>(dinp + o, dout + o, overwrite, i);
          continue;
        }
        for (; i + O::width <= half; i += O::width) {
          turn_back_at<O>(dinp + o, dout + o, c, s, half, overwrite, i);
        }
        for (; i < half; ++i) turn_back_at<S>(dinp + o, dout + o, c, s, half, overwrite, i);
      }
    }
  }
};
}  // namespace rotary_detail

/// out = inp with every query and key head of its n rows turned by its position's angles (cos,
/// sin: rotary_table's, for the rows' seq_len positions); value heads copied. float, bf16 and f16
/// run the dispatched kernels (isa_dispatch.hpp: every ISA and thread count the same bits, rows
/// in parallel); double the plain loop (the reference).
template <class T>
void rotary_forward(T* out, const T* inp, const compute_type_t<T>* cos_t,
                    const compute_type_t<T>* sin_t, std::int64_t n, std::int64_t seq_len,
                    std::int64_t kv_heads, std::int64_t group, std::int64_t head_size) {
  using A = compute_type_t<T>;
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<rotary_detail::Forward, T*, const T*, const float*, const float*, std::int64_t,
                   std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>();
    const std::int64_t width = kv_heads * (group + 2) * head_size;
    parallel_chunks(n, rows_per_task(width), n * width, [&](std::int64_t r0, std::int64_t r1) {
      kernel(out, inp, cos_t, sin_t, seq_len, kv_heads, group, head_size, r0, r1);
    });
    return;
  }
  const std::int64_t half = head_size / 2;
  rotary_detail::for_each_head(n, seq_len, kv_heads, group, head_size,
                               [&](std::int64_t o, std::int64_t t, bool rotates) {
                                 if (!rotates) {
                                   for (std::int64_t i = 0; i < head_size; ++i)
                                     out[o + i] = inp[o + i];
                                   return;
                                 }
                                 const A* c = cos_t + t * half;
                                 const A* s = sin_t + t * half;
                                 for (std::int64_t i = 0; i < half; ++i) {
                                   const A a = load(inp[o + i]), b = load(inp[o + half + i]);
                                   out[o + i] = store<T>(a * c[i] - b * s[i]);
                                   out[o + half + i] = store<T>(b * c[i] + a * s[i]);
                                 }
                               });
}

/// dinp (+=, or = when overwrite) the gradient of rotary_forward: each query and key head of
/// dout turned back by its position's angles, value heads passed through. Dispatched as
/// rotary_forward.
template <class T>
void rotary_backward(T* dinp, const T* dout, const compute_type_t<T>* cos_t,
                     const compute_type_t<T>* sin_t, std::int64_t n, std::int64_t seq_len,
                     std::int64_t kv_heads, std::int64_t group, std::int64_t head_size,
                     bool overwrite = false) {
  using A = compute_type_t<T>;
  if constexpr (dispatched_type<T>) {
    const auto kernel =
        kernel_for<rotary_detail::Backward, T*, const T*, const float*, const float*, std::int64_t,
                   std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t>();
    const std::int64_t width = kv_heads * (group + 2) * head_size;
    parallel_chunks(n, rows_per_task(width), n * width, [&](std::int64_t r0, std::int64_t r1) {
      kernel(dinp, dout, cos_t, sin_t, seq_len, kv_heads, group, head_size, overwrite, r0, r1);
    });
    return;
  }
  const std::int64_t half = head_size / 2;
  const auto start = [&](std::int64_t k) { return overwrite ? A(0) : load(dinp[k]); };
  rotary_detail::for_each_head(
      n, seq_len, kv_heads, group, head_size, [&](std::int64_t o, std::int64_t t, bool rotates) {
        if (!rotates) {
          for (std::int64_t i = 0; i < head_size; ++i) {
            dinp[o + i] = store<T>(start(o + i) + load(dout[o + i]));
          }
          return;
        }
        const A* c = cos_t + t * half;
        const A* s = sin_t + t * half;
        for (std::int64_t i = 0; i < half; ++i) {
          const A a = load(dout[o + i]), b = load(dout[o + half + i]);
          dinp[o + i] = store<T>(start(o + i) + (a * c[i] + b * s[i]));
          dinp[o + half + i] = store<T>(start(o + half + i) + (b * c[i] - a * s[i]));
        }
      });
}

}  // namespace zero::ops::cpu
