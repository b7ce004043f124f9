// The dispatched host kernels (ops/cpu/isa_dispatch.hpp): every vector path the CPU has gives
// the scalar path's bits on odd sizes (tails, several chunks), every path is within a few ulp of
// the double reference (the int8 and int4 packing: the bits of core/int8_blocks.hpp's and
// int4_blocks.hpp's rules, applied one value at a time), and the float kernels do not depend on the
// thread count.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/arena.hpp>
#include <zero/core/error_feedback.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/hand_written_gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/activation.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/embedding.hpp>
#include <zero/ops/cpu/error_feedback.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>
#include <zero/ops/cpu/rms_norm.hpp>
#include <zero/ops/cpu/rotary.hpp>
#include <zero/ops/cpu/vector_math.hpp>
#include "../support/worse.hpp"
#include "gradcheck.hpp"
#include "thread_count.hpp"

using namespace zero::ops::cpu;
using zero::bf16;
using zero::f16;
using zero::testing::random_vector;
using zero::testing::with_threads;

namespace {

// The elements of v (any storage type) as doubles, for comparing with the f64 kernels.
template <class V>
std::vector<double> to_double(const V& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = zero::convert<double>(v[i]);
  return d;
}

}  // namespace

namespace {

// The vector ISAs this CPU and build run (none on other architectures or at -O0).
std::vector<Isa> vector_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (zero::optim::cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

// Runs fn under isa and restores the previous one.
template <class Fn>
auto with_isa(Isa isa, Fn&& fn) {
  const Isa before = set_host_isa(isa);
  struct Restore {
    Isa isa;
    ~Restore() { set_host_isa(isa); }
  } restore{before};
  return fn();
}

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = zero::convert<T>(static_cast<float>(v[i]));
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Forward and backward of GELU on x (dout fixed, dinp starting from start) under the current ISA.
template <class T>
std::vector<T> gelu_both(const std::vector<T>& x, const std::vector<T>& dout,
                         const std::vector<T>& start) {
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<T> out(x.size()), dinp = start;
  gelu_forward(out.data(), x.data(), n);
  gelu_backward(dinp.data(), x.data(), dout.data(), n);
  out.insert(out.end(), dinp.begin(), dinp.end());
  return out;
}

}  // namespace

TEST_CASE("exp over the op vocabulary: every ISA the same bits, within 2 ulp", "[unit][ops]") {
  std::vector<float> x;
  for (float v = -90.0f; v <= 90.0f; v += 0.0137f) x.push_back(v);
  std::vector<float> scalar(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    scalar[i] = vmath::exp<zero::optim::ScalarHostOps>(x[i]);
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(static_cast<double>(std::clamp(x[i], -87.0f, 88.0f)));
    INFO("x = " << x[i]);
    REQUIRE(std::abs(scalar[i] - ref) <= 2 * std::abs(ref) * 1.2e-7);
  }
  // The vector paths through GELU's forward: the same exp in every lane (checked by bits below).
}

TEST_CASE("a NaN logit makes its row's cross-entropy loss and gradients NaN on every ISA",
          "[unit][ops]") {
  // The exponentials clamp their argument to [-87, 88]; a clamp that took a NaN to 88 once made
  // a NaN logit pass as a large one: a finite loss (or Inf) and finite gradients, so the engine's
  // non-finite checks did not see it. A -inf logit (a masked entry) still adds nothing.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(std::isnan(vmath::exp<zero::optim::ScalarHostOps>(nan)));
  CHECK(vmath::exp<zero::optim::ScalarHostOps>(-inf) ==
        vmath::exp<zero::optim::ScalarHostOps>(-87.0f));
  const std::int64_t N = 4, V = 67;  // odd: vector bodies and scalar tails
  auto logits = as<float>(random_vector(static_cast<std::size_t>(N * V), 77, 4.0));
  logits[3] = -inf;                                          // row 0: a masked entry
  logits[static_cast<std::size_t>(V)] = nan;                 // row 1: first (a vector body)
  logits[static_cast<std::size_t>(3 * V - 1)] = nan;         // row 2: last (the scalar tail)
  std::fill(logits.begin() + 3 * V, logits.end() - 1, nan);  // row 3: NaN but its last element
  const std::vector<std::int32_t> targets{1, 2, 0, static_cast<std::int32_t>(V - 1)};
  std::vector<Isa> isas{Isa::scalar};
  for (Isa isa : vector_isas()) isas.push_back(isa);
  for (Isa isa : isas) {
    INFO("isa " << zero::optim::name_of(isa));
    for (const bool as_bf16 : {false, true}) {
      INFO((as_bf16 ? "bf16" : "f32"));
      std::vector<float> losses(static_cast<std::size_t>(N));
      std::vector<float> grads(logits.size());
      with_isa(isa, [&] {
        if (as_bf16) {
          const auto x = as<bf16>(to_double(logits));
          std::vector<bf16> d(x.size());
          cross_entropy_forward<bf16>(losses.data(), x.data(), targets.data(), N, V);
          cross_entropy_backward<bf16>(d.data(), x.data(), targets.data(), N, V, 1.0f);
          for (std::size_t i = 0; i < d.size(); ++i) grads[i] = zero::convert<float>(d[i]);
        } else {
          cross_entropy_forward<float>(losses.data(), logits.data(), targets.data(), N, V);
          cross_entropy_backward<float>(grads.data(), logits.data(), targets.data(), N, V, 1.0f);
        }
        return 0;
      });
      CHECK(std::isfinite(losses[0]));
      for (std::int64_t v = 0; v < V; ++v) {
        CHECK(std::isfinite(grads[static_cast<std::size_t>(v)]));
      }
      CHECK(std::fabs(grads[3]) < 1e-30f);  // e^-87 (the clamp) over the row's sum: next to 0
      for (std::int64_t n = 1; n < N; ++n) {
        INFO("row " << n);
        CHECK(std::isnan(losses[static_cast<std::size_t>(n)]));
        std::int64_t finite = 0;
        for (std::int64_t v = 0; v < V; ++v) {
          finite += std::isfinite(grads[static_cast<std::size_t>(n * V + v)]) ? 1 : 0;
        }
        CHECK(finite == 0);
      }
    }
  }
}

TEST_CASE("gelu: every ISA gives the scalar path's bits, f32 / bf16, odd sizes", "[unit][ops]") {
  for (std::int64_t n : {1, 7, 15, 17, 33, 4095, 4097, 3 * 4096 + 5}) {
    const auto xd = random_vector(static_cast<std::size_t>(n), 21, 6.0);
    const auto gd = random_vector(static_cast<std::size_t>(n), 22);
    const auto sd = random_vector(static_cast<std::size_t>(n), 23);
    const auto x32 = as<float>(xd), g32 = as<float>(gd), s32 = as<float>(sd);
    const auto x16 = as<bf16>(xd), g16 = as<bf16>(gd), s16 = as<bf16>(sd);
    const auto ref32 = with_isa(Isa::scalar, [&] { return gelu_both(x32, g32, s32); });
    const auto ref16 = with_isa(Isa::scalar, [&] { return gelu_both(x16, g16, s16); });
    for (Isa isa : vector_isas()) {
      INFO("n " << n << " isa " << zero::optim::name_of(isa));
      CHECK(same_bits(with_isa(isa, [&] { return gelu_both(x32, g32, s32); }), ref32));
      CHECK(same_bits(with_isa(isa, [&] { return gelu_both(x16, g16, s16); }), ref16));
    }
  }
}

TEST_CASE("gelu f32 is within a few ulp of the double formula, large |x| included", "[unit][ops]") {
  std::vector<double> xd;
  for (double v = -12.0; v <= 12.0; v += 0.00731) xd.push_back(v);
  const auto n = static_cast<std::int64_t>(xd.size());
  const std::vector<double> ones(xd.size(), 1.0), zeros(xd.size(), 0.0);
  std::vector<double> yd(xd.size()), dd(xd.size(), 0.0);
  gelu_forward(yd.data(), xd.data(), n);
  gelu_backward(dd.data(), xd.data(), ones.data(), n);
  const auto x32 = as<float>(xd);
  const auto both = gelu_both(x32, as<float>(ones), as<float>(zeros));
  for (std::size_t i = 0; i < xd.size(); ++i) {
    INFO("x = " << xd[i]);
    // Relative to the value, with an absolute floor where y or y' pass through zero.
    CHECK(std::abs(both[i] - yd[i]) <= 4e-7 * std::abs(yd[i]) + 1e-7);
    CHECK(std::abs(both[xd.size() + i] - dd[i]) <= 4e-7 * std::abs(dd[i]) + 4e-7);
  }
}

namespace {

// A kernel run's outputs as one byte string, for bitwise comparison.
struct Bytes {
  std::vector<unsigned char> data;
  template <class T>
  void add(const std::vector<T>& v) {
    if (v.empty()) return;  // (GCC 12's -Wnonnull otherwise sees a null source for insert)
    const std::size_t old = data.size(), n = v.size() * sizeof(T);
    data.resize(old + n);
    std::memcpy(data.data() + old, v.data(), n);
  }
  bool operator==(const Bytes&) const = default;
};

// Every vector ISA gives the scalar path's bytes, and 1 and 2 threads give the same bytes on
// every path.
template <class Fn>
void check_paths(Fn&& run) {
  std::vector<Isa> isas{Isa::scalar};
  for (Isa isa : vector_isas()) isas.push_back(isa);
  const Bytes reference = with_isa(Isa::scalar, [&] { return with_threads(1, run); });
  CHECK(!reference.data.empty());
  for (Isa isa : isas) {
    INFO("isa " << zero::optim::name_of(isa));
    CHECK(with_isa(isa, [&] { return with_threads(1, run); }) == reference);
    CHECK(with_isa(isa, [&] { return with_threads(2, run); }) == reference);
  }
}

// Normwise relative difference of got against the double reference: max |got - ref| / max |ref|.
template <class T>
double normwise_error(const std::vector<T>& got, const std::vector<double>& ref) {
  REQUIRE(got.size() == ref.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = zero::testing::worse(
        diff, std::abs(static_cast<double>(zero::convert<float>(got[i])) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// The f32 kernels against the double ones on the same (float-representable) inputs: every
// output within this normwise relative error (float rounding in sums of up to a few hundred
// terms and vmath::exp's 2 ulp, with margin).
constexpr double f32_vs_f64_tolerance = 2e-5;

std::vector<double> float_values(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  auto v = random_vector(n, seed, scale);
  for (auto& x : v) x = static_cast<float>(x);
  return v;
}

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return as<T>(v);
  }
}

// LayerNorm forward and backward over N rows of C, all outputs as doubles and bytes.
template <class T>
Bytes layer_norm_run(std::int64_t N, std::int64_t C, std::vector<std::vector<double>>* values) {
  using A = zero::compute_type_t<T>;
  const auto n = static_cast<std::size_t>(N * C), c = static_cast<std::size_t>(C);
  const auto x = cast<T>(float_values(n, 31, 3.0)), w = cast<T>(float_values(c, 32)),
             b = cast<T>(float_values(c, 33)), dy = cast<T>(float_values(n, 34));
  std::vector<T> out(n), dx = cast<T>(float_values(n, 35)), dw = cast<T>(float_values(c, 36)),
                         db = cast<T>(float_values(c, 37));
  std::vector<A> mean(static_cast<std::size_t>(N)), rstd(static_cast<std::size_t>(N));
  layer_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  layer_norm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), N, C);
  Bytes bytes;
  bytes.add(out), bytes.add(mean), bytes.add(rstd), bytes.add(dx), bytes.add(dw), bytes.add(db);
  if (values != nullptr) {
    *values = {to_double(out), to_double(mean), to_double(rstd),
               to_double(dx),  to_double(dw),   to_double(db)};
  }
  return bytes;
}

// Compares each output of the f32 run with the double run.
void check_against_double(const std::vector<std::vector<double>>& f32,
                          const std::vector<std::vector<double>>& f64) {
  REQUIRE(f32.size() == f64.size());
  for (std::size_t k = 0; k < f32.size(); ++k) {
    INFO("output " << k);
    CHECK(normwise_error(f32[k], f64[k]) <= f32_vs_f64_tolerance);
  }
}

}  // namespace

TEST_CASE(
    "layer_norm: every ISA and thread count the same bits, f32 / bf16 / f16, and f32 "
    "near f64",
    "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{
      {1, 1}, {3, 7}, {5, 17}, {2, 33}, {7, 63}, {9, 65}, {45, 768}, {300, 129}, {2, 4097}};
  for (auto [N, C] : shapes) {
    INFO("N " << N << " C " << C);
    check_paths([&] { return layer_norm_run<float>(N, C, nullptr); });
    check_paths([&] { return layer_norm_run<bf16>(N, C, nullptr); });
    check_paths([&] { return layer_norm_run<f16>(N, C, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    layer_norm_run<float>(N, C, &f32);
    layer_norm_run<double>(N, C, &f64);
    check_against_double(f32, f64);
  }
}

namespace {

template <class T>
Bytes rms_norm_run(std::int64_t N, std::int64_t C, std::vector<std::vector<double>>* values) {
  using A = zero::compute_type_t<T>;
  const auto n = static_cast<std::size_t>(N * C), c = static_cast<std::size_t>(C);
  const auto x = cast<T>(float_values(n, 41, 3.0)), w = cast<T>(float_values(c, 42)),
             dy = cast<T>(float_values(n, 43));
  std::vector<T> out(n), dx = cast<T>(float_values(n, 44)), dw = cast<T>(float_values(c, 45));
  std::vector<A> rstd(static_cast<std::size_t>(N));
  rms_norm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C);
  rms_norm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  Bytes bytes;
  bytes.add(out), bytes.add(rstd), bytes.add(dx), bytes.add(dw);
  if (values != nullptr) {
    *values = {to_double(out), to_double(rstd), to_double(dx), to_double(dw)};
  }
  return bytes;
}

}  // namespace

namespace {

// SwiGLU forward, then its backward added into one gradient and written into another.
template <class T>
Bytes swiglu_run(std::int64_t rows, std::int64_t f, std::vector<std::vector<double>>* values) {
  const auto n = static_cast<std::size_t>(rows * f);
  const auto x = cast<T>(float_values(2 * n, 61, 6.0)), dy = cast<T>(float_values(n, 62));
  std::vector<T> out(n), dx = cast<T>(float_values(2 * n, 63)), written(2 * n);
  swiglu_forward(out.data(), x.data(), rows, f);
  swiglu_backward(dx.data(), x.data(), dy.data(), rows, f);
  swiglu_backward(written.data(), x.data(), dy.data(), rows, f, true);
  Bytes bytes;
  bytes.add(out), bytes.add(dx), bytes.add(written);
  if (values != nullptr) *values = {to_double(out), to_double(dx), to_double(written)};
  return bytes;
}

}  // namespace

// Rows of 1 to 1100 gates (vector bodies and scalar tails), 2 rows to 3000 (one task and several).
TEST_CASE("swiglu: every ISA and thread count the same bits, f32 / bf16, and f32 near f64",
          "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{
      {1, 1}, {3, 7}, {5, 17}, {2, 33}, {9, 48}, {45, 1100}, {3000, 24}};
  for (auto [rows, f] : shapes) {
    INFO("rows " << rows << " f " << f);
    check_paths([&] { return swiglu_run<float>(rows, f, nullptr); });
    check_paths([&] { return swiglu_run<bf16>(rows, f, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    swiglu_run<float>(rows, f, &f32);
    swiglu_run<double>(rows, f, &f64);
    check_against_double(f32, f64);
  }
}

namespace {

// A shape of grouped qkv rows: n rows of seq_len positions, kv_heads groups of `group` query
// heads, one key and one value head, of head_size channels.
struct QkvShape {
  std::int64_t n, seq_len, kv_heads, group, head_size;
};

// The rotary embedding forward from position 3, then its backward added into one gradient and
// written into another.
template <class T>
Bytes rotary_run(const QkvShape& s, std::vector<std::vector<double>>* values) {
  using A = zero::compute_type_t<T>;
  const auto n =
      static_cast<std::size_t>(s.n * grouped_qkv_width(s.kv_heads, s.group, s.head_size));
  const auto table = static_cast<std::size_t>(s.seq_len * s.head_size / 2);
  std::vector<A> cos_t(table), sin_t(table);
  rotary_table(cos_t.data(), sin_t.data(), 3, s.seq_len, s.head_size, 500000.0);
  const auto x = cast<T>(float_values(n, 71, 2.0)), dy = cast<T>(float_values(n, 72));
  std::vector<T> out(n), dx = cast<T>(float_values(n, 73)), written(n);
  rotary_forward(out.data(), x.data(), cos_t.data(), sin_t.data(), s.n, s.seq_len, s.kv_heads,
                 s.group, s.head_size);
  rotary_backward(dx.data(), dy.data(), cos_t.data(), sin_t.data(), s.n, s.seq_len, s.kv_heads,
                  s.group, s.head_size);
  rotary_backward(written.data(), dy.data(), cos_t.data(), sin_t.data(), s.n, s.seq_len, s.kv_heads,
                  s.group, s.head_size, true);
  Bytes bytes;
  bytes.add(out), bytes.add(dx), bytes.add(written);
  if (values != nullptr) *values = {to_double(out), to_double(dx), to_double(written)};
  return bytes;
}

// repeat_kv forward, then its backward added into one gradient and written into another.
template <class T>
Bytes repeat_kv_run(const QkvShape& s, std::vector<std::vector<double>>* values) {
  const auto in =
      static_cast<std::size_t>(s.n * grouped_qkv_width(s.kv_heads, s.group, s.head_size));
  const auto out_n = static_cast<std::size_t>(s.n * 3 * s.kv_heads * s.group * s.head_size);
  const auto x = cast<T>(float_values(in, 81)), dy = cast<T>(float_values(out_n, 82));
  std::vector<T> out(out_n), dx = cast<T>(float_values(in, 83)), written(in);
  repeat_kv_forward(out.data(), x.data(), s.n, s.kv_heads, s.group, s.head_size);
  repeat_kv_backward(dx.data(), dy.data(), s.n, s.kv_heads, s.group, s.head_size);
  repeat_kv_backward(written.data(), dy.data(), s.n, s.kv_heads, s.group, s.head_size, true);
  Bytes bytes;
  bytes.add(out), bytes.add(dx), bytes.add(written);
  if (values != nullptr) *values = {to_double(out), to_double(dx), to_double(written)};
  return bytes;
}

// Odd head sizes' halves (vector bodies and scalar tails), one row, and 200 rows of 256 channels
// (several tasks, run in parallel).
const std::vector<QkvShape> qkv_shapes{{1, 1, 1, 1, 2},  {6, 3, 2, 2, 8},     {10, 5, 1, 3, 18},
                                       {8, 4, 2, 4, 64}, {200, 50, 2, 2, 32}, {3, 3, 1, 1, 34}};

}  // namespace

TEST_CASE("rotary: every ISA and thread count the same bits, f32 / bf16, and f32 near f64",
          "[unit][ops]") {
  for (const QkvShape& s : qkv_shapes) {
    INFO("n " << s.n << " seq_len " << s.seq_len << " kv_heads " << s.kv_heads << " group "
              << s.group << " head_size " << s.head_size);
    check_paths([&] { return rotary_run<float>(s, nullptr); });
    check_paths([&] { return rotary_run<bf16>(s, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    rotary_run<float>(s, &f32);
    rotary_run<double>(s, &f64);
    check_against_double(f32, f64);
  }
}

TEST_CASE("repeat_kv: every ISA and thread count the bits of the plain loop, f32 / bf16",
          "[unit][ops]") {
  for (const QkvShape& s : qkv_shapes) {
    INFO("n " << s.n << " kv_heads " << s.kv_heads << " group " << s.group << " head_size "
              << s.head_size);
    check_paths([&] { return repeat_kv_run<float>(s, nullptr); });
    check_paths([&] { return repeat_kv_run<bf16>(s, nullptr); });
    // The sums in head order, as the plain loop (double's) adds them, in float: the same bits.
    std::vector<std::vector<double>> got, f64;
    repeat_kv_run<bf16>(s, &got);
    repeat_kv_run<double>(s, &f64);
    CHECK(got[0] == to_double(as<bf16>(f64[0])));  // the forward copies the rounded inputs
    const auto in =
        static_cast<std::size_t>(s.n * grouped_qkv_width(s.kv_heads, s.group, s.head_size));
    const auto dy = as<bf16>(
        float_values(static_cast<std::size_t>(s.n * 3 * s.kv_heads * s.group * s.head_size), 82));
    std::vector<float> start(in), want(in);
    const auto dx0 = as<bf16>(float_values(in, 83));
    const std::int64_t hs = s.head_size, heads = s.kv_heads * s.group;
    for (std::int64_t r = 0; r < s.n; ++r) {
      for (std::int64_t j = 0; j < s.kv_heads; ++j) {
        for (std::int64_t c = 0; c < hs; ++c) {
          const std::int64_t base = r * s.kv_heads * (s.group + 2) * hs + j * (s.group + 2) * hs;
          const std::int64_t row_out = r * 3 * heads * hs;
          for (std::int64_t i = 0; i < s.group; ++i) {
            const auto k = static_cast<std::size_t>(base + i * hs + c);
            want[k] = zero::convert<float>(dx0[k]) +
                      zero::convert<float>(
                          dy[static_cast<std::size_t>(row_out + (j * s.group + i) * hs + c)]);
          }
          for (std::int64_t which = 0; which < 2; ++which) {  // the key, then the value
            const auto k = static_cast<std::size_t>(base + (s.group + which) * hs + c);
            float sum = zero::convert<float>(dx0[k]);
            for (std::int64_t i = 0; i < s.group; ++i) {
              sum += zero::convert<float>(dy[static_cast<std::size_t>(
                  row_out + ((1 + which) * heads + j * s.group + i) * hs + c)]);
            }
            want[k] = sum;
          }
        }
      }
    }
    CHECK(got[1] == to_double(as<bf16>(std::vector<double>(want.begin(), want.end()))));
  }
}

TEST_CASE("rms_norm: every ISA and thread count the same bits, f32 / bf16, and f32 near f64",
          "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{
      {1, 1}, {3, 7}, {5, 17}, {2, 33}, {9, 65}, {45, 768}, {300, 129}};
  for (auto [N, C] : shapes) {
    INFO("N " << N << " C " << C);
    check_paths([&] { return rms_norm_run<float>(N, C, nullptr); });
    check_paths([&] { return rms_norm_run<bf16>(N, C, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    rms_norm_run<float>(N, C, &f32);
    rms_norm_run<double>(N, C, &f64);
    check_against_double(f32, f64);
  }
}

namespace {

// Targets for N rows over V: row 1 ignored, the others spread over the vocabulary.
std::vector<std::int32_t> ce_targets(std::int64_t N, std::int64_t V) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(N));
  for (std::int64_t n = 0; n < N; ++n) {
    t[static_cast<std::size_t>(n)] =
        n == 1 ? ignore_index : static_cast<std::int32_t>((n * 7919 + 3) % V);
  }
  return t;
}

// Loss, mean and dlogits; with row_stats the backward takes the forward's row max and sum, and
// in_place writes dlogits over the logits. With pad, the rows lie V + pad apart, NaN in the
// padding of the logits (never read) and garbage in dlogits' (which must become zeros); dlogits
// comes back packed, so the bytes compare with those of pad 0.
template <class T>
Bytes cross_entropy_run(std::int64_t N, std::int64_t V, std::vector<std::vector<double>>* values,
                        bool row_stats = false, bool in_place = false, std::int64_t pad = 0) {
  using A = zero::compute_type_t<T>;
  const std::int64_t ld = V + pad;
  const auto packed = cast<T>(float_values(static_cast<std::size_t>(N * V), 51, 8.0));
  auto logits = cast<T>(std::vector<double>(static_cast<std::size_t>(N * ld),
                                            std::numeric_limits<double>::quiet_NaN()));
  for (std::int64_t n = 0; n < N; ++n) {
    std::copy_n(packed.begin() + n * V, V, logits.begin() + n * ld);
  }
  const auto targets = ce_targets(N, V);
  std::vector<A> losses(static_cast<std::size_t>(N));
  std::vector<A> stats(static_cast<std::size_t>(2 * N));
  // dlogits is written, not accumulated: start from garbage to see every element written.
  std::vector<T> dlogits = cast<T>(float_values(static_cast<std::size_t>(N * ld), 52, 100.0));
  const std::vector<A> mean{cross_entropy_forward(losses.data(), logits.data(), targets.data(), N,
                                                  V, row_stats ? stats.data() : nullptr, ld)};
  T* out = in_place ? logits.data() : dlogits.data();
  cross_entropy_backward(out, logits.data(), targets.data(), N, V, A(0.7), -1,
                         row_stats ? stats.data() : nullptr, ld);
  if (in_place) dlogits = logits;
  std::vector<T> rows(static_cast<std::size_t>(N * V));
  bool zero_padding = true;
  for (std::int64_t n = 0; n < N; ++n) {
    std::copy_n(dlogits.begin() + n * ld, V, rows.begin() + n * V);
    for (std::int64_t v = V; v < ld; ++v) {
      zero_padding = zero_padding && zero::convert<double>(dlogits[n * ld + v]) == 0.0;
    }
  }
  REQUIRE(zero_padding);
  dlogits = rows;
  Bytes bytes;
  bytes.add(losses), bytes.add(mean), bytes.add(dlogits);
  if (values != nullptr) {
    *values = {to_double(losses), to_double(mean), to_double(dlogits)};
  }
  return bytes;
}

}  // namespace

TEST_CASE(
    "cross_entropy: every ISA and thread count the same bits, f32 / bf16, V = 50257, and "
    "f32 near f64",
    "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{{1, 1},  {2, 7},     {3, 17},
                                                                  {3, 33}, {5, 16383}, {4, 50257}};
  for (auto [N, V] : shapes) {
    INFO("N " << N << " V " << V);
    check_paths([&] { return cross_entropy_run<float>(N, V, nullptr); });
    check_paths([&] { return cross_entropy_run<bf16>(N, V, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    cross_entropy_run<float>(N, V, &f32);
    cross_entropy_run<double>(N, V, &f64);
    check_against_double(f32, f64);
    // Ignored row: zero loss and zero gradient.
    if (N > 1) {
      CHECK(f32[0][1] == 0.0);
      for (std::int64_t v = 0; v < V; ++v) REQUIRE(f32[2][static_cast<std::size_t>(V + v)] == 0.0);
    }
  }
}

TEST_CASE(
    "cross_entropy backward from the forward's row max and sum: the bits of recomputing them, "
    "in place too, on every ISA",
    "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{
      {1, 1}, {2, 7}, {3, 33}, {5, 16383}, {4, 50257}};
  for (auto [N, V] : shapes) {
    INFO("N " << N << " V " << V);
    for (const bool in_place : {false, true}) {
      INFO("in place " << in_place);
      CHECK(cross_entropy_run<float>(N, V, nullptr, true, in_place) ==
            cross_entropy_run<float>(N, V, nullptr, false, in_place));
      CHECK(cross_entropy_run<bf16>(N, V, nullptr, true, in_place) ==
            cross_entropy_run<bf16>(N, V, nullptr, false, in_place));
      CHECK(cross_entropy_run<double>(N, V, nullptr, true, in_place) ==
            cross_entropy_run<double>(N, V, nullptr, false, in_place));
    }
    check_paths([&] { return cross_entropy_run<float>(N, V, nullptr, true); });
    check_paths([&] { return cross_entropy_run<bf16>(N, V, nullptr, true); });
  }
}

TEST_CASE(
    "cross_entropy over rows ld apart: the bits of packed rows, zeros in the padding of dlogits, "
    "on every ISA",
    "[unit][ops]") {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{{1, 1}, {3, 17}, {4, 50257}};
  for (auto [N, V] : shapes) {
    for (const std::int64_t pad : {1, 7}) {
      INFO("N " << N << " V " << V << " pad " << pad);
      for (const bool row_stats : {false, true}) {
        for (const bool in_place : {false, true}) {
          INFO("row stats " << row_stats << ", in place " << in_place);
          CHECK(cross_entropy_run<float>(N, V, nullptr, row_stats, in_place, pad) ==
                cross_entropy_run<float>(N, V, nullptr, row_stats, in_place));
          CHECK(cross_entropy_run<bf16>(N, V, nullptr, row_stats, in_place, pad) ==
                cross_entropy_run<bf16>(N, V, nullptr, row_stats, in_place));
          CHECK(cross_entropy_run<double>(N, V, nullptr, row_stats, in_place, pad) ==
                cross_entropy_run<double>(N, V, nullptr, row_stats, in_place));
        }
      }
      check_paths([&] { return cross_entropy_run<bf16>(N, V, nullptr, true, true, pad); });
    }
  }
  // Rows closer than V apart are refused.
  std::vector<float> logits(12, 0.0f), losses(3);
  const std::vector<std::int32_t> targets{0, 1, 2};
  CHECK_THROWS_AS(cross_entropy_forward(losses.data(), logits.data(), targets.data(), 3, 4,
                                        static_cast<float*>(nullptr), 3),
                  zero::ShapeError);
  CHECK_THROWS_WITH(cross_entropy_backward(logits.data(), logits.data(), targets.data(), 3, 4, 1.0f,
                                           -1, static_cast<const float*>(nullptr), 3),
                    Catch::Contains("3 elements apart cannot hold 4 logits"));
}

namespace {

// Targets (n * 7 + 3) % V for N rows, shifted by shift columns.
std::vector<std::int32_t> spread_targets(std::int64_t N, std::int64_t V, std::int64_t shift) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(N));
  for (std::int64_t n = 0; n < N; ++n) {
    t[static_cast<std::size_t>(n)] = static_cast<std::int32_t>((n * 7 + 3 + shift) % V);
  }
  return t;
}

// Cross-entropy over many rows whose target entry (softmax - 1, times the scale) lands on every
// kind of rounding case: logits in [-2, 2], the one at column (n * 7 + 3) % V raised by 1 so its
// probability spreads over (0, 0.5), targets t. Returns losses and dlogits as bytes; dlogits
// also through *dlogits_out.
template <class T>
Bytes cross_entropy_target_run(std::int64_t N, std::int64_t V, const std::vector<std::int32_t>& t,
                               std::vector<T>* dlogits_out) {
  using A = zero::compute_type_t<T>;
  const auto raised = spread_targets(N, V, 0);
  auto values = float_values(static_cast<std::size_t>(N * V), 58, 2.0);
  for (std::int64_t n = 0; n < N; ++n) {
    values[static_cast<std::size_t>(n * V + raised[static_cast<std::size_t>(n)])] += 1.0;
  }
  const auto logits = cast<T>(values);
  std::vector<A> losses(static_cast<std::size_t>(N));
  std::vector<T> dlogits(static_cast<std::size_t>(N * V));
  cross_entropy_forward(losses.data(), logits.data(), t.data(), N, V);
  cross_entropy_backward(dlogits.data(), logits.data(), t.data(), N, V, A(0.7));
  Bytes bytes;
  bytes.add(losses), bytes.add(dlogits);
  if (dlogits_out != nullptr) *dlogits_out = dlogits;
  return bytes;
}

}  // namespace

TEST_CASE(
    "cross_entropy backward: the target's entry is the row's value minus the scale (two "
    "roundings) on every ISA",
    "[unit][ops]") {
  // The target's entry once was e * factor - scale written as a plain product fed into a
  // subtraction: the AVX2/AVX-512 instantiations (target "fma") contracted it into one FMA, the
  // scalar one rounded twice, and about one row in a hundred differed in the last bit.
  for (std::int64_t V : {64, 67}) {
    const std::int64_t N = 1024;
    const auto targets = spread_targets(N, V, 0);
    INFO("V " << V);
    check_paths([&] { return cross_entropy_target_run<float>(N, V, targets, nullptr); });
    check_paths([&] { return cross_entropy_target_run<bf16>(N, V, targets, nullptr); });
    // The row pass's value at the target, read from a run whose targets sit one column over
    // (the same valid count, so the same scale), minus the scale: what every ISA writes.
    const auto shifted = spread_targets(N, V, 1);
    std::vector<float> row_values;
    with_isa(Isa::scalar,
             [&] { return cross_entropy_target_run<float>(N, V, shifted, &row_values); });
    const float scale = 0.7f / static_cast<float>(N);
    std::vector<Isa> isas{Isa::scalar};
    for (Isa isa : vector_isas()) isas.push_back(isa);
    for (Isa isa : isas) {
      INFO("isa " << zero::optim::name_of(isa));
      std::vector<float> dlogits;
      with_isa(isa, [&] { return cross_entropy_target_run<float>(N, V, targets, &dlogits); });
      std::int64_t wrong = 0;
      for (std::int64_t n = 0; n < N; ++n) {
        const auto i = static_cast<std::size_t>(n * V + targets[static_cast<std::size_t>(n)]);
        const float want = row_values[i] - scale;
        if (std::memcmp(&dlogits[i], &want, sizeof want) != 0) ++wrong;
      }
      CHECK(wrong == 0);
    }
  }
}

namespace {

// Loss and every gradient of one forward/backward of the hand-written GPT (tiny, one layer) on
// B = 3, T = 7 with two ignored targets, as bytes.
Bytes gpt_gradients_run() {
  zero::nn::GPTConfig cfg = zero::nn::GPTConfig::preset("tiny");
  cfg.num_layers = 1;
  zero::nn::HandWrittenGPT<float> model(cfg);
  zero::nn::LocalParameters<zero::nn::HandWrittenGPT<float>> params(model, 5);
  const std::int64_t B = 3, Tn = 7;
  std::vector<std::int32_t> tokens, targets;
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 11 + 2) % cfg.vocab_size));
    targets.push_back(i == 4 || i == 17 ? ignore_index
                                        : static_cast<std::int32_t>((i * 7 + 3) % cfg.vocab_size));
  }
  zero::Arena<> arena(32 << 20);
  zero::nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = B;
  ctx.seq_len = Tn;
  Bytes bytes;
  bytes.add(std::vector<float>{model.forward(ctx)});
  model.backward(ctx);
  for (int u = 0; u < model.num_units(); ++u) {
    const auto g = params.unit_grads(u);
    bytes.add(std::vector<float>(g.begin(), g.end()));
  }
  return bytes;
}

}  // namespace

TEST_CASE("a whole GPT's loss and gradients: every ISA and thread count the same bits",
          "[unit][ops]") {
  // 19 valid targets of 21: a cross-entropy scale whose target entries once rounded differently
  // under the vector ISAs than under the scalar one (see the cross_entropy backward test).
  check_paths(gpt_gradients_run);
}

namespace {

const std::vector<std::int64_t> elementwise_sizes{1,    7,    17,           33,   4095,
                                                  4096, 4097, 3 * 4096 + 5, 40000};

template <class T>
Bytes add_run(std::int64_t n, std::vector<std::vector<double>>* values) {
  const auto a = cast<T>(float_values(static_cast<std::size_t>(n), 61)),
             b = cast<T>(float_values(static_cast<std::size_t>(n), 62));
  std::vector<T> out(a.size()), acc = cast<T>(float_values(static_cast<std::size_t>(n), 63));
  add(out.data(), a.data(), b.data(), n);
  accumulate(acc.data(), a.data(), n);
  Bytes bytes;
  bytes.add(out), bytes.add(acc);
  if (values != nullptr) {
    std::vector<double> o(out.size()), c(acc.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      o[i] = zero::convert<double>(out[i]);
      c[i] = zero::convert<double>(acc[i]);
    }
    *values = {o, c};
  }
  return bytes;
}

}  // namespace

TEST_CASE("add / accumulate: every ISA and thread count the same bits, f32 / bf16 / f16",
          "[unit][ops]") {
  for (std::int64_t n : elementwise_sizes) {
    INFO("n " << n);
    check_paths([&] { return add_run<float>(n, nullptr); });
    check_paths([&] { return add_run<bf16>(n, nullptr); });
    check_paths([&] { return add_run<f16>(n, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    add_run<float>(n, &f32);
    add_run<double>(n, &f64);
    check_against_double(f32, f64);
  }
}

namespace {

template <class T>
Bytes dropout_run(std::int64_t n, double p) {
  const zero::CounterRng rng(1234);
  const auto x = cast<T>(float_values(static_cast<std::size_t>(n), 71, 4.0)),
             dy = cast<T>(float_values(static_cast<std::size_t>(n), 72));
  std::vector<T> out = cast<T>(float_values(static_cast<std::size_t>(n), 73)),
                 dx = cast<T>(float_values(static_cast<std::size_t>(n), 74));
  dropout_forward(out.data(), x.data(), n, p, rng, 5);
  dropout_backward(dx.data(), dy.data(), n, p, rng, 5);
  Bytes bytes;
  bytes.add(out), bytes.add(dx);
  return bytes;
}

}  // namespace

TEST_CASE(
    "dropout: every ISA and thread count the same bits, f32 / bf16, and the mask of "
    "DropoutMask::keep",
    "[unit][ops]") {
  for (double p : {0.0, 0.1, 0.5}) {
    for (std::int64_t n : elementwise_sizes) {
      INFO("p " << p << " n " << n);
      check_paths([&] { return dropout_run<float>(n, p); });
      check_paths([&] { return dropout_run<bf16>(n, p); });
      // f32 against the definition, element by element (the CUDA kernels draw the same mask).
      const zero::CounterRng rng(1234);
      const DropoutMask mask{p, rng, 5};
      const auto x = as<float>(float_values(static_cast<std::size_t>(n), 71, 4.0)),
                 dy = as<float>(float_values(static_cast<std::size_t>(n), 72)),
                 dx0 = as<float>(float_values(static_cast<std::size_t>(n), 74));
      std::vector<float> out(x.size()), dx = dx0;
      dropout_forward(out.data(), x.data(), n, p, rng, 5);
      dropout_backward(dx.data(), dy.data(), n, p, rng, 5);
      const float scale = mask.scale<float>();
      std::int64_t mismatches = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const bool keep = mask.keep(static_cast<std::int64_t>(i));
        const float factor = keep ? scale : 0.0f;  // a dropped element is multiplied by 0
        const float want_out = x[i] * factor;
        const float want_dx = std::fma(dy[i], factor, dx0[i]);
        if (std::memcmp(&out[i], &want_out, sizeof(float)) != 0 ||
            std::memcmp(&dx[i], &want_dx, sizeof(float)) != 0) {
          ++mismatches;
        }
      }
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE(
    "dropout: a mask placed at first draws the elements first to first + n of the mask from 0, "
    "on every ISA, f32 / bf16",
    "[unit][ops]") {
  // A micro-batch at global row r of a step draws its rows' masks at their global indices
  // (StepContext::dropout_first): its tensor must equal the same rows of one tensor over the
  // whole batch, whether first is a whole number of Philox groups of four or not.
  const zero::CounterRng rng(77);
  for (const std::int64_t first : {0, 4, 5, 7, 1003}) {
    for (const std::int64_t n : {1, 3, 64, 1001}) {
      INFO("first " << first << " n " << n);
      const auto whole = float_values(static_cast<std::size_t>(first + n), 75, 4.0);
      const auto whole_dy = float_values(whole.size(), 76);
      auto run = [&]<class T>(std::type_identity<T>) {
        const auto x = cast<T>(whole), dy = cast<T>(whole_dy);
        std::vector<T> out(x.size()), dx(x.size(), zero::convert<T>(0.25f));
        std::vector<T> part(static_cast<std::size_t>(n)),
            dpart(static_cast<std::size_t>(n), zero::convert<T>(0.25f));
        dropout_forward(out.data(), x.data(), first + n, 0.3, rng, 9);
        dropout_backward(dx.data(), dy.data(), first + n, 0.3, rng, 9);
        const DropoutMask placed{0.3, rng, 9, static_cast<std::uint64_t>(first)};
        dropout_forward(part.data(), x.data() + first, n, placed);
        dropout_backward(dpart.data(), dy.data() + first, n, placed);
        Bytes bytes;
        bytes.add(part), bytes.add(dpart);
        const bool same =
            std::memcmp(part.data(), out.data() + first, part.size() * sizeof(T)) == 0 &&
            std::memcmp(dpart.data(), dx.data() + first, dpart.size() * sizeof(T)) == 0;
        CHECK(same);
        return bytes;
      };
      check_paths([&] { return run(std::type_identity<float>{}); });
      check_paths([&] { return run(std::type_identity<bf16>{}); });
    }
  }
  // Another first is another mask (a negative control for the comparison above).
  std::vector<float> x(256, 1.0f), a(x.size()), b(x.size());
  dropout_forward(a.data(), x.data(), 256, DropoutMask{0.5, rng, 9, 0});
  dropout_forward(b.data(), x.data(), 256, DropoutMask{0.5, rng, 9, 8});
  CHECK(a != b);
}

TEST_CASE(
    "dropout: a mask placed in blocks draws each block's part of every row of the whole mask, on "
    "every ISA, f32 / bf16",
    "[unit][ops]") {
  // A rank holding part k of `parts` of each of `rows` rows (a tensor-parallel rank's heads, a
  // Ulysses rank's positions; nn::DropoutShard) draws those elements of the whole tensor's mask:
  // first = row0 * width + k * part, block = part, stride = width. Parts of a multiple of four
  // and not; the whole from row 0 and from row 3 of a longer batch.
  const zero::CounterRng rng(78);
  for (const std::int64_t part : {1, 6, 8, 37}) {
    for (const std::int64_t row0 : {0, 3}) {
      const std::int64_t parts = 3, rows = 5, width = part * parts;
      const std::int64_t whole_n = (row0 + rows) * width;
      const auto whole = float_values(static_cast<std::size_t>(whole_n), 79, 4.0);
      const auto whole_dy = float_values(whole.size(), 80);
      for (std::int64_t k = 0; k < parts; ++k) {
        INFO("part " << part << " row0 " << row0 << " k " << k);
        auto run = [&]<class T>(std::type_identity<T>) {
          const auto x = cast<T>(whole), dy = cast<T>(whole_dy);
          std::vector<T> out(x.size()), dx(x.size(), zero::convert<T>(0.25f));
          dropout_forward(out.data(), x.data(), whole_n, 0.3, rng, 4);
          dropout_backward(dx.data(), dy.data(), whole_n, 0.3, rng, 4);
          std::vector<T> in, grad, want, want_dx;
          for (std::int64_t r = 0; r < rows; ++r) {
            const auto at = static_cast<std::size_t>((row0 + r) * width + k * part);
            const auto end = at + static_cast<std::size_t>(part);
            in.insert(in.end(), x.begin() + at, x.begin() + end);
            grad.insert(grad.end(), dy.begin() + at, dy.begin() + end);
            want.insert(want.end(), out.begin() + at, out.begin() + end);
            want_dx.insert(want_dx.end(), dx.begin() + at, dx.begin() + end);
          }
          DropoutMask placed{0.3, rng, 4, static_cast<std::uint64_t>(row0 * width + k * part)};
          placed.block = static_cast<std::uint64_t>(part);
          placed.stride = static_cast<std::uint64_t>(width);
          std::vector<T> got(in.size()), got_dx(in.size(), zero::convert<T>(0.25f));
          dropout_forward(got.data(), in.data(), rows * part, placed);
          dropout_backward(got_dx.data(), grad.data(), rows * part, placed);
          CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0);
          CHECK(std::memcmp(got_dx.data(), want_dx.data(), got_dx.size() * sizeof(T)) == 0);
          const DropoutMask unplaced{0.3, rng, 4};
          for (std::int64_t i = 0; i < rows * part; ++i) {  // keep() as the vector path places
            const std::int64_t global = (row0 + i / part) * width + k * part + i % part;
            if (placed.keep(i) != unplaced.keep(global)) FAIL_CHECK("keep(" << i << ")");
          }
          Bytes bytes;
          bytes.add(got), bytes.add(got_dx);
          return bytes;
        };
        check_paths([&] { return run(std::type_identity<float>{}); });
        check_paths([&] { return run(std::type_identity<bf16>{}); });
      }
    }
  }
  // from(i): the contiguous mask of i's block from i on.
  DropoutMask m{0.5, rng, 2, 7};
  m.block = 12;
  m.stride = 40;
  const DropoutMask tail = m.from(17);  // block 1, element 5: index 7 + 40 + 5
  CHECK(tail.first == 52);
  for (std::int64_t j = 0; j < 7; ++j) CHECK(tail.keep(j) == m.keep(17 + j));
}

namespace {

// Dropout of x (forward) and of dy into dx (backward) with the mask of (p, rng, 5), as floats.
template <class T>
std::pair<std::vector<float>, std::vector<float>> dropout_values(const std::vector<float>& x,
                                                                 const std::vector<float>& dy,
                                                                 double p) {
  const zero::CounterRng rng(1234);
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<T> tx(x.size()), tdy(x.size()), out(x.size()), dx(x.size(), zero::convert<T>(0.5f));
  for (std::size_t i = 0; i < x.size(); ++i) {
    tx[i] = zero::convert<T>(x[i]);
    tdy[i] = zero::convert<T>(dy[i]);
  }
  dropout_forward(out.data(), tx.data(), n, p, rng, 5);
  dropout_backward(dx.data(), tdy.data(), n, p, rng, 5);
  std::pair<std::vector<float>, std::vector<float>> r;
  for (std::size_t i = 0; i < x.size(); ++i) {
    r.first.push_back(zero::convert<float>(out[i]));
    r.second.push_back(zero::convert<float>(dx[i]));
  }
  return r;
}

}  // namespace

TEST_CASE(
    "dropout: a NaN or infinity stays NaN where it is dropped, on every ISA, f32 / bf16 / f64",
    "[unit][ops]") {
  // PyTorch's dropout is x * mask * scale and its backward grad * mask * scale, so a non-finite
  // element it drops is NaN (0 * inf, 0 * NaN), and the loss scaler's overflow check sees it. A
  // dropout that selected 0 for a dropped element hid a NaN activation or gradient there.
  const double p = 0.5;
  const DropoutMask mask{p, zero::CounterRng(1234), 5};
  const std::int64_t n = 103;  // vector bodies and a scalar tail
  std::vector<float> x(static_cast<std::size_t>(n), -1.5f), dy(x.size(), 2.0f);
  std::vector<std::size_t> dropped, kept;
  for (std::size_t i = 0; i < x.size(); ++i) {
    (mask.keep(static_cast<std::int64_t>(i)) ? kept : dropped).push_back(i);
  }
  REQUIRE(dropped.size() >= 4);
  REQUIRE(kept.size() >= 2);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // Dropped: NaN first (a vector body), inf, -inf, NaN last; kept: NaN and inf.
  const std::vector<std::size_t> nonfinite{dropped.front(), dropped[1],   dropped[2],
                                           dropped.back(),  kept.front(), kept.back()};
  const std::vector<float> values{nan, inf, -inf, nan, nan, inf};
  for (std::size_t k = 0; k < nonfinite.size(); ++k) {
    x[nonfinite[k]] = values[k];
    dy[nonfinite[k]] = values[k];
  }
  std::vector<Isa> isas{Isa::scalar};
  for (Isa isa : vector_isas()) isas.push_back(isa);
  for (Isa isa : isas) {
    INFO("isa " << zero::optim::name_of(isa));
    for (int type = 0; type < 3; ++type) {
      INFO((type == 0 ? "f32" : type == 1 ? "bf16" : "f64"));
      const auto [out, dx] = with_isa(isa, [&] {
        return type == 0   ? dropout_values<float>(x, dy, p)
               : type == 1 ? dropout_values<bf16>(x, dy, p)
                           : dropout_values<double>(x, dy, p);
      });
      for (std::size_t k = 0; k < nonfinite.size(); ++k) {
        const std::size_t i = nonfinite[k];
        INFO("element " << i << " holding " << values[k]);
        const bool keep = mask.keep(static_cast<std::int64_t>(i));
        if (keep && std::isinf(values[k])) {
          CHECK(out[i] == values[k]);  // scaled, still infinite
          CHECK(dx[i] == values[k]);
        } else {
          CHECK(std::isnan(out[i]));
          CHECK(std::isnan(dx[i]));
        }
      }
      // Finite elements: kept ones scaled, dropped ones 0 (negative zero for a negative x, as
      // in PyTorch) with their gradient untouched.
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (!std::isfinite(x[i])) continue;
        INFO("element " << i);
        if (mask.keep(static_cast<std::int64_t>(i))) {
          CHECK(out[i] == -3.0f);
          CHECK(dx[i] == 4.5f);
        } else {
          CHECK(out[i] == 0.0f);
          CHECK(std::signbit(out[i]));
          CHECK(dx[i] == 0.5f);
        }
      }
    }
  }
}

namespace {

template <class T>
Bytes embedding_run(std::int64_t B, std::int64_t Tn, std::int64_t C, bool positions,
                    std::vector<std::vector<double>>* values) {
  constexpr std::int64_t V = 11;  // few tokens: rows repeat
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * Tn));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 7 + i / 3) % V);
  }
  const auto wte = cast<T>(float_values(static_cast<std::size_t>(V * C), 81)),
             wpe = cast<T>(float_values(static_cast<std::size_t>(Tn * C), 82)),
             dout = cast<T>(float_values(static_cast<std::size_t>(B * Tn * C), 83));
  std::vector<T> out(static_cast<std::size_t>(B * Tn * C)),
      dwte = cast<T>(float_values(static_cast<std::size_t>(V * C), 84)),
      dwpe = cast<T>(float_values(static_cast<std::size_t>(Tn * C), 85));
  embedding_forward(out.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, B, Tn,
                    C, V);
  embedding_backward(dwte.data(), positions ? dwpe.data() : nullptr, dout.data(), tokens.data(), B,
                     Tn, C);
  Bytes bytes;
  bytes.add(out), bytes.add(dwte), bytes.add(dwpe);
  if (values != nullptr) {
    *values = {to_double(out), to_double(dwte), to_double(dwpe)};
  }
  return bytes;
}

}  // namespace

