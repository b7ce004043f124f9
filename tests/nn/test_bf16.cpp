// bf16 storage with f32 compute: every host kernel over bf16 against the same kernel over f32
// on the same bf16-representable inputs, a tiny GPT<bf16> against GPT<float> holding the same
// (bf16) weights, and bf16 results independent of the thread count.
//
// The bound. A bf16 kernel computes in float and rounds each stored value once, so against the
// f32 kernel on the same inputs an output y differs by at most one bf16 rounding,
// u |y32| with u = 2^-8 (8 significant bits, round to nearest), plus what float arithmetic in
// a different order (sbgemm vs sgemm) or a reused rounded intermediate (attention reuses its
// stored bf16 probabilities) adds; that extra part is bounded by slack * u * max|y32| with
// slack stated per kernel (0.05 for float reordering alone, 1 for a rounded intermediate).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/embedding.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/gemm.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>
#include "../support/worse.hpp"
#include "gradcheck.hpp"

using namespace zero;
using namespace zero::ops::cpu;
using FVec = std::vector<float>;

namespace {

constexpr double bf16_unit_roundoff = 0x1p-8;

// Random bf16-representable floats in [-scale, scale].
FVec bf16_values(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  FVec v;
  for (double x : testing::random_vector(n, seed, scale)) {
    v.push_back(static_cast<float>(bf16(static_cast<float>(x))));
  }
  return v;
}

template <class T>
std::vector<T> stored(const FVec& v) {
  std::vector<T> out;
  for (float x : v) out.push_back(convert<T>(x));
  return out;
}

template <class T>
FVec widened(const std::vector<T>& v) {
  FVec out;
  for (const T& x : v) out.push_back(convert<float>(x));
  return out;
}

// Largest |y16 - y32| / (u |y32| + slack u max|y32|): at most 1 within the bound.
double bf16_error_ratio(const FVec& y16, const FVec& y32, double slack) {
  REQUIRE(y16.size() == y32.size());
  double peak = 0, worst = 0;
  for (float y : y32) peak = std::max(peak, std::fabs(static_cast<double>(y)));
  for (std::size_t i = 0; i < y16.size(); ++i) {
    const double bound = bf16_unit_roundoff * (std::fabs(double(y32[i])) + slack * peak) + 1e-30;
    worst = zero::testing::worse(worst, std::fabs(double(y16[i]) - double(y32[i])) / bound);
  }
  return worst;
}

// Runs kernel<T> (returning its outputs widened to float) for bf16 and f32 and checks the bound.
template <class Kernel>
void check_against_f32(Kernel&& kernel, double slack) {
  const std::vector<FVec> out16 = kernel.template operator()<bf16>();
  const std::vector<FVec> out32 = kernel.template operator()<float>();
  REQUIRE(out16.size() == out32.size());
  for (std::size_t k = 0; k < out16.size(); ++k) {
    INFO("output " << k);
    CHECK(bf16_error_ratio(out16[k], out32[k], slack) <= 1.0);
  }
}

}  // namespace

TEST_CASE("bf16 gemm follows f32 gemm for every transpose", "[unit][bf16]") {
  INFO("bf16 gemm path: " << half_gemm_path<bf16>());
  const std::int64_t M = 130, N = 33, K = 70;  // three 64-row blocks
  for (Trans ta : {Trans::no, Trans::yes}) {
    for (Trans tb : {Trans::no, Trans::yes}) {
      const std::int64_t lda = ta == Trans::no ? K : M, ldb = tb == Trans::no ? N : K;
      const FVec a = bf16_values(M * K, 1), b = bf16_values(K * N, 2), c = bf16_values(M * N, 3);
      auto kernel = [&]<class T>() {
        auto A = stored<T>(a), B = stored<T>(b), C = stored<T>(c);
        gemm(ta, tb, M, N, K, compute_type_t<T>(0.5), A.data(), lda, B.data(), ldb,
             compute_type_t<T>(1), C.data(), N);
        return std::vector<FVec>{widened(C)};
      };
      check_against_f32(kernel, 0.05);
      // Negative control: a result off by 2 bf16 units somewhere fails the bound.
      FVec wrong = kernel.template operator()<bf16>()[0];
      const FVec right = kernel.template operator()<float>()[0];
      wrong[17] = right[17] + 2 * static_cast<float>(bf16_unit_roundoff) * std::fabs(right[17]) +
                  0.1f * static_cast<float>(bf16_unit_roundoff);
      CHECK(bf16_error_ratio(wrong, right, 0.05) > 1.0);
    }
  }
}

