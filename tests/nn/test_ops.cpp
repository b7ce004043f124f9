// Host kernels: every backward pass against central finite differences of its forward pass in
// f64, plus edge cases (T = 1, non-power-of-two heads and lengths, ignored targets).
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

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
#include "thread_count.hpp"

using namespace zero::ops::cpu;
using zero::testing::max_gradient_error;
using zero::testing::random_vector;
using zero::testing::weighted_sum;
using zero::testing::with_threads;
using Vec = std::vector<double>;

namespace {

// The padded GEMM cases of the gemm tests: row tiles (600 rows: two), column tiles (700
// columns: two, M < N), K = 0 and one small tile, each with the four transposes; every row of A,
// B and C padded by 3 elements.
struct GemmCase {
  std::int64_t M, N, K;
  Trans ta, tb;
  std::int64_t lda, ldb, ldc;
  std::int64_t a_elems() const { return (ta == Trans::no ? M : K) * lda; }
  std::int64_t b_elems() const { return (tb == Trans::no ? K : N) * ldb; }
};

std::ostream& operator<<(std::ostream& os, const GemmCase& g) {
  return os << "M " << g.M << " N " << g.N << " K " << g.K << " ta " << (g.ta == Trans::yes)
            << " tb " << (g.tb == Trans::yes);
}

std::vector<GemmCase> padded_gemm_cases() {
  std::vector<GemmCase> cases;
  const std::int64_t pad = 3;
  for (const auto [M, N, K] :
       {std::array<std::int64_t, 3>{600, 72, 130}, {40, 700, 33}, {17, 9, 0}, {5, 3, 7}}) {
    for (Trans ta : {Trans::no, Trans::yes}) {
      for (Trans tb : {Trans::no, Trans::yes}) {
        cases.push_back({M, N, K, ta, tb, (ta == Trans::no ? K : M) + pad,
                         (tb == Trans::no ? N : K) + pad, N + pad});
      }
    }
  }
  return cases;
}

}  // namespace

TEST_CASE("gemm agrees with the loop reference for every transpose", "[unit][ops]") {
  const std::int64_t M = 7, N = 5, K = 9;
  for (Trans ta : {Trans::no, Trans::yes}) {
    for (Trans tb : {Trans::no, Trans::yes}) {
      Vec A = random_vector(M * K, 1), B = random_vector(K * N, 2), C = random_vector(M * N, 3);
      Vec R = C;
      const std::int64_t lda = ta == Trans::no ? K : M, ldb = tb == Trans::no ? N : K;
      gemm(ta, tb, M, N, K, 0.5, A.data(), lda, B.data(), ldb, 2.0, C.data(), N);
      for (std::int64_t m = 0; m < M; ++m) {
        for (std::int64_t n = 0; n < N; ++n) {
          double s = 0;
          for (std::int64_t k = 0; k < K; ++k) {
            s += (ta == Trans::no ? A[m * K + k] : A[k * M + m]) *
                 (tb == Trans::no ? B[k * N + n] : B[n * K + k]);
          }
          REQUIRE(C[m * N + n] == Approx(0.5 * s + 2.0 * R[m * N + n]).epsilon(1e-12));
        }
      }
    }
  }
}