TEST_CASE("embedding: every ISA and thread count the same bits, f32 / bf16, and f32 near f64",
          "[unit][ops]") {
  const std::vector<std::array<std::int64_t, 3>> shapes{
      {1, 1, 1}, {2, 3, 7}, {2, 5, 17}, {3, 7, 33}, {2, 9, 65}, {4, 64, 129}, {2, 16, 1031}};
  for (auto [B, Tn, C] : shapes) {
    for (bool positions : {true, false}) {
      INFO("B " << B << " T " << Tn << " C " << C << " positions " << positions);
      check_paths([&] { return embedding_run<float>(B, Tn, C, positions, nullptr); });
      check_paths([&] { return embedding_run<bf16>(B, Tn, C, positions, nullptr); });
      std::vector<std::vector<double>> f32, f64;
      embedding_run<float>(B, Tn, C, positions, &f32);
      embedding_run<double>(B, Tn, C, positions, &f64);
      check_against_double(f32, f64);
    }
  }
}

namespace {

// linear_forward's bias broadcast and linear_backward's bias gradient (the GEMMs are BLAS's).
template <class T>
Bytes linear_bias_run(std::int64_t N, std::int64_t C, std::int64_t OC,
                      std::vector<std::vector<double>>* values) {
  const auto inp = cast<T>(float_values(static_cast<std::size_t>(N * C), 91)),
             weight = cast<T>(float_values(static_cast<std::size_t>(OC * C), 92)),
             bias = cast<T>(float_values(static_cast<std::size_t>(OC), 93)),
             dout = cast<T>(float_values(static_cast<std::size_t>(N * OC), 94));
  std::vector<T> out(static_cast<std::size_t>(N * OC)),
      dbias = cast<T>(float_values(static_cast<std::size_t>(OC), 95));
  linear_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  linear_backward<T>(nullptr, nullptr, dbias.data(), dout.data(), inp.data(), weight.data(), N, C,
                     OC);
  Bytes bytes;
  bytes.add(out), bytes.add(dbias);
  if (values != nullptr) {
    *values = {to_double(out), to_double(dbias)};
  }
  return bytes;
}

}  // namespace