#if defined(ZERO_WITH_BLAS)
namespace {

// Stand-ins for cblas_sbgemm: one correct (widen, then sgemm), one that ignores alpha.
void widening_sbgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blasint M,
                     blasint N, blasint K, float alpha, const bfloat16* A, blasint lda,
                     const bfloat16* B, blasint ldb, float beta, float* C, blasint ldc) {
  const blasint a_rows = ta == CblasNoTrans ? M : K, b_rows = tb == CblasNoTrans ? K : N;
  FVec a(static_cast<std::size_t>(a_rows * lda)), b(static_cast<std::size_t>(b_rows * ldb));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = bf16::to_float(A[i]);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = bf16::to_float(B[i]);
  cblas_sgemm(order, ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, C, ldc);
}
void alpha_ignoring_sbgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blasint M,
                           blasint N, blasint K, float, const bfloat16* A, blasint lda,
                           const bfloat16* B, blasint ldb, float beta, float* C, blasint ldc) {
  widening_sbgemm(order, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace

TEST_CASE("the run-time sbgemm check accepts a correct sbgemm and rejects a wrong one",
          "[unit][bf16]") {
  CHECK(check_sbgemm(&widening_sbgemm));
  CHECK_FALSE(check_sbgemm(&alpha_ignoring_sbgemm));  // negative control
  // The path gemm<bf16> reports is the one the checks chose: oneDNN first, then sbgemm
  // (Debian 12's OpenBLAS has no sbgemm symbol), else widen+sgemm.
  const std::string expected =
      onednn_gemm_usable<bf16>()
          ? "onednn"
          : (sbgemm_usable() ? "sbgemm" : std::string("widen+") + float_gemm_path());
  CHECK(std::string(half_gemm_path<bf16>()) == expected);
  CHECK(std::string(half_gemm_path<f16>()) == std::string("widen+") + float_gemm_path());
}
#endif

#if defined(ZERO_WITH_DNNL)
TEST_CASE(
    "oneDNN's bf16 matmul: the run-time check, and gemm<bf16> bit-identical at 1 and 2 "
    "threads",
    "[unit][bf16]") {
  INFO("bf16 gemm path: " << half_gemm_path<bf16>());
  // Where oneDNN runs bf16 here, its kernel passes the exact-integer check; a kernel that
  // drops alpha does not (negative control).
  if (onednn_gemm_usable<bf16>()) {
    CHECK(check_gemm_kernel<bf16>([](Trans ta, Trans tb, int M, int N, int K, float alpha,
                                     const bf16* A, int lda, const bf16* B, int ldb, float* C,
                                     int ldc) {
      onednn_gemm<bf16>(ta == Trans::yes, tb == Trans::yes, M, N, K, alpha, A, lda, B, ldb, 1.0f, C,
                        ldc);
    }));
    CHECK_FALSE(
        check_gemm_kernel<bf16>([](Trans ta, Trans tb, int M, int N, int K, float, const bf16* A,
                                   int lda, const bf16* B, int ldb, float* C, int ldc) {
          onednn_gemm<bf16>(ta == Trans::yes, tb == Trans::yes, M, N, K, 1.0f, A, lda, B, ldb, 1.0f,
                            C, ldc);
        }));
  }
  // A GEMM of several tiles (M = 600 rows: two row tiles) gives the same bits at 1 and 2
  // threads on whichever path is active.
  const std::int64_t M = 600, N = 72, K = 130;
  std::vector<bf16> a(static_cast<std::size_t>(M * K)), b(static_cast<std::size_t>(K * N));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = bf16(std::sin(0.37f * static_cast<float>(i)));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = bf16(std::cos(0.11f * static_cast<float>(i)));
  auto run = [&](int threads) {
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    (void)threads;
    std::vector<bf16> c(static_cast<std::size_t>(M * N), bf16(0.25f));
    gemm<bf16>(Trans::no, Trans::no, M, N, K, 0.5f, a.data(), K, b.data(), N, 1.0f, c.data(), N);
    return c;
  };
#if defined(_OPENMP)
  const int saved_threads = omp_get_max_threads();
#endif
  const auto one = run(1), two = run(2);
#if defined(_OPENMP)
  omp_set_num_threads(saved_threads);
#endif
  CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(bf16)) == 0);
}
#endif