TEST_CASE(
    "f32 gemm on its path (oneDNN, sgemm or the loop): every transpose and beta against f64, "
    "beta 0 never reads C, and the same bits at 1 and 2 threads",
    "[unit][ops]") {
  const std::string path = float_gemm_path();
  INFO("f32 gemm path: " << path);
  CHECK(path == (onednn_gemm_usable<float>() ? "onednn" : gemm_uses_blas() ? "sgemm" : "loop"));
#if defined(ZERO_WITH_DNNL)
  if (onednn_gemm_usable<float>()) {
    // The exact-integer check accepts oneDNN's f32 matmul and rejects one that drops alpha.
    CHECK(check_gemm_kernel<float>([](Trans ta, Trans tb, int M, int N, int K, float alpha,
                                      const float* A, int lda, const float* B, int ldb, float* C,
                                      int ldc) {
      onednn_gemm<float>(ta == Trans::yes, tb == Trans::yes, M, N, K, alpha, A, lda, B, ldb, 1.0f,
                         C, ldc);
    }));
    CHECK_FALSE(
        check_gemm_kernel<float>([](Trans ta, Trans tb, int M, int N, int K, float, const float* A,
                                    int lda, const float* B, int ldb, float* C, int ldc) {
          onednn_gemm<float>(ta == Trans::yes, tb == Trans::yes, M, N, K, 1.0f, A, lda, B, ldb,
                             1.0f, C, ldc);
        }));
  }
#endif
#if defined(ZERO_WITH_DNNL) && defined(_OPENMP)
  if (onednn_gemm_usable<float>()) {
    // The library's oneDNN call, made outside an OpenMP region while OpenMP allows 2 threads,
    // gives the bits of one made at 1: a thin, deep product with A transposed (a weight
    // gradient's form), which oneDNN 2.6 splits over K between the threads it sees when its
    // primitive is created (bits then differ from one thread's). C is dense (a padded C takes
    // oneDNN's other kernel, which does not split K).
    const int M = 16, N = 16, K = 1 << 15;
    const Vec a64 = random_vector(std::int64_t{M} * K, 4),
              b64 = random_vector(std::int64_t{K} * N, 5);
    const std::vector<float> a(a64.begin(), a64.end()), b(b64.begin(), b64.end());
    auto run = [&](int threads, int ldc) {
      const std::vector<float> c = with_threads(threads, [&] {
        std::vector<float> out(static_cast<std::size_t>(M * ldc));
        onednn_gemm<float>(true, false, M, N, K, 1.0f, a.data(), M, b.data(), N, 0.0f, out.data(),
                           ldc);
        return out;
      });
      std::vector<float> packed;
      for (int m = 0; m < M; ++m) {
        packed.insert(packed.end(), c.begin() + m * ldc, c.begin() + m * ldc + N);
      }
      return packed;
    };
    const std::vector<float> two = run(2, N), one = run(1, N);
    CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
  }
#endif
  for (const GemmCase& g : padded_gemm_cases()) {
    for (const float beta : {0.0f, 1.0f, 0.5f}) {
      const Vec a64 = random_vector(g.a_elems(), 1), b64 = random_vector(g.b_elems(), 2);
      const Vec c64 = random_vector(g.M * g.ldc, 3);
      const std::vector<float> a(a64.begin(), a64.end()), b(b64.begin(), b64.end());
      std::vector<float> c0(c64.begin(), c64.end());
      // beta 0: C holds NaN, which must not reach the result.
      if (beta == 0.0f) c0.assign(c0.size(), std::numeric_limits<float>::quiet_NaN());
      auto run = [&](int threads) {
        return with_threads(threads, [&] {
          std::vector<float> c = c0;
          gemm<float>(g.ta, g.tb, g.M, g.N, g.K, 0.75f, a.data(), g.lda, b.data(), g.ldb, beta,
                      c.data(), g.ldc);
          return c;
        });
      };
      const std::vector<float> one = run(1), two = run(2);
      INFO(g << " beta " << beta);
      CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
      double worst = 0;  // error over the bound K eps sum |a b| + eps |beta c|, at most 1
      for (std::int64_t m = 0; m < g.M; ++m) {
        for (std::int64_t n = 0; n < g.N; ++n) {
          double sum = 0, magnitude = 0;
          for (std::int64_t k = 0; k < g.K; ++k) {
            const double x =
                a[static_cast<std::size_t>(g.ta == Trans::no ? m * g.lda + k : k * g.lda + m)];
            const double y =
                b[static_cast<std::size_t>(g.tb == Trans::no ? k * g.ldb + n : n * g.ldb + k)];
            sum += x * y;
            magnitude += std::fabs(x * y);
          }
          const double c_in = beta == 0.0f ? 0.0 : c0[static_cast<std::size_t>(m * g.ldc + n)];
          const double want = 0.75 * sum + beta * c_in;
          const double eps = std::numeric_limits<float>::epsilon();
          const double bound = (static_cast<double>(g.K) + 2) * eps * magnitude +
                               2 * eps * std::fabs(beta * c_in) + 1e-30;
          const double got = one[static_cast<std::size_t>(m * g.ldc + n)];
          worst = zero::testing::worse(worst,
                                       std::isfinite(got) ? std::fabs(got - want) / bound : 1e30);
        }
      }
      CHECK(worst <= 1.0);
      // The padding between rows of C is never written.
      for (std::int64_t m = 0; m < g.M; ++m) {
        for (std::int64_t n = g.N; n < g.ldc; ++n) {
          const auto i = static_cast<std::size_t>(m * g.ldc + n);
          CHECK(std::memcmp(&one[i], &c0[i], sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE(
    "gemm_bias (f32 and bf16): the bits of filling C with the bias and accumulating, C never "
    "read, padding untouched, the same bits at 1 and 2 threads",
    "[unit][ops]") {
  INFO("f32 bias inside oneDNN's matmul: " << onednn_gemm_bias_usable());
#if defined(ZERO_WITH_DNNL)
  CHECK(onednn_gemm_bias_usable() == onednn_gemm_usable<float>());
#else
  CHECK_FALSE(onednn_gemm_bias_usable());
#endif
  // Column tiles check the bias offset per tile; K = 0 gives C = the bias.
  for (const GemmCase& g : padded_gemm_cases()) {
    const Vec a64 = random_vector(g.a_elems(), 11), b64 = random_vector(g.b_elems(), 12);
    const Vec bias64 = random_vector(g.N, 13);
    INFO(g);
    auto check = [&]<class T>(T) {
      const std::vector<T> a(a64.begin(), a64.end()), b(b64.begin(), b64.end());
      const std::vector<T> bias(bias64.begin(), bias64.end());
      // C starts as NaN: the fused paths must not read it; the padding must stay NaN.
      const std::vector<T> c0(static_cast<std::size_t>(g.M * g.ldc),
                              T(std::numeric_limits<float>::quiet_NaN()));
      auto fused = [&](int threads) {
        return with_threads(threads, [&] {
          std::vector<T> c = c0;
          gemm_bias<T>(g.ta, g.tb, g.M, g.N, g.K, a.data(), g.lda, b.data(), g.ldb, bias.data(),
                       c.data(), g.ldc);
          return c;
        });
      };
      std::vector<T> want = c0;
      for (std::int64_t m = 0; m < g.M; ++m) {
        std::copy(bias.begin(), bias.end(), want.begin() + m * g.ldc);
      }
      gemm<T>(g.ta, g.tb, g.M, g.N, g.K, 1.0f, a.data(), g.lda, b.data(), g.ldb, 1.0f, want.data(),
              g.ldc);
      const std::vector<T> one = fused(1), two = fused(2);
      CHECK(std::memcmp(one.data(), want.data(), one.size() * sizeof(T)) == 0);
      CHECK(std::memcmp(two.data(), want.data(), two.size() * sizeof(T)) == 0);
      // Without a bias: C = op(A) op(B), the bits of gemm with beta 0.
      std::vector<T> plain = c0, plain_want = c0;
      gemm_bias<T>(g.ta, g.tb, g.M, g.N, g.K, a.data(), g.lda, b.data(), g.ldb, nullptr,
                   plain.data(), g.ldc);
      gemm<T>(g.ta, g.tb, g.M, g.N, g.K, 1.0f, a.data(), g.lda, b.data(), g.ldb, 0.0f,
              plain_want.data(), g.ldc);
      CHECK(std::memcmp(plain.data(), plain_want.data(), plain.size() * sizeof(T)) == 0);
    };
    check(float{});
    check(zero::bf16{});
  }
}

TEST_CASE("f32 gemm called from several threads at once gives each the single-thread bits",
          "[unit][ops]") {
  // Ranks that are threads (LocalComm) multiply at the same time, each over its own OpenMP
  // tiles. A kernel's scratch memory shared between concurrent calls (oneDNN's library-wide
  // scratchpad, before each call brought its own) corrupts results or crashes here. A
  // transposed A makes oneDNN copy it into scratch.
  const std::int64_t M = 96, N = 80, K = 300;
  const Vec a64 = random_vector(K * M, 6), b64 = random_vector(K * N, 7);
  const std::vector<float> a(a64.begin(), a64.end()), b(b64.begin(), b64.end());
  auto product = [&] {
    std::vector<float> c(static_cast<std::size_t>(M * N));
    gemm<float>(Trans::yes, Trans::no, M, N, K, 1.0f, a.data(), M, b.data(), N, 0.0f, c.data(), N);
    return c;
  };
  const std::vector<float> want = product();
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < wrong.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 40; ++rep) {
        const std::vector<float> got = product();
        if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) ++wrong[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(wrong == std::vector<int>(4, 0));
}

TEST_CASE("linear backward equals finite differences", "[unit][ops]") {
  const std::int64_t N = 5, C = 7, OC = 3;
  Vec x = random_vector(N * C, 1), w = random_vector(OC * C, 2), b = random_vector(OC, 3);
  const Vec r = random_vector(N * OC, 4);
  auto loss = [&] {
    Vec out(N * OC);
    linear_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
    return weighted_sum(out, r);
  };
  Vec dx(N * C, 0), dw(OC * C, 0), db(OC, 0);
  linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N, C, OC);
  CHECK(max_gradient_error(x, dx, loss) < 1e-7);
  CHECK(max_gradient_error(w, dw, loss) < 1e-7);
  CHECK(max_gradient_error(b, db, loss) < 1e-7);
  // Negative control: a gradient missing one contribution is caught.
  Vec wrong = dw;
  wrong[4] *= 0.5;
  CHECK(max_gradient_error(w, wrong, loss) > 1e-3);
}

TEST_CASE("layer norm backward equals finite differences", "[unit][ops]") {
  const std::int64_t N = 4, C = 10;
  Vec x = random_vector(N * C, 5, 2.0), w = random_vector(C, 6), b = random_vector(C, 7);
  const Vec r = random_vector(N * C, 8);
  Vec out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    layer_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return weighted_sum(out, r);
  };
  loss();
  Vec dx(N * C, 0), dw(C, 0), db(C, 0);
  layer_norm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), N, C);
  CHECK(max_gradient_error(x, dx, loss) < 1e-6);
  CHECK(max_gradient_error(w, dw, loss) < 1e-7);
  CHECK(max_gradient_error(b, db, loss) < 1e-7);
}

TEST_CASE("gelu backward equals finite differences", "[unit][ops]") {
  Vec x = random_vector(50, 9, 4.0);
  const Vec r = random_vector(50, 10);
  auto loss = [&] {
    Vec out(50);
    gelu_forward(out.data(), x.data(), 50);
    return weighted_sum(out, r);
  };
  Vec dx(50, 0);
  gelu_backward(dx.data(), x.data(), r.data(), 50);
  CHECK(max_gradient_error(x, dx, loss) < 1e-7);
  Vec y(1);
  const double one = 1.0;
  gelu_forward(y.data(), &one, 1);
  CHECK(y[0] == Approx(0.8411919906082768).epsilon(1e-12));  // 0.5(1+tanh(sqrt(2/pi)*1.044715))
}

TEST_CASE("causal attention backward equals finite differences", "[unit][ops]") {
  struct Shape {
    std::int64_t B, T, C, NH;
  };
  for (Shape s : {Shape{2, 5, 12, 3}, Shape{1, 1, 8, 2}, Shape{1, 7, 6, 1}}) {
    INFO("B " << s.B << " T " << s.T << " C " << s.C << " NH " << s.NH);
    Vec qkv = random_vector(s.B * s.T * 3 * s.C, 11, 1.5);
    const Vec r = random_vector(s.B * s.T * s.C, 12);
    Vec att(s.B * s.NH * s.T * s.T);
    auto loss = [&] {
      Vec out(s.B * s.T * s.C);
      attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH);
      return weighted_sum(out, r);
    };
    loss();
    Vec dqkv(qkv.size(), 0);
    attention_backward(dqkv.data(), r.data(), qkv.data(), att.data(), s.B, s.T, s.C, s.NH);
    CHECK(max_gradient_error(qkv, dqkv, loss) < 1e-6);
    // Rows of att are causal probability distributions.
    for (std::int64_t bh = 0; bh < s.B * s.NH; ++bh) {
      for (std::int64_t t = 0; t < s.T; ++t) {
        double sum = 0;
        for (std::int64_t t2 = 0; t2 < s.T; ++t2) {
          const double a = att[(bh * s.T + t) * s.T + t2];
          if (t2 > t) REQUIRE(a == 0.0);
          sum += a;
        }
        REQUIRE(sum == Approx(1.0).epsilon(1e-12));
      }
    }
  }
  // T = 1: each token attends only to itself, so the output is v.
  Vec qkv = random_vector(3 * 4, 13), out(4), att(2);
  attention_forward(out.data(), att.data(), qkv.data(), 1, 1, 4, 2);
  for (int i = 0; i < 4; ++i) CHECK(out[i] == Approx(qkv[8 + i]).epsilon(1e-14));
}

TEST_CASE("causal attention with probability dropout: backward equals finite differences",
          "[unit][ops]") {
  struct Shape {
    std::int64_t B, T, C, NH;
  };
  for (Shape s : {Shape{2, 6, 12, 3}, Shape{1, 9, 8, 2}}) {
    INFO("B " << s.B << " T " << s.T << " C " << s.C << " NH " << s.NH);
    const DropoutMask mask{0.3, zero::CounterRng(21), 4};
    Vec qkv = random_vector(s.B * s.T * 3 * s.C, 31, 1.5);
    const Vec r = random_vector(s.B * s.T * s.C, 32);
    Vec att(s.B * s.NH * s.T * s.T), out(s.B * s.T * s.C);
    auto loss_with = [&](const DropoutMask& m) {
      attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH, m);
      return weighted_sum(out, r);
    };
    auto loss = [&] { return loss_with(mask); };
    const double plain = loss_with({});
    const double dropped = loss();
    CHECK(plain != dropped);  // the mask drops something
    std::int64_t kept = 0, causal = 0;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(att.size()); ++i) {
      if ((i % s.T) > (i / s.T) % s.T) continue;  // above the diagonal
      ++causal;
      kept += mask.keep(i);
    }
    CHECK(kept > 0);
    CHECK(kept < causal);
    Vec dqkv(qkv.size(), 0);
    attention_backward(dqkv.data(), r.data(), qkv.data(), att.data(), s.B, s.T, s.C, s.NH, mask);
    CHECK(max_gradient_error(qkv, dqkv, loss) < 1e-6);
    // Negative control: a backward pass drawing another step's mask is caught.
    Vec wrong(qkv.size(), 0);
    const DropoutMask other{0.3, zero::CounterRng(21), 5};
    attention_backward(wrong.data(), r.data(), qkv.data(), att.data(), s.B, s.T, s.C, s.NH, other);
    CHECK(max_gradient_error(qkv, wrong, loss) > 1e-3);
  }
}