TEST_CASE("linear bias: every ISA and thread count the same bits, f32 / bf16, and f32 near f64",
          "[unit][ops]") {
  const std::vector<std::array<std::int64_t, 3>> shapes{{1, 1, 1},  {3, 5, 7},     {5, 3, 17},
                                                        {4, 9, 33}, {300, 8, 129}, {70, 4, 1031}};
  for (auto [N, C, OC] : shapes) {
    INFO("N " << N << " C " << C << " OC " << OC);
    check_paths([&] { return linear_bias_run<float>(N, C, OC, nullptr); });
    check_paths([&] { return linear_bias_run<bf16>(N, C, OC, nullptr); });
    std::vector<std::vector<double>> f32, f64;
    linear_bias_run<float>(N, C, OC, &f32);
    linear_bias_run<double>(N, C, OC, &f64);
    check_against_double(f32, f64);
  }
}

namespace {

// Runs kernel(dinp, overwrite) twice, once adding into zeros and once writing over garbage;
// returns whether the two results have the same bits.
template <class T, class Kernel>
bool overwrite_equals_adding_into_zeros(std::size_t n, Kernel&& kernel) {
  std::vector<T> added(n, zero::convert<T>(0.0f)), written(n, zero::convert<T>(1e30f));
  kernel(added.data(), false);
  kernel(written.data(), true);
  return std::memcmp(added.data(), written.data(), n * sizeof(T)) == 0;
}

template <class T>
void check_overwrite(std::int64_t N, std::int64_t C) {
  const auto n = static_cast<std::size_t>(N * C);
  const auto x = cast<T>(float_values(n, 51, 3.0)), dy = cast<T>(float_values(n, 52));
  const auto w = cast<T>(float_values(static_cast<std::size_t>(C), 53));
  const auto b = cast<T>(float_values(static_cast<std::size_t>(C), 54));
  INFO("N " << N << " C " << C);
  CHECK(overwrite_equals_adding_into_zeros<T>(n, [&](T* dinp, bool overwrite) {
    gelu_backward(dinp, x.data(), dy.data(), static_cast<std::int64_t>(n), overwrite);
  }));
  std::vector<T> y(n);
  std::vector<float> mean(static_cast<std::size_t>(N)), rstd(mean.size());
  layer_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  CHECK(overwrite_equals_adding_into_zeros<T>(n, [&](T* dinp, bool overwrite) {
    std::vector<T> dw(static_cast<std::size_t>(C)), db(dw.size());
    layer_norm_backward(dinp, dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                        rstd.data(), N, C, overwrite);
  }));
  // Linear's input gradient: dinp [N, C] from dout [N, C] and a [C, C] weight.
  const auto weight = cast<T>(float_values(static_cast<std::size_t>(C * C), 55));
  CHECK(overwrite_equals_adding_into_zeros<T>(n, [&](T* dinp, bool overwrite) {
    linear_backward<T>(dinp, nullptr, nullptr, dy.data(), x.data(), weight.data(), N, C, C,
                       overwrite);
  }));
}

}  // namespace