TEST_CASE("bf16 linear, layer norm and gelu follow f32", "[unit][bf16]") {
  const std::int64_t N = 70, C = 48, OC = 40;
  const FVec x = bf16_values(N * C, 4), w = bf16_values(OC * C, 5), bias = bf16_values(OC, 6);
  const FVec dy = bf16_values(N * OC, 7), acc_in = bf16_values(N * C, 8, 0.1);
  const FVec acc_w = bf16_values(OC * C, 9, 0.1), acc_b = bf16_values(OC, 10, 0.1);
  check_against_f32(
      [&]<class T>() {
        auto X = stored<T>(x), W = stored<T>(w), Bv = stored<T>(bias), DY = stored<T>(dy);
        std::vector<T> out(static_cast<std::size_t>(N * OC));
        auto dx = stored<T>(acc_in), dw = stored<T>(acc_w), db = stored<T>(acc_b);
        linear_forward(out.data(), X.data(), W.data(), Bv.data(), N, C, OC);
        linear_backward(dx.data(), dw.data(), db.data(), DY.data(), X.data(), W.data(), N, C, OC);
        return std::vector<FVec>{widened(out), widened(dx), widened(dw), widened(db)};
      },
      0.05);
  const FVec lx = bf16_values(N * C, 11, 3.0), lw = bf16_values(C, 12), lb = bf16_values(C, 13);
  const FVec ldy = bf16_values(N * C, 14);
  check_against_f32(
      [&]<class T>() {
        auto X = stored<T>(lx), W = stored<T>(lw), Bv = stored<T>(lb), DY = stored<T>(ldy);
        std::vector<T> out(static_cast<std::size_t>(N * C));
        std::vector<float> mean(static_cast<std::size_t>(N)), rstd(mean.size());
        auto dx = stored<T>(acc_in), dw = stored<T>(FVec(C, 0.5f)), db = stored<T>(FVec(C, 0.f));
        layer_norm_forward(out.data(), mean.data(), rstd.data(), X.data(), W.data(), Bv.data(), N,
                           C);
        layer_norm_backward(dx.data(), dw.data(), db.data(), DY.data(), X.data(), W.data(),
                            mean.data(), rstd.data(), N, C);
        return std::vector<FVec>{widened(out), mean, rstd, widened(dx), widened(dw), widened(db)};
      },
      0.05);
  const FVec gx = bf16_values(500, 15, 4.0), gdy = bf16_values(500, 16);
  check_against_f32(
      [&]<class T>() {
        auto X = stored<T>(gx), DY = stored<T>(gdy);
        std::vector<T> out(500);
        auto dx = stored<T>(bf16_values(500, 17, 0.1));
        gelu_forward(out.data(), X.data(), 500);
        gelu_backward(dx.data(), X.data(), DY.data(), 500);
        std::vector<T> sum(500), acc = stored<T>(gdy);
        add(sum.data(), X.data(), DY.data(), 500);
        accumulate(acc.data(), X.data(), 500);
        return std::vector<FVec>{widened(out), widened(dx), widened(sum), widened(acc)};
      },
      0.05);
}

TEST_CASE("bf16 attention follows f32, with and without dropout", "[unit][bf16]") {
  const std::int64_t B = 2, Tn = 9, C = 24, NH = 3;
  const FVec qkv = bf16_values(B * Tn * 3 * C, 18, 1.5), dy = bf16_values(B * Tn * C, 19);
  const FVec acc = bf16_values(B * Tn * 3 * C, 20, 0.1);
  for (double p : {0.0, 0.3}) {
    INFO("attention dropout " << p);
    const DropoutMask mask{p, CounterRng(77), 5};
    // Forward: out reuses the stored (rounded) probabilities, hence slack 1.
    FVec att16;
    check_against_f32(
        [&]<class T>() {
          auto QKV = stored<T>(qkv);
          std::vector<T> out(static_cast<std::size_t>(B * Tn * C));
          std::vector<T> att(static_cast<std::size_t>(B * NH * Tn * Tn));
          attention_forward(out.data(), att.data(), QKV.data(), B, Tn, C, NH, mask);
          if constexpr (std::is_same_v<T, bf16>) att16 = widened(att);
          return std::vector<FVec>{widened(out), widened(att)};
        },
        1.0);
    // Backward from the same saved probabilities (the bf16 forward's, exactly representable).
    check_against_f32(
        [&]<class T>() {
          auto QKV = stored<T>(qkv), DY = stored<T>(dy), ATT = stored<T>(att16);
          auto dqkv = stored<T>(acc);
          attention_backward(dqkv.data(), DY.data(), QKV.data(), ATT.data(), B, Tn, C, NH, mask);
          return std::vector<FVec>{widened(dqkv)};
        },
        0.05);
  }
}