TEST_CASE("fused softmax cross-entropy: value, gradient, ignored targets", "[unit][ops]") {
  const std::int64_t N = 6, V = 9;
  Vec logits = random_vector(N * V, 14, 3.0);
  const std::vector<std::int32_t> targets = {3, ignore_index, 0, 8, ignore_index, 5};
  Vec losses(N);
  auto loss = [&] {
    return cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V);
  };
  const double mean = loss();
  double manual = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    double z = 0;
    for (std::int64_t v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    manual += std::log(z) - logits[n * V + targets[n]];
  }
  CHECK(mean == Approx(manual / 4).epsilon(1e-12));
  Vec d(N * V);
  cross_entropy_backward(d.data(), logits.data(), targets.data(), N, V);
  CHECK(max_gradient_error(logits, d, loss) < 1e-7);
  std::vector<std::int32_t> bad = targets;
  bad[2] = 9;
  CHECK_THROWS_WITH(cross_entropy_forward(losses.data(), logits.data(), bad.data(), N, V),
                    Catch::Contains("target 9") && Catch::Contains("position 2"));
}

TEST_CASE("embedding backward equals finite differences", "[unit][ops]") {
  const std::int64_t B = 2, T = 3, C = 4, V = 5;
  Vec wte = random_vector(V * C, 15), wpe = random_vector(T * C, 16);
  const std::vector<std::int32_t> tokens = {1, 4, 1, 0, 1, 3};  // repeats accumulate
  const Vec r = random_vector(B * T * C, 17);
  auto loss = [&] {
    Vec out(B * T * C);
    embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
    return weighted_sum(out, r);
  };
  Vec dwte(V * C, 0), dwpe(T * C, 0);
  embedding_backward(dwte.data(), dwpe.data(), r.data(), tokens.data(), B, T, C);
  CHECK(max_gradient_error(wte, dwte, loss) < 1e-8);
  CHECK(max_gradient_error(wpe, dwpe, loss) < 1e-8);
  std::vector<std::int32_t> bad = {1, 5, 0, 0, 0, 0};
  Vec out(B * T * C);
  CHECK_THROWS_AS(embedding_forward(out.data(), bad.data(), wte.data(), wpe.data(), B, T, C, V),
                  zero::ShapeError);
}

TEST_CASE("dropout keeps the expected fraction and its backward matches", "[unit][ops]") {
  const zero::CounterRng rng(99);
  const std::int64_t n = 100000;
  Vec x(n, 1.0), y(n), dx(n, 0.0);
  dropout_forward(y.data(), x.data(), n, 0.25, rng, 3);
  std::int64_t kept = 0;
  for (double v : y) kept += v != 0.0;
  CHECK(std::fabs(double(kept) / n - 0.75) < 0.01);
  dropout_backward(dx.data(), x.data(), n, 0.25, rng, 3);
  for (std::int64_t i = 0; i < n; ++i) REQUIRE(dx[i] == y[i]);  // same mask, same scale
}