TEST_CASE(
    "input-gradient overwrite (Layer::writes_input_grad) equals adding into zeros, bit "
    "for bit",
    "[unit][ops]") {
  for (auto [N, C] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 17}, {70, 33}, {9, 600}}) {
    check_overwrite<float>(N, C);
    check_overwrite<bf16>(N, C);
  }
  // Negative control: a kernel that adds even when asked to write is caught.
  const auto x = float_values(40, 56), dy = float_values(40, 57);
  CHECK_FALSE(overwrite_equals_adding_into_zeros<double>(
      40, [&](double* dinp, bool) { gelu_backward(dinp, x.data(), dy.data(), 40, false); }));
}

namespace {

// Outputs of the attention softmax kernels on one block: att's rows, the probabilities P V
// multiplies (dropout applied) and dS.
template <class T>
struct SoftmaxBlock {
  std::vector<T> att;
  std::vector<zero::compute_type_t<T>> probs, ds;
};

// The mask attention_softmax_block draws for p.
DropoutMask softmax_block_mask(double p) {
  return p > 0 ? DropoutMask{p, zero::CounterRng(11), 2} : DropoutMask{};
}

// The block kernels of attention.hpp for storage type T on query rows t0 + r (r < rows) of a head
// with three positions past the block (so att has entries to zero beyond the block's keys),
// scores drawn from +-score_range, dP at random, the mask of the fourth head (bh = 3).
template <class T>
SoftmaxBlock<T> attention_softmax_block(std::int64_t t0, std::int64_t rows, double p,
                                        double score_range) {
  using A = zero::compute_type_t<T>;
  const std::int64_t keys = t0 + rows, Tn = keys + 3;
  const DropoutMask mask = softmax_block_mask(p);
  const std::int64_t mask_index = (3 * Tn + t0) * Tn;
  SoftmaxBlock<T> out;
  // att starts nonzero everywhere: the kernel must write the zeros above the diagonal.
  out.att = cast<T>(std::vector<double>(static_cast<std::size_t>(rows * Tn), 7.0));
  out.probs = cast<A>(float_values(static_cast<std::size_t>(rows * keys), 91, score_range));
  detail::attention_softmax_for<T>()(out.probs.data(), keys, out.att.data(), Tn, t0, rows, &mask,
                                     mask_index);
  out.ds = cast<A>(float_values(static_cast<std::size_t>(rows * keys), 92));
  detail::attention_softmax_backward_for<T>()(out.ds.data(), out.att.data(), Tn, t0, rows, A(0.125),
                                              &mask, mask_index);
  return out;
}

template <class T>
Bytes attention_softmax_block_bytes(std::int64_t t0, std::int64_t rows, double p,
                                    double score_range) {
  const auto block = attention_softmax_block<T>(t0, rows, p, score_range);
  Bytes bytes;
  bytes.add(block.att), bytes.add(block.probs), bytes.add(block.ds);
  return bytes;
}

// Blocks (t0, rows) whose rows have 1 to 130 keys: single rows of odd lengths, a whole query
// block (1 to 64 keys), rows around the block size and a block of 66 rows (65 to 130 keys).
const std::vector<std::pair<std::int64_t, std::int64_t>> softmax_blocks{
    {0, 1}, {6, 1}, {16, 1}, {0, 64}, {62, 3}, {64, 66}, {129, 1}};

// True when every entry of the f32 or bf16 block is what mask (drawn at the block's index) and
// the stored att make it: probs = att * scale where kept, 0 where dropped and past the diagonal;
// att 0 past the diagonal. Adds the causal entries dropped and kept to the counts.
template <class T>
bool follows_mask(const SoftmaxBlock<T>& block, std::int64_t t0, std::int64_t rows,
                  const DropoutMask& mask, std::int64_t& dropped, std::int64_t& kept) {
  const std::int64_t keys = t0 + rows, Tn = keys + 3;
  const std::int64_t mask_index = (3 * Tn + t0) * Tn;
  bool ok = true;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < Tn; ++i) {
      const float a = zero::convert<float>(block.att[static_cast<std::size_t>(r * Tn + i)]);
      const bool causal = i <= t0 + r;
      if (!causal) ok = ok && a == 0.0f;
      if (i >= keys) continue;
      const bool keep = causal && mask.keep(mask_index + r * Tn + i);
      if (causal) ++(keep ? kept : dropped);
      const float want = keep ? a * mask.scale<float>() : 0.0f;
      ok = ok && std::memcmp(&block.probs[static_cast<std::size_t>(r * keys + i)], &want,
                             sizeof(float)) == 0;
    }
  }
  return ok;
}

}  // namespace