TEST_CASE("bf16 cross-entropy, embedding and dropout follow f32", "[unit][bf16]") {
  const std::int64_t N = 12, V = 300;
  const FVec logits = bf16_values(N * V, 21, 4.0);
  std::vector<std::int32_t> targets;
  for (std::int64_t n = 0; n < N; ++n) targets.push_back(static_cast<std::int32_t>(n * 37 % V));
  targets[4] = ignore_index;
  float loss16 = 0, loss32 = 0;
  check_against_f32(
      [&]<class T>() {
        auto X = stored<T>(logits);
        std::vector<float> losses(static_cast<std::size_t>(N));
        const float mean = cross_entropy_forward(losses.data(), X.data(), targets.data(), N, V);
        (std::is_same_v<T, bf16> ? loss16 : loss32) = mean;
        std::vector<T> d(static_cast<std::size_t>(N * V));
        cross_entropy_backward(d.data(), X.data(), targets.data(), N, V, 2.0f);
        return std::vector<FVec>{losses, widened(d)};
      },
      0.05);
  // Losses are float from the same bf16 logits: the same float computation, exactly.
  CHECK(loss16 == loss32);

  const std::int64_t B = 3, Tn = 4, C = 130, Vocab = 7;
  const FVec wte = bf16_values(Vocab * C, 22), wpe = bf16_values(Tn * C, 23);
  const FVec dout = bf16_values(B * Tn * C, 24);
  const std::vector<std::int32_t> tokens = {1, 4, 1, 0, 1, 3, 6, 1, 2, 4, 4, 1};
  check_against_f32(
      [&]<class T>() {
        auto E = stored<T>(wte), P = stored<T>(wpe), D = stored<T>(dout);
        std::vector<T> out(static_cast<std::size_t>(B * Tn * C));
        embedding_forward(out.data(), tokens.data(), E.data(), P.data(), B, Tn, C, Vocab);
        auto dwte = stored<T>(bf16_values(Vocab * C, 25, 0.1));
        auto dwpe = stored<T>(bf16_values(Tn * C, 26, 0.1));
        embedding_backward(dwte.data(), dwpe.data(), D.data(), tokens.data(), B, Tn, C);
        std::vector<T> dropped(static_cast<std::size_t>(B * Tn * C));
        dropout_forward(dropped.data(), D.data(), B * Tn * C, 0.25, CounterRng(3), 1);
        auto ddrop = stored<T>(dout);
        dropout_backward(ddrop.data(), D.data(), B * Tn * C, 0.25, CounterRng(3), 1);
        return std::vector<FVec>{widened(out), widened(dwte), widened(dwpe), widened(dropped),
                                 widened(ddrop)};
      },
      0.05);
}