TEST_CASE(
    "attention softmax kernels: every ISA the same bits on rows of 1 to 130 keys, f32 / bf16 / "
    "f16, with and without dropout",
    "[unit][ops]") {
  for (auto [t0, rows] : softmax_blocks) {
    for (double p : {0.0, 0.25}) {
      // Scores up to 60 apart put e^(x - max) below e^-87, where vmath::exp clamps.
      for (double score_range : {4.0, 60.0}) {
        INFO("t0 " << t0 << " rows " << rows << " p " << p << " scores +-" << score_range);
        check_paths([&] { return attention_softmax_block_bytes<float>(t0, rows, p, score_range); });
        check_paths([&] { return attention_softmax_block_bytes<bf16>(t0, rows, p, score_range); });
        check_paths([&] { return attention_softmax_block_bytes<f16>(t0, rows, p, score_range); });
      }
    }
  }
}

TEST_CASE(
    "attention softmax kernels: the dropout mask of DropoutMask::keep, and f32 near the f64 "
    "loops",
    "[unit][ops]") {
  std::int64_t dropped = 0, kept = 0;  // causal entries over all blocks with dropout
  for (auto [t0, rows] : softmax_blocks) {
    for (double p : {0.0, 0.25}) {
      INFO("t0 " << t0 << " rows " << rows << " p " << p);
      const auto f32 = attention_softmax_block<float>(t0, rows, p, 4.0);
      const auto f64 = attention_softmax_block<double>(t0, rows, p, 4.0);
      CHECK(normwise_error(f32.att, to_double(f64.att)) <= f32_vs_f64_tolerance);
      CHECK(normwise_error(f32.probs, to_double(f64.probs)) <= f32_vs_f64_tolerance);
      CHECK(normwise_error(f32.ds, to_double(f64.ds)) <= f32_vs_f64_tolerance);
      if (p == 0.0) continue;
      CHECK(follows_mask(f32, t0, rows, softmax_block_mask(p), dropped, kept));
      CHECK(follows_mask(attention_softmax_block<bf16>(t0, rows, p, 4.0), t0, rows,
                         softmax_block_mask(p), dropped, kept));
    }
  }
  CHECK(dropped > 0);
  CHECK(kept > dropped);
  // Negative control: the mask of another stream is not the one the kernels drew.
  const DropoutMask other_stream{0.25, zero::CounterRng(11), 3};
  CHECK_FALSE(follows_mask(attention_softmax_block<float>(0, 64, 0.25, 4.0), 0, 64, other_stream,
                           dropped, kept));
}

namespace {

// attention_forward and backward on B = 2, C = 16, NH = 2 at sequence length Tn: out, att and
// dqkv as bytes.
template <class T>
Bytes attention_run(std::int64_t Tn, double p) {
  constexpr std::int64_t B = 2, C = 16, NH = 2;
  const auto qkv = cast<T>(float_values(static_cast<std::size_t>(B * Tn * 3 * C), 93, 2.0)),
             dout = cast<T>(float_values(static_cast<std::size_t>(B * Tn * C), 94));
  std::vector<T> out(static_cast<std::size_t>(B * Tn * C)),
      att(static_cast<std::size_t>(B * NH * Tn * Tn)), dqkv = cast<T>(float_values(qkv.size(), 95));
  const DropoutMask mask = p > 0 ? DropoutMask{p, zero::CounterRng(12), 4} : DropoutMask{};
  attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH, mask);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, C, NH, mask);
  Bytes bytes;
  bytes.add(out), bytes.add(att), bytes.add(dqkv);
  return bytes;
}

}  // namespace

TEST_CASE(
    "attention: every ISA and thread count the same bits, f32 / bf16, T 1 to 130, with and "
    "without dropout",
    "[unit][ops]") {
  for (std::int64_t Tn : {1, 7, 17, 63, 65, 130}) {
    for (double p : {0.0, 0.25}) {
      INFO("T " << Tn << " p " << p);
      check_paths([&] { return attention_run<float>(Tn, p); });
      check_paths([&] { return attention_run<bf16>(Tn, p); });
    }
  }
}