namespace {

struct Batch {
  std::int64_t B = 2, T = 32;
  std::vector<std::int32_t> tokens, targets;
  explicit Batch(std::int64_t vocab) {
    for (std::int64_t i = 0; i < B * T; ++i) {
      tokens.push_back(static_cast<std::int32_t>((i * 13) % vocab));
      targets.push_back(static_cast<std::int32_t>((i * 17 + 1) % vocab));
    }
    targets[3] = -1;
  }
  template <class E>
  nn::StepContext<E> context(Arena<>& arena) const {
    nn::StepContext<E> ctx;
    ctx.arena = &arena;
    ctx.tokens = tokens.data();
    ctx.targets = targets.data();
    ctx.batch = B;
    ctx.seq_len = T;
    ctx.step = 2;
    return ctx;
  }
};

// Loss and every unit's gradients (widened) of one forward/backward of GPT<T> whose weights are
// the bf16 initialisation from seed, widened when T is float.
template <class T>
std::vector<FVec> gpt_step(const nn::GPTConfig& cfg, const Batch& batch, std::uint64_t seed) {
  nn::GPT<bf16> source(cfg);
  nn::LocalParameters<nn::GPT<bf16>> weights(source, seed);
  nn::GPT<T> model(cfg);
  nn::LocalParameters<nn::GPT<T>> params(model, seed);
  for (int u = 0; u < model.num_units(); ++u) {
    auto from = weights.unit_values(u);
    auto to = params.unit_values(u);
    for (std::int64_t i = 0; i < to.numel(); ++i) to.at(i) = convert<T>(from.at(i));
  }
  Arena<> arena(64 << 20);
  auto ctx = batch.template context<T>(arena);
  std::vector<FVec> out;
  out.push_back(FVec{convert<float>(model.forward(ctx))});
  model.backward(ctx);
  for (int u = 0; u < model.num_units(); ++u) {
    auto g = params.unit_grads(u);
    FVec w;
    for (const T& v : g) w.push_back(convert<float>(v));
    out.push_back(w);
  }
  return out;
}

double relative_l2(const FVec& a, const FVec& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

// The bound for a whole model: each of the ~10 stored roundings per block perturbs activations
// and gradients by at most u = 2^-8 relative, and they add up through the layers rather than
// cancel, so we ask for the loss within 4u relative and each unit's gradient within 8u (3%) in
// the L2 norm relative to the f32 gradient (measured: see the INFO lines on failure).
TEST_CASE("GPT<bf16> loss and gradients follow GPT<float> with the same weights", "[unit][bf16]") {
  nn::GPTConfig cfg = nn::GPTConfig::preset("small-test");
  for (double attn_dropout : {0.0, 0.1}) {
    cfg.dropout = attn_dropout;
    cfg.attn_dropout = attn_dropout;
    INFO("dropout " << attn_dropout);
    const Batch batch(cfg.vocab_size);
    const auto r16 = gpt_step<bf16>(cfg, batch, 3);
    const auto r32 = gpt_step<float>(cfg, batch, 3);
    INFO("loss bf16 " << r16[0][0] << " f32 " << r32[0][0]);
    CHECK(std::fabs(r16[0][0] - r32[0][0]) <= 4 * bf16_unit_roundoff * std::fabs(r32[0][0]));
    for (std::size_t u = 1; u < r16.size(); ++u) {
      const double err = relative_l2(r16[u], r32[u]);
      INFO("unit " << u - 1 << " relative L2 error " << err);
      CHECK(err <= 8 * bf16_unit_roundoff);
    }
  }
  // Negative control: gradients of a different batch are far outside the bound.
  Batch other(cfg.vocab_size);
  for (auto& t : other.targets) t = t < 0 ? t : (t + 5) % static_cast<std::int32_t>(cfg.vocab_size);
  const auto r16 = gpt_step<bf16>(cfg, other, 3);
  const auto r32 = gpt_step<float>(cfg, Batch(cfg.vocab_size), 3);
  CHECK(relative_l2(r16[1], r32[1]) > 8 * bf16_unit_roundoff);
}

// f16 storage costs nothing extra: the same kernels compute in float (GEMM widens to float). With
// u16 = 2^-11 the same reasoning as for bf16 gives the same multiples of u16; the weights are the
// bf16 initialisation (exact in f16 except the few below f16's normal range, ~6e-5).
TEST_CASE("GPT<f16> loss and gradients follow GPT<float> with the same weights", "[unit][bf16]") {
  const double u16 = 0x1p-11;
  nn::GPTConfig cfg = nn::GPTConfig::preset("small-test");
  const Batch batch(cfg.vocab_size);
  const auto r16 = gpt_step<f16>(cfg, batch, 3);
  const auto r32 = gpt_step<float>(cfg, batch, 3);
  INFO("loss f16 " << r16[0][0] << " f32 " << r32[0][0]);
  CHECK(std::fabs(r16[0][0] - r32[0][0]) <= 4 * u16 * std::fabs(r32[0][0]));
  for (std::size_t u = 1; u < r16.size(); ++u) {
    const double err = relative_l2(r16[u], r32[u]);
    INFO("unit " << u - 1 << " relative L2 error " << err);
    CHECK(err <= 8 * u16);
  }
}

TEST_CASE("GPT<bf16> results do not depend on the thread count", "[unit][bf16]") {
  nn::GPTConfig cfg = nn::GPTConfig::preset("small-test");
  cfg.dropout = 0.1;
  cfg.attn_dropout = 0.1;
  const Batch batch(cfg.vocab_size);
  std::vector<FVec> results[2];
#if defined(_OPENMP)
  const int saved_threads = omp_get_max_threads();
#endif
  for (int threads : {1, 2}) {
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    results[threads - 1] = gpt_step<bf16>(cfg, batch, 11);
  }
#if defined(_OPENMP)
  omp_set_num_threads(saved_threads);
#endif
  REQUIRE(results[0].size() == results[1].size());
  for (std::size_t k = 0; k < results[0].size(); ++k) {
    REQUIRE(results[0][k].size() == results[1][k].size());
    CHECK(std::memcmp(results[0][k].data(), results[1][k].data(),
                      results[0][k].size() * sizeof(float)) == 0);
  }
}