namespace {

namespace quant = zero::quant;

// The two block formats: their rules one value at a time, and their kernels.
struct Int8Format {
  static constexpr const char* name = "int8";
  static std::int64_t packed_bytes(std::int64_t n) { return quant::int8_packed_bytes(n); }
  static float scale(float absmax) { return quant::int8_scale(absmax); }
  static float scale_at(const std::uint8_t* run, std::int64_t n, std::int64_t b) {
    return quant::int8_scale_at(run, n, b);
  }
  static std::int64_t scales_offset(std::int64_t n) { return quant::int8_scales_offset(n); }
  static void put_codes(std::uint8_t* run, const std::vector<std::int8_t>& codes) {
    std::memcpy(run, codes.data(), codes.size());
  }
  static std::int8_t code(float x, float scale) { return quant::int8_code(x, scale); }
  static std::int8_t code_at(const std::uint8_t* run, std::int64_t i) {
    return static_cast<std::int8_t>(run[i]);
  }
  template <class T>
  static void pack(std::span<const T> in, std::span<std::uint8_t> out, std::int64_t runs,
                   std::int64_t columns) {
    quantize_int8_blocks(in, out, runs, columns);
  }
  template <class T>
  static void unpack(std::span<const std::uint8_t> in, std::span<T> out, std::int64_t runs) {
    dequantize_int8_blocks(in, out, runs);
  }
  template <class T>
  static void sum(std::span<const std::uint8_t> in, std::span<T> out, float factor,
                  std::int64_t outputs) {
    sum_int8_blocks(in, out, factor, outputs);
  }
};

struct Int4Format {
  static constexpr const char* name = "int4";
  static std::int64_t packed_bytes(std::int64_t n) { return quant::int4_packed_bytes(n); }
  static float scale(float absmax) { return quant::int4_scale(absmax); }
  static float scale_at(const std::uint8_t* run, std::int64_t n, std::int64_t b) {
    return quant::int4_scale_at(run, n, b);
  }
  static std::int64_t scales_offset(std::int64_t n) { return quant::int4_scales_offset(n); }
  static void put_codes(std::uint8_t* run, const std::vector<std::int8_t>& codes) {
    for (std::size_t i = 0; i < codes.size(); i += 2) {
      run[i / 2] = quant::int4_pair(codes[i], i + 1 < codes.size() ? codes[i + 1] : 0);
    }
  }
  static std::int8_t code(float x, float scale) { return quant::int4_code(x, scale); }
  static std::int8_t code_at(const std::uint8_t* run, std::int64_t i) {
    return quant::int4_code_at(run, i);
  }
  template <class T>
  static void pack(std::span<const T> in, std::span<std::uint8_t> out, std::int64_t runs,
                   std::int64_t columns) {
    quantize_int4_blocks(in, out, runs, columns);
  }
  template <class T>
  static void unpack(std::span<const std::uint8_t> in, std::span<T> out, std::int64_t runs) {
    dequantize_int4_blocks(in, out, runs);
  }
  template <class T>
  static void sum(std::span<const std::uint8_t> in, std::span<T> out, float factor,
                  std::int64_t outputs) {
    sum_int4_blocks(in, out, factor, outputs);
  }
};

// The packing of `runs` runs of n values (rows of `columns`, taken column by column) with F's
// rules applied one value at a time, over out as the caller filled it (no kernel writes a run's
// padding bytes).
template <class F, class T>
void rule_pack(const std::vector<T>& in, std::vector<std::uint8_t>& out, std::int64_t n,
               std::int64_t runs, std::int64_t columns) {
  for (std::int64_t j = 0; j < runs; ++j) {
    const T* x = in.data() + quant::int8_source_run(j, runs, columns) * n;
    std::uint8_t* run = out.data() + j * F::packed_bytes(n);
    std::vector<std::int8_t> codes;
    for (std::int64_t b = 0; b < quant::int8_blocks(n); ++b) {
      const std::int64_t first = b * quant::int8_block;
      const std::int64_t last = std::min(n, first + quant::int8_block);
      float absmax = 0;
      for (std::int64_t i = first; i < last; ++i) {
        absmax = std::max(absmax, std::fabs(zero::convert<float>(x[i])));
      }
      const float scale = F::scale(absmax);
      std::memcpy(run + F::scales_offset(n) + 4 * b, &scale, 4);
      for (std::int64_t i = first; i < last; ++i) {
        codes.push_back(F::code(zero::convert<float>(x[i]), scale));
      }
    }
    F::put_codes(run, codes);
  }
}

// `runs` runs of n values of random magnitudes, with a NaN, an infinity, a block of zeros, a block
// of values too small for a nonzero scale, and a block whose scale is 1 (127 for int8, 7 for int4
// its largest) with codes at ties.
template <class T>
std::vector<T> quant_inputs(std::int64_t n, std::int64_t runs, double largest) {
  auto v = float_values(static_cast<std::size_t>(n * runs), 81, 3.0);
  const auto at = [&](std::int64_t i) -> double& {
    return v[static_cast<std::size_t>(i % v.size())];
  };
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(v.size()); ++i) {
    const std::int64_t block = (i % n) / quant::int8_block;
    if (block == 1) at(i) = 0.0;
    if (block == 2) at(i) = (i % 2 == 0 ? 1e-39 : -1e-40) * static_cast<double>(i % 5);
    if (block == 3) at(i) = 0.5 * static_cast<double>(i % 9) - 2.0;  // ties of x / 1
    if ((i % n) == 3 * quant::int8_block) at(i) = largest;
  }
  at(5) = std::numeric_limits<double>::quiet_NaN();
  at(2 * n + 1) = std::numeric_limits<double>::infinity();
  return cast<T>(v);
}

// Packs 6 runs of n values (columns 1 or 3), reads them back, and sums them as 1, 2 and 3 outputs;
// all the outputs' bytes, from F's kernels or (rule) its rules applied one value at a time.
template <class F, class T>
Bytes quant_run(std::int64_t n, std::int64_t columns, bool rule) {
  constexpr std::int64_t runs = 6;
  const auto in = quant_inputs<T>(n, runs, std::is_same_v<F, Int8Format> ? 127.0 : 7.0);
  const auto packed = static_cast<std::size_t>(F::packed_bytes(n));
  std::vector<std::uint8_t> bytes(packed * runs, 0xa5);
  if (rule) {
    rule_pack<F>(in, bytes, n, runs, columns);
  } else {
    F::pack(std::span<const T>(in), std::span<std::uint8_t>(bytes), runs, columns);
  }
  std::vector<T> back(in.size());
  if (rule) {
    for (std::int64_t k = 0; k < runs * n; ++k) {
      const std::uint8_t* run = bytes.data() + (k / n) * packed;
      const auto i = k % n;
      back[static_cast<std::size_t>(k)] = zero::convert<T>(
          quant::int8_value(F::code_at(run, i), F::scale_at(run, n, i / quant::int8_block)));
    }
  } else {
    F::unpack(std::span<const std::uint8_t>(bytes), std::span<T>(back), runs);
  }
  Bytes all;
  all.add(bytes), all.add(back);
  for (std::int64_t outputs : {1, 2, 3}) {
    std::vector<T> sums(static_cast<std::size_t>(outputs * n));
    const float factor = 1.0f / static_cast<float>(runs / outputs);
    if (rule) {
      for (std::int64_t k = 0; k < outputs * n; ++k) {
        const std::int64_t o = k / n, i = k % n;
        float sum = 0;
        for (std::int64_t b = 0; b < runs / outputs; ++b) {
          const std::uint8_t* run =
              bytes.data() + static_cast<std::size_t>(b * outputs + o) * packed;
          sum = quant::int8_add_value(sum, F::code_at(run, i),
                                      F::scale_at(run, n, i / quant::int8_block));
        }
        sums[static_cast<std::size_t>(k)] = zero::convert<T>(sum * factor);
      }
    } else {
      F::sum(std::span<const std::uint8_t>(bytes), std::span<T>(sums), factor, outputs);
    }
    all.add(sums);
  }
  return all;
}

template <class F>
void check_quant_format() {
  for (std::int64_t n : {1, 17, 300, 1030, 5001}) {
    for (std::int64_t columns : {1, 3}) {
      INFO(F::name << " n " << n << " columns " << columns);
      check_paths([&] { return quant_run<F, float>(n, columns, false); });
      check_paths([&] { return quant_run<F, bf16>(n, columns, false); });
      check_paths([&] { return quant_run<F, f16>(n, columns, false); });
      CHECK(quant_run<F, float>(n, columns, false) == quant_run<F, float>(n, columns, true));
      CHECK(quant_run<F, bf16>(n, columns, false) == quant_run<F, bf16>(n, columns, true));
      CHECK(quant_run<F, f16>(n, columns, false) == quant_run<F, f16>(n, columns, true));
      CHECK(quant_run<F, double>(n, columns, false) == quant_run<F, double>(n, columns, true));
    }
  }
  // The edges are there: a NaN, and a block of scale 1 whose ties round to even codes.
  const double largest = std::is_same_v<F, Int8Format> ? 127.0 : 7.0;
  const auto in = quant_inputs<float>(1030, 6, largest);
  CHECK(std::isnan(in[5]));
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(6 * F::packed_bytes(1030)));
  F::pack(std::span<const float>(in), std::span<std::uint8_t>(bytes), 6, 1);
  CHECK(F::scale_at(bytes.data(), 1030, 3) == 1.0f);
  int ties = 0;
  for (std::int64_t i = 3 * 256 + 1; i < 4 * 256; ++i) {
    const float x = in[static_cast<std::size_t>(i)];
    ties += x - std::floor(x) == 0.5f;
    CHECK(F::code_at(bytes.data(), i) == static_cast<int>(std::nearbyint(x)));
  }
  CHECK(ties > 50);
  // Random values read back within half a step of their block's scale.
  const auto x = cast<float>(float_values(5001, 82, 2.0));
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(F::packed_bytes(5001)));
  F::pack(std::span<const float>(x), std::span<std::uint8_t>(packed), 1, 1);
  std::vector<float> back(x.size());
  F::unpack(std::span<const std::uint8_t>(packed), std::span<float>(back), 1);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float step = F::scale_at(packed.data(), 5001, static_cast<std::int64_t>(i) / 256);
    INFO("value " << i);
    REQUIRE(std::fabs(back[i] - x[i]) <= 0.5f * step * (1 + 1e-6f));
  }
}

}  // namespace

TEST_CASE(
    "int8 blocks: every ISA and thread count gives the rules' bits, f32 / bf16 / f16 / f64, odd "
    "sizes, NaN, infinity, zero and tie blocks",
    "[unit][ops]") {
  check_quant_format<Int8Format>();
}

TEST_CASE(
    "int4 blocks: every ISA and thread count gives the rules' bits, f32 / bf16 / f16 / f64, odd "
    "sizes, NaN, infinity, zero and tie blocks",
    "[unit][ops]") {
  check_quant_format<Int4Format>();
}

namespace {

// Packing with error feedback (LoCo) one value at a time by the rules: each block of the source
// run compensated by its kept error (in err, int8 runs in source order), packed at F's width, and
// its next error kept in place.
template <class F, class T>
void rule_feedback(const std::vector<T>& in, std::vector<std::uint8_t>& out,
                   std::vector<std::uint8_t>& err, std::int64_t n, std::int64_t runs,
                   std::int64_t columns, quant::ErrorFeedback feedback) {
  for (std::int64_t j = 0; j < runs; ++j) {
    const std::int64_t source = quant::int8_source_run(j, runs, columns);
    const T* x = in.data() + source * n;
    std::uint8_t* run = out.data() + j * F::packed_bytes(n);
    std::uint8_t* kept = err.data() + source * quant::int8_packed_bytes(n);
    std::vector<std::int8_t> codes;
    for (std::int64_t b = 0; b < quant::int8_blocks(n); ++b) {
      const std::int64_t first = b * quant::int8_block;
      const std::int64_t last = std::min(n, first + quant::int8_block);
      const float kept_scale = quant::int8_scale_at(kept, n, b);
      std::vector<float> c, old;
      float absmax = 0;
      for (std::int64_t i = first; i < last; ++i) {
        const auto code = static_cast<std::int8_t>(kept[i]);
        c.push_back(quant::compensated(zero::convert<float>(x[i]), code, kept_scale));
        old.push_back(quant::int8_value(code, kept_scale));
        absmax = std::max(absmax, std::fabs(c.back()));
      }
      const float scale = F::scale(absmax);
      std::memcpy(run + F::scales_offset(n) + 4 * b, &scale, 4);
      std::vector<float> next;
      float next_max = 0;
      for (std::size_t k = 0; k < c.size(); ++k) {
        const std::int8_t q = F::code(c[k], scale);
        codes.push_back(q);
        next.push_back(quant::next_error(old[k], c[k], q, scale, feedback));
        next_max = std::max(next_max, std::fabs(next.back()));
      }
      const float next_scale = quant::int8_scale(next_max);
      std::memcpy(kept + quant::int8_scales_offset(n) + 4 * b, &next_scale, 4);
      for (std::int64_t i = first; i < last; ++i) {
        kept[i] = static_cast<std::uint8_t>(
            quant::int8_code(next[static_cast<std::size_t>(i - first)], next_scale));
      }
    }
    F::put_codes(run, codes);
  }
}

// Three packings with feedback of 6 runs of n values (columns 1 or 3), each round's inputs the
// last's scaled, carrying the kept error from a zeroed one; every round's packed runs and kept
// errors, from the kernel or (rule) the rules one value at a time.
template <class F, class T>
Bytes feedback_run(std::int64_t n, std::int64_t columns, bool rule) {
  constexpr std::int64_t runs = 6;
  constexpr int bits = std::is_same_v<F, Int8Format> ? 8 : 4;
  const auto base = quant_inputs<float>(n, runs, bits == 8 ? 127.0 : 7.0);
  const auto feedback = quant::ErrorFeedback::with_beta(0.8f);
  std::vector<std::uint8_t> err(static_cast<std::size_t>(runs * quant::int8_packed_bytes(n)), 0);
  Bytes all;
  for (const float factor : {1.0f, -0.61f, 1.73f}) {
    std::vector<T> in(base.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      in[i] = zero::convert<T>(base[i] * factor + 0.01f * static_cast<float>(i % 7));
    }
    std::vector<std::uint8_t> out(static_cast<std::size_t>(runs * F::packed_bytes(n)), 0xa5);
    if (rule) {
      rule_feedback<F>(in, out, err, n, runs, columns, feedback);
    } else {
      zero::ops::cpu::quantize_with_feedback(std::span<const T>(in), std::span<std::uint8_t>(out),
                                             std::span<std::uint8_t>(err), feedback, bits, runs,
                                             columns);
    }
    all.add(out), all.add(err);
  }
  return all;
}

template <class F>
void check_feedback_format() {
  for (std::int64_t n : {1, 17, 300, 1030}) {
    for (std::int64_t columns : {1, 3}) {
      INFO(F::name << " n " << n << " columns " << columns);
      check_paths([&] { return feedback_run<F, float>(n, columns, false); });
      check_paths([&] { return feedback_run<F, bf16>(n, columns, false); });
      CHECK(feedback_run<F, float>(n, columns, false) == feedback_run<F, float>(n, columns, true));
      CHECK(feedback_run<F, bf16>(n, columns, false) == feedback_run<F, bf16>(n, columns, true));
      CHECK(feedback_run<F, f16>(n, columns, false) == feedback_run<F, f16>(n, columns, true));
      CHECK(feedback_run<F, double>(n, columns, false) ==
            feedback_run<F, double>(n, columns, true));
    }
  }
  // The feedback works: packing the same values again and again, the mean of what the packings
  // stand for nears the values (every loss is carried into the next packing), where without
  // feedback each packing repeats the same loss.
  constexpr int bits = std::is_same_v<F, Int8Format> ? 8 : 4;
  const std::int64_t n = 1030, rounds = 64;
  const auto x = cast<float>(float_values(static_cast<std::size_t>(n), 83, 2.0));
  std::vector<std::uint8_t> err(static_cast<std::size_t>(quant::int8_packed_bytes(n)), 0);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(F::packed_bytes(n)));
  std::vector<double> mean(x.size(), 0.0);
  std::vector<float> back(x.size());
  for (int r = 0; r < rounds; ++r) {
    zero::ops::cpu::quantize_with_feedback(std::span<const float>(x), std::span<std::uint8_t>(out),
                                           std::span<std::uint8_t>(err),
                                           quant::ErrorFeedback::with_beta(0.0f), bits);
    F::unpack(std::span<const std::uint8_t>(out), std::span<float>(back), 1);
    for (std::size_t i = 0; i < x.size(); ++i) mean[i] += back[i] / static_cast<double>(rounds);
  }
  F::pack(std::span<const float>(x), std::span<std::uint8_t>(out), 1, 1);
  F::unpack(std::span<const std::uint8_t>(out), std::span<float>(back), 1);
  double with = 0, without = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    with += std::fabs(mean[i] - x[i]);
    without += std::fabs(static_cast<double>(back[i]) - x[i]);
  }
  UNSCOPED_INFO(F::name << ": mean error with feedback " << with / static_cast<double>(n)
                        << ", without " << without / static_cast<double>(n));
  CHECK(with < 0.1 * without);
  // A non-finite value leaves no non-finite error behind: the next packing is finite again.
  auto bad = x;
  bad[3] = std::numeric_limits<float>::infinity();
  bad[300] = std::numeric_limits<float>::quiet_NaN();
  zero::ops::cpu::quantize_with_feedback(std::span<const float>(bad), std::span<std::uint8_t>(out),
                                         std::span<std::uint8_t>(err),
                                         quant::ErrorFeedback::with_beta(0.8f), bits);
  zero::ops::cpu::quantize_with_feedback(std::span<const float>(x), std::span<std::uint8_t>(out),
                                         std::span<std::uint8_t>(err),
                                         quant::ErrorFeedback::with_beta(0.8f), bits);
  F::unpack(std::span<const std::uint8_t>(out), std::span<float>(back), 1);
  CHECK(std::all_of(back.begin(), back.end(), [](float v) { return std::isfinite(v); }));
  // Sizes are checked: the error buffer must hold the runs as int8.
  CHECK_THROWS_WITH(zero::ops::cpu::quantize_with_feedback(
                        std::span<const float>(x), std::span<std::uint8_t>(out),
                        std::span<std::uint8_t>(err.data(), err.size() - 4),
                        quant::ErrorFeedback::with_beta(0.8f), bits),
                    Catch::Contains("quantize_with_feedback (the kept error): 1030 values pack "
                                    "into 1052 bytes, not 1048"));
  CHECK_THROWS_WITH(zero::ops::cpu::quantize_with_feedback(
                        std::span<const float>(x), std::span<std::uint8_t>(out),
                        std::span<std::uint8_t>(err), quant::ErrorFeedback::with_beta(0.8f), 2),
                    Catch::Contains("quantize_with_feedback: 2 bits; codes are 8 or 4 bits"));
}

}  // namespace

TEST_CASE(
    "packing with error feedback (LoCo): every ISA and thread count gives the rules' bits at 8 "
    "and 4 bits, and the kept errors carry the losses",
    "[unit][ops]") {
  check_feedback_format<Int8Format>();
  check_feedback_format<Int4Format>();
}
