// Causal attention on the GPU against cpu::attention_forward/backward on the same qkv: the flash
// kernels (out, lse, dqkv; with and without the dropout mask) for T from 1 to 2048 and head sizes
// from 8 to 128 (each kernel capacity, full and zero-padded), and the cuBLAS reference path (out,
// att, dqkv).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/context.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cuda/attention.cuh>
#include <zero/ops/cuda/attention_reference.cuh>

#include "ops_test_util.hpp"

// No `using namespace zero`: zero::cuda would make CUB's unqualified cuda::std ambiguous in
// nvcc's generated kernel stubs.
using zero::bf16;
using zero::CounterRng;
using zero::ShapeError;
using zero::test::check_close;
using zero::test::DeviceVector;
using zero::test::random_vector;
using zero::test::same_bits;
using zero::test::ScopedEnv;

namespace cpu = zero::ops::cpu;
namespace gpu = zero::ops::cuda;

namespace {

struct AttnShape {
  std::int64_t B, T, NH, hs;
};

/// The log-sum-exp of every score row, in double, from the host's float scores.
template <class T>
std::vector<float> host_lse(const std::vector<T>& qkv, const AttnShape& s) {
  const std::int64_t C = s.NH * s.hs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
  std::vector<float> lse(static_cast<std::size_t>(s.B * s.NH * s.T));
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t h = 0; h < s.NH; ++h) {
      for (std::int64_t t = 0; t < s.T; ++t) {
        std::vector<double> scores;
        double maxval = -INFINITY;
        for (std::int64_t t2 = 0; t2 <= t; ++t2) {
          float dot = 0.0f;
          for (std::int64_t i = 0; i < s.hs; ++i) {
            dot += static_cast<float>(
                       qkv[static_cast<std::size_t>((b * s.T + t) * 3 * C + h * s.hs + i)]) *
                   static_cast<float>(
                       qkv[static_cast<std::size_t>((b * s.T + t2) * 3 * C + C + h * s.hs + i)]);
          }
          scores.push_back(static_cast<double>(dot * scale));
          maxval = std::max(maxval, scores.back());
        }
        double sum = 0.0;
        for (double x : scores) sum += std::exp(x - maxval);
        lse[static_cast<std::size_t>((b * s.NH + h) * s.T + t)] =
            static_cast<float>(std::log(sum) + maxval);
      }
    }
  }
  return lse;
}

/// Runs the flash forward and backward and the host's on random inputs and compares them;
/// rel and ulps as in check_close. The backward runs twice: delta from the probabilities, and
/// delta as rowsum(dout * out) from the forward's output (which only the tensor-core kernels use).
template <class T>
void compare_flash(const AttnShape& s, const cpu::DropoutMask& dropout, double rel, double ulps,
                   std::uint32_t seed) {
  const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
  INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " hs=" << s.hs << " p=" << dropout.p);
  // Scaled inputs give peaked softmax rows as well as flat ones.
  const auto qkv = random_vector<T>(static_cast<std::size_t>(N * 3 * C), seed, -2.0f, 2.0f);
  const auto dout = random_vector<T>(static_cast<std::size_t>(N * C), seed + 1);
  const auto dqkv_init = random_vector<T>(qkv.size(), seed + 2);
  DeviceVector<T> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout),
      d_dqkv(dqkv_init), d_dqkv_given_out(dqkv_init);
  DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T));
  gpu::attention_forward<T>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH, dropout,
                            nullptr);
  gpu::attention_backward<T>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_lse.get(), s.B, s.T, C,
                             s.NH, dropout, nullptr);
  gpu::attention_backward<T>(d_dqkv_given_out.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                             d_lse.get(), s.B, s.T, C, s.NH, dropout, nullptr);

  std::vector<T> out(static_cast<std::size_t>(N * C)),
      att(static_cast<std::size_t>(s.B * s.NH * s.T * s.T));
  auto dqkv = dqkv_init;
  cpu::attention_forward<T>(out.data(), att.data(), qkv.data(), s.B, s.T, C, s.NH, dropout);
  cpu::attention_backward<T>(dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, C, s.NH,
                             dropout);
  check_close(d_out.download(), out, "flash attention out", rel, ulps);
  check_close(d_lse.download(), host_lse(qkv, s), "flash attention lse", 1e-5, 0.0);
  check_close(d_dqkv.download(), dqkv, "flash attention dqkv", rel, ulps);
  check_close(d_dqkv_given_out.download(), dqkv, "flash attention dqkv, delta from dout . out", rel,
              ulps);
  // Written instead of added (NaN in the buffer, never read): the values of adding into zeros
  // (== on floats: a zero's sign may differ), with delta from the probabilities and from out.
  for (const T* given : {static_cast<const T*>(nullptr), static_cast<const T*>(d_out.get())}) {
    DeviceVector<T> d_written(
        std::vector<T>(qkv.size(), zero::convert<T>(std::numeric_limits<float>::quiet_NaN())));
    DeviceVector<T> d_added(std::vector<T>(qkv.size(), zero::convert<T>(0.0f)));
    gpu::attention_backward<T>(d_written.get(), d_dout.get(), d_qkv.get(), given, d_lse.get(), s.B,
                               s.T, C, s.NH, dropout, true, nullptr);
    gpu::attention_backward<T>(d_added.get(), d_dout.get(), d_qkv.get(), given, d_lse.get(), s.B,
                               s.T, C, s.NH, dropout, false, nullptr);
    const auto written = d_written.download(), added = d_added.download();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < written.size(); ++i) {
      differ += zero::convert<float>(written[i]) == zero::convert<float>(added[i]) ? 0 : 1;
    }
    INFO("delta " << (given != nullptr ? "from dout . out" : "from the probabilities"));
    CHECK(differ == 0);
  }
}

}  // namespace

TEST_CASE("flash attention equals the host attention in f32, T from 1 to 2048",
          "[cuda][attention]") {
  std::uint32_t seed = 1;
  for (const AttnShape s :
       {AttnShape{1, 1, 2, 64}, AttnShape{2, 7, 2, 64}, AttnShape{1, 33, 1, 128},
        AttnShape{2, 100, 3, 64}, AttnShape{1, 257, 2, 128}, AttnShape{1, 1024, 1, 64},
        AttnShape{1, 2048, 1, 64}, AttnShape{2, 40, 4, 8}, AttnShape{1, 70, 2, 16},
        AttnShape{2, 33, 2, 32}, AttnShape{1, 65, 3, 48}, AttnShape{1, 90, 2, 96},
        AttnShape{1, 31, 1, 100}}) {
    compare_flash<float>(s, {}, 1e-5, 2.0, seed);
    seed += 10;
  }
}

TEST_CASE("flash attention equals the host attention in bf16", "[cuda][attention]") {
  // 4 ulps, not 2: the host rounds the normalised probabilities to bf16 (its saved att) before
  // multiplying by v and before the softmax backward; the CUDA-core kernels keep them in float,
  // and the tensor-core ones (head size 64 and 128) round the unnormalised ones.
  std::uint32_t seed = 100;
  for (const AttnShape s :
       {AttnShape{1, 1, 2, 64}, AttnShape{2, 7, 2, 128}, AttnShape{1, 129, 2, 64},
        AttnShape{1, 1024, 1, 128}, AttnShape{2, 50, 4, 16}, AttnShape{1, 64, 2, 96}}) {
    compare_flash<bf16>(s, {}, 1e-5, 4.0, seed);
    seed += 10;
  }
}

TEST_CASE("flash attention equals the host attention in f16", "[cuda][attention]") {
  std::uint32_t seed = 150;
  for (const AttnShape s : {AttnShape{1, 1, 2, 64}, AttnShape{2, 100, 2, 64},
                            AttnShape{1, 200, 2, 128}, AttnShape{1, 40, 2, 32}}) {
    compare_flash<zero::f16>(s, {}, 1e-5, 4.0, seed);
    seed += 10;
  }
}

TEST_CASE("flash attention applies the host's dropout mask", "[cuda][attention]") {
  const cpu::DropoutMask dropout{0.1, CounterRng(CounterRng::key_for(3, "dropout.h.0")), 5};
  std::uint32_t seed = 200;
  for (const AttnShape s : {AttnShape{1, 7, 2, 64}, AttnShape{2, 100, 2, 64},
                            AttnShape{1, 70, 1, 128}, AttnShape{2, 45, 2, 16}}) {
    compare_flash<float>(s, dropout, 1e-5, 2.0, seed);
    seed += 10;
  }
  // The tensor-core kernels draw the same mask (bf16, head size 64 and 128).
  for (const AttnShape s : {AttnShape{2, 100, 2, 64}, AttnShape{1, 130, 1, 128}}) {
    compare_flash<bf16>(s, dropout, 1e-5, 4.0, seed);
    seed += 10;
  }
}

TEST_CASE("flash attention draws a placed dropout mask where the host does", "[cuda][attention]") {
  // The masks nn::StepContext::dropout_mask hands the attention layers, made by it: a
  // micro-batch's att starts at its first row's index (first; not a multiple of a Philox call's
  // four elements at these shapes), and a tensor-parallel rank's heads are a block of every row
  // of the whole att, the rows a stride apart (block, stride; rank 1 of 2, micro-batch from row
  // 5). Every kernel family: CUDA-core (f32, head size 16) and tensor-core (bf16, head sizes 64
  // and 128).
  const CounterRng rng(CounterRng::key_for(3, "dropout.h.1"));
  std::uint32_t seed = 260;
  auto placed = [&](const AttnShape& s, auto tag, double ulps) {
    using T = decltype(tag);
    const std::int64_t att = s.B * s.NH * s.T * s.T;  // this rank's probabilities
    zero::nn::StepContext<T> ctx;
    ctx.step = 7;
    ctx.batch = s.B;
    ctx.first_row = 3;
    const cpu::DropoutMask rows = ctx.dropout_mask(0.1, rng, att);
    REQUIRE(rows.first == static_cast<std::uint64_t>(3 * s.NH * s.T * s.T));
    ctx.first_row = 5;
    const cpu::DropoutMask heads =
        ctx.dropout_mask(0.1, rng, att, zero::nn::DropoutShard{2, 1, /*within_rows=*/true});
    REQUIRE(heads.block != 0);
    for (const auto& mask : {rows, heads}) {
      INFO("first " << mask.first << " block " << mask.block << " stride " << mask.stride);
      compare_flash<T>(s, mask, 1e-5, ulps, seed);
      seed += 10;
    }
  };
  placed(AttnShape{2, 45, 2, 16}, float{}, 2.0);
  placed(AttnShape{2, 75, 2, 64}, bf16{}, 4.0);
  placed(AttnShape{2, 67, 1, 128}, bf16{}, 4.0);
}

TEST_CASE("the flash forward with two row tiles a warp equals one row tile bit for bit",
          "[cuda][attention]") {
  // Each row sees the same products over the same key slices in the same order in both forms
  // (a 128-row block's tiles past a row's last key add nothing to it), so out and lse are equal;
  // the one-tile form is checked against the host above.
  const cpu::DropoutMask dropout{0.1, CounterRng(CounterRng::key_for(4, "dropout.h.1")), 3};
  std::uint32_t seed = 400;
  for (const bool dropping : {false, true}) {
    for (const AttnShape s :
         {AttnShape{1, 1, 2, 64}, AttnShape{2, 65, 2, 64}, AttnShape{1, 128, 1, 64},
          AttnShape{2, 129, 2, 64}, AttnShape{1, 300, 3, 64}, AttnShape{1, 1024, 2, 64}}) {
      INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " dropout " << dropping);
      const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
      const cpu::DropoutMask mask = dropping ? dropout : cpu::DropoutMask{};
      const float scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
      const int Bi = static_cast<int>(s.B), Ti = static_cast<int>(s.T), Ci = static_cast<int>(C),
                NHi = static_cast<int>(s.NH);
      const auto qkv = random_vector<bf16>(static_cast<std::size_t>(N * 3 * C), seed, -2.0f, 2.0f);
      seed += 10;
      DeviceVector<bf16> d_qkv(qkv), d_out1(static_cast<std::size_t>(N * C)),
          d_out2(static_cast<std::size_t>(N * C));
      DeviceVector<float> d_lse1(static_cast<std::size_t>(s.B * s.NH * s.T)),
          d_lse2(static_cast<std::size_t>(s.B * s.NH * s.T));
      gpu::mma::forward<bf16, 64, 1>(d_out1.get(), d_lse1.get(), d_qkv.get(), Bi, Ti, Ci, NHi,
                                     scale, mask, nullptr);
      gpu::mma::forward<bf16, 64, 2>(d_out2.get(), d_lse2.get(), d_qkv.get(), Bi, Ti, Ci, NHi,
                                     scale, mask, nullptr);
      CHECK(same_bits(d_out2.download(), d_out1.download()));
      CHECK(same_bits(d_lse2.download(), d_lse1.download()));
    }
  }
}

TEST_CASE("a key's value reaches no row before it in the flash kernels", "[cuda][attention]") {
  // An Inf in V at key 64, and apart from it one in K at key 96 (each the first key of a 16-key
  // slice), against the same inputs without it: every row before key 64 gives the same out, and
  // every row before key 96 the same dq, bit for bit. A kernel that multiplies a slice of keys
  // wholly after a warp's rows by their zero probabilities gets NaN there instead (the two-tile
  // forward's second key tile; the dq kernel's last 32-key tile at head size 128). Within a
  // slice that a row partly sees, a later key's Inf does reach it (0 times Inf), as in any tiled
  // kernel; so does the fused backward's dq, which takes whole 64-key blocks.
  for (const std::int64_t hs : {std::int64_t{64}, std::int64_t{128}}) {
    const AttnShape s{1, 160, 2, hs};
    INFO("hs=" << hs);
    const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
    const auto clean = random_vector<bf16>(static_cast<std::size_t>(N * 3 * C), 450, -2.0f, 2.0f);
    const auto dout = random_vector<bf16>(static_cast<std::size_t>(N * C), 451);
    const bf16 inf = zero::convert<bf16>(std::numeric_limits<float>::infinity());
    auto with_inf = [&](std::int64_t key, std::int64_t part) {  // part 1: K, 2: V
      auto qkv = clean;
      for (std::int64_t h = 0; h < s.NH; ++h) {
        qkv[static_cast<std::size_t>(key * 3 * C + part * C + h * hs)] = inf;
      }
      return qkv;
    };
    struct Result {
      std::vector<bf16> out, out_two_tiles, dqkv;
    };
    auto run = [&](const std::vector<bf16>& qkv) {
      DeviceVector<bf16> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout),
          d_dqkv(qkv.size());
      DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T));
      Result r;
      if (hs == 64) {
        gpu::mma::forward<bf16, 64, 2>(d_out.get(), d_lse.get(), d_qkv.get(), 1,
                                       static_cast<int>(s.T), static_cast<int>(C),
                                       static_cast<int>(s.NH), scale, cpu::DropoutMask{}, nullptr);
        r.out_two_tiles = d_out.download();
      }
      gpu::attention_forward<bf16>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH,
                                   nullptr);
      gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                    d_lse.get(), s.B, s.T, C, s.NH, cpu::DropoutMask{}, true,
                                    nullptr);
      r.out = d_out.download();
      r.dqkv = d_dqkv.download();
      return r;
    };
    // Elements [first, first + n) of every row of width columns from 0 to rows.
    auto columns = [](const std::vector<bf16>& v, std::int64_t width, std::int64_t first,
                      std::int64_t n, std::int64_t rows) {
      std::vector<bf16> kept;
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto at = v.begin() + static_cast<std::ptrdiff_t>(r * width + first);
        kept.insert(kept.end(), at, at + static_cast<std::ptrdiff_t>(n));
      }
      return kept;
    };
    const Result want = run(clean), v_inf = run(with_inf(64, 2)), k_inf = run(with_inf(96, 1));
    CHECK(same_bits(columns(v_inf.out, C, 0, C, 64), columns(want.out, C, 0, C, 64)));
    if (hs == 64) {
      CHECK(same_bits(columns(v_inf.out_two_tiles, C, 0, C, 64),
                      columns(want.out_two_tiles, C, 0, C, 64)));
    }
    CHECK(same_bits(columns(k_inf.dqkv, 3 * C, 0, C, 96), columns(want.dqkv, 3 * C, 0, C, 96)));
  }
}

TEST_CASE("a query's dout reaches no key after it in the flash backward's dk",
          "[cuda][attention]") {
  // An Inf in dout at query 70 (every head), against the same inputs without it: the key
  // gradient of every key after 70 is the same bits, as on the host, whose dS is exactly 0
  // above the diagonal. Keys 71-79 share a 16-key slice with 70 in the dk/dv kernel: their
  // causally masked entries (query 70 < key) once took dS^T = 0 * (dP - delta) with delta
  // infinite, NaN. (dV may differ there: P^T dout multiplies a masked 0 by the Inf, as the
  // host's tiled GEMMs do.)
  for (const std::int64_t hs : {std::int64_t{64}, std::int64_t{128}}) {
    const AttnShape s{1, 160, 2, hs};
    INFO("hs=" << hs);
    const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
    const auto qkv = random_vector<bf16>(static_cast<std::size_t>(N * 3 * C), 460, -2.0f, 2.0f);
    const auto clean = random_vector<bf16>(static_cast<std::size_t>(N * C), 461);
    auto with_inf = clean;
    for (std::int64_t h = 0; h < s.NH; ++h) {
      with_inf[static_cast<std::size_t>(70 * C + h * hs)] =
          zero::convert<bf16>(std::numeric_limits<float>::infinity());
    }
    auto dk_after = [&](const std::vector<bf16>& dout) {
      DeviceVector<bf16> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout),
          d_dqkv(qkv.size());
      DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T));
      gpu::attention_forward<bf16>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH,
                                   nullptr);
      gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                    d_lse.get(), s.B, s.T, C, s.NH, cpu::DropoutMask{}, true,
                                    nullptr);
      const std::vector<bf16> dqkv = d_dqkv.download();
      std::vector<bf16> dk;  // dk of keys 71 on: columns [C, 2C) of rows 71..T-1
      for (std::int64_t r = 71; r < s.T; ++r) {
        const auto at = dqkv.begin() + static_cast<std::ptrdiff_t>(r * 3 * C + C);
        dk.insert(dk.end(), at, at + static_cast<std::ptrdiff_t>(C));
      }
      return dk;
    };
    CHECK(same_bits(dk_after(with_inf), dk_after(clean)));
  }
}

namespace {

/// mma::backward_fused_dq (dq in the dk/dv kernel, float atomics) against the host backward when
/// it adds into a start (the bounds compare_flash holds the two kernels to), against the
/// two-kernel backward within 2 ulps when it writes, and its dk and dv against the two kernels'
/// bit for bit (the same code computes them). Written from zero, the host's bf16-rounded
/// probabilities put a small gradient 2.3x outside 4 ulps of its own scale (H200, 4fda685: dk
/// elements too, which equal the two kernels' bit for bit), so the written form is checked
/// against the two kernels, whose written values compare_flash checks against their added ones.
template <class T>
void compare_fused_dq(const AttnShape& s, const cpu::DropoutMask& dropout, bool overwrite,
                      std::uint32_t seed) {
  const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
  INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " p=" << dropout.p << " overwrite "
            << overwrite);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
  const int Bi = static_cast<int>(s.B), Ti = static_cast<int>(s.T), Ci = static_cast<int>(C),
            NHi = static_cast<int>(s.NH);
  const auto qkv = random_vector<T>(static_cast<std::size_t>(N * 3 * C), seed, -2.0f, 2.0f);
  const auto dout = random_vector<T>(static_cast<std::size_t>(N * C), seed + 1);
  const auto dqkv_init = random_vector<T>(qkv.size(), seed + 2);
  DeviceVector<T> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout),
      d_fused(dqkv_init), d_apart(dqkv_init);
  DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T)),
      d_delta(static_cast<std::size_t>(s.B * s.NH * s.T)), d_accum(static_cast<std::size_t>(N * C));
  gpu::attention_forward<T>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH, dropout,
                            nullptr);
  gpu::mma::backward_fused_dq<T, 64>(d_fused.get(), d_delta.get(), d_accum.get(), d_dout.get(),
                                     d_qkv.get(), d_out.get(), d_lse.get(), Bi, Ti, Ci, NHi, scale,
                                     dropout, overwrite, nullptr);
  gpu::mma::backward<T, 64>(d_apart.get(), d_delta.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                            d_lse.get(), Bi, Ti, Ci, NHi, scale, dropout, overwrite, nullptr);
  std::vector<T> out(static_cast<std::size_t>(N * C)),
      att(static_cast<std::size_t>(s.B * s.NH * s.T * s.T));
  auto dqkv = overwrite ? std::vector<T>(qkv.size(), zero::convert<T>(0.0f)) : dqkv_init;
  cpu::attention_forward<T>(out.data(), att.data(), qkv.data(), s.B, s.T, C, s.NH, dropout);
  cpu::attention_backward<T>(dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, C, s.NH,
                             dropout);
  const auto fused = d_fused.download(), apart = d_apart.download();
  if (overwrite) {
    // Only dq's float sums run in another order before its one rounding.
    check_close(fused, apart, "fused-dq backward dqkv against the two kernels", 1e-5, 2.0);
  } else {
    check_close(fused, dqkv, "fused-dq backward dqkv", 1e-5, 4.0);
  }
  std::vector<T> fused_kv, apart_kv;  // the k and v columns of every row
  for (std::int64_t n = 0; n < N; ++n) {
    const auto row = static_cast<std::size_t>(n * 3 * C);
    fused_kv.insert(fused_kv.end(), fused.begin() + static_cast<std::ptrdiff_t>(row + C),
                    fused.begin() + static_cast<std::ptrdiff_t>(row + 3 * C));
    apart_kv.insert(apart_kv.end(), apart.begin() + static_cast<std::ptrdiff_t>(row + C),
                    apart.begin() + static_cast<std::ptrdiff_t>(row + 3 * C));
  }
  CHECK(same_bits(fused_kv, apart_kv));
}

}  // namespace

TEST_CASE("the backward with dq fused into the dk/dv kernel equals the host's",
          "[cuda][attention]") {
  const cpu::DropoutMask dropout{0.1, CounterRng(CounterRng::key_for(5, "dropout.h.2")), 7};
  std::uint32_t seed = 500;
  for (const AttnShape s : {AttnShape{1, 1, 2, 64}, AttnShape{2, 7, 2, 64}, AttnShape{1, 64, 1, 64},
                            AttnShape{2, 129, 2, 64}, AttnShape{1, 300, 3, 64}}) {
    for (const bool overwrite : {false, true}) {
      compare_fused_dq<bf16>(s, {}, overwrite, seed);
      seed += 10;
    }
  }
  compare_fused_dq<bf16>(AttnShape{2, 100, 2, 64}, dropout, false, seed);
  compare_fused_dq<zero::f16>(AttnShape{1, 200, 2, 64}, {}, true, seed + 10);
}

TEST_CASE("ZERO_ATTENTION_BACKWARD=fused_dq has the launcher take the fused backward",
          "[cuda][attention]") {
  // Through attention_backward (what the layers call): the host's values within the flash
  // bounds, given the forward's output, added into a start as compare_flash adds (the two
  // kernels meet the same bounds, so this checks the values the layers get, not which kernels
  // ran; written from zero, the bound is too tight for either, see compare_fused_dq); an unknown
  // value is a ConfigError naming it, on any path (here head size 64 without the forward's
  // output, which never fuses).
  const AttnShape s{2, 150, 2, 64};
  const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
  const auto qkv = random_vector<bf16>(static_cast<std::size_t>(N * 3 * C), 600, -2.0f, 2.0f);
  const auto dout = random_vector<bf16>(static_cast<std::size_t>(N * C), 601);
  auto dqkv = random_vector<bf16>(qkv.size(), 602);
  DeviceVector<bf16> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout), d_dqkv(dqkv);
  DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T));
  gpu::attention_forward<bf16>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH, nullptr);
  std::optional<ScopedEnv> env(std::in_place, "ZERO_ATTENTION_BACKWARD", "fused_dq");
  gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(),
                                s.B, s.T, C, s.NH, gpu::DropoutMask{}, false, nullptr);
  std::vector<bf16> out(static_cast<std::size_t>(N * C)),
      att(static_cast<std::size_t>(s.B * s.NH * s.T * s.T));
  cpu::attention_forward<bf16>(out.data(), att.data(), qkv.data(), s.B, s.T, C, s.NH);
  cpu::attention_backward<bf16>(dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, C,
                                s.NH);
  check_close(d_dqkv.download(), dqkv, "attention_backward, fused dq", 1e-5, 4.0);
  env.emplace("ZERO_ATTENTION_BACKWARD", "atomic");
  DeviceVector<bf16> one_row(static_cast<std::size_t>(3 * 64)), one_dout(64);
  DeviceVector<float> one_lse(1);
  CHECK_THROWS_WITH(
      gpu::attention_backward<bf16>(one_row.get(), one_dout.get(), one_row.get(), one_lse.get(), 1,
                                    1, 64, 1, gpu::DropoutMask{}, nullptr),
      Catch::Contains("ZERO_ATTENTION_BACKWARD=atomic"));
}

TEST_CASE("flash attention backward repeats bit for bit", "[cuda][attention]") {
  const AttnShape s{2, 300, 2, 64};
  const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
  const auto qkv = random_vector<bf16>(static_cast<std::size_t>(N * 3 * C), 9);
  const auto dout = random_vector<bf16>(static_cast<std::size_t>(N * C), 10);
  DeviceVector<bf16> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_dout(dout),
      d_dqkv(qkv.size());
  DeviceVector<float> d_lse(static_cast<std::size_t>(s.B * s.NH * s.T));
  gpu::attention_forward<bf16>(d_out.get(), d_lse.get(), d_qkv.get(), s.B, s.T, C, s.NH, nullptr);
  std::vector<bf16> zeros(qkv.size(), bf16(0.0f));
  d_dqkv.upload(zeros);
  gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_lse.get(), s.B, s.T, C,
                                s.NH, nullptr);
  const auto first = d_dqkv.download();
  d_dqkv.upload(zeros);
  gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_lse.get(), s.B, s.T, C,
                                s.NH, nullptr);
  CHECK(same_bits(d_dqkv.download(), first));
  // With delta from dout . out too.
  const cpu::DropoutMask none;
  d_dqkv.upload(zeros);
  gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(),
                                s.B, s.T, C, s.NH, none, nullptr);
  const auto given_out = d_dqkv.download();
  d_dqkv.upload(zeros);
  gpu::attention_backward<bf16>(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(),
                                s.B, s.T, C, s.NH, none, nullptr);
  CHECK(same_bits(d_dqkv.download(), given_out));
}

TEST_CASE("flash attention refuses head sizes over 128", "[cuda][attention]") {
  DeviceVector<float> buf(3 * 160), lse(1);
  CHECK_THROWS_AS(
      gpu::attention_forward<float>(buf.get(), lse.get(), buf.get(), 1, 1, 160, 1, nullptr),
      ShapeError);
}

TEST_CASE("flash attention checks each kernel family's own grid limits before launching",
          "[cuda][attention]") {
  // The checks come before any launch or allocation, so null buffers are never read.
  // CUDA-core kernels (f32): B*NH is gridDim.y, at most 65535.
  CHECK_THROWS_WITH(
      gpu::attention_forward<float>(nullptr, nullptr, nullptr, 65536, 1, 64, 1, nullptr),
      Catch::Contains("B*NH = 65536"));
  // Tensor-core kernels (bf16, head size 64): B*NH is gridDim.x, the row tiles gridDim.y.
  const std::int64_t too_long = std::int64_t{65536} * 128 + 1;
  CHECK_THROWS_WITH(
      gpu::attention_forward<bf16>(nullptr, nullptr, nullptr, 1, too_long, 64, 1, nullptr),
      Catch::Contains("past the grid's 65535 in y"));
  CHECK_THROWS_WITH(gpu::attention_backward<bf16>(nullptr, nullptr, nullptr, nullptr, 1, too_long,
                                                  64, 1, nullptr),
                    Catch::Contains("past the grid's 65535 in y"));
}

TEST_CASE("the cuBLAS reference attention equals the host attention in f32", "[cuda][attention]") {
  gpu::GemmContext ctx;
  std::uint32_t seed = 300;
  for (const AttnShape s :
       {AttnShape{1, 1, 1, 64}, AttnShape{2, 37, 3, 32}, AttnShape{1, 256, 2, 64}}) {
    INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " hs=" << s.hs);
    const std::int64_t C = s.NH * s.hs, N = s.B * s.T;
    const auto qkv = random_vector<float>(static_cast<std::size_t>(N * 3 * C), seed, -2.0f, 2.0f);
    const auto dout = random_vector<float>(static_cast<std::size_t>(N * C), seed + 1);
    const auto dqkv_init = random_vector<float>(qkv.size(), seed + 2);
    seed += 10;
    const auto att_elems = static_cast<std::size_t>(s.B * s.NH * s.T * s.T);
    DeviceVector<float> d_qkv(qkv), d_out(static_cast<std::size_t>(N * C)), d_att(att_elems),
        d_dout(dout), d_dqkv(dqkv_init);
    gpu::attention_forward_reference<float>(ctx, d_out.get(), d_att.get(), d_qkv.get(), s.B, s.T, C,
                                            s.NH, nullptr);
    gpu::attention_backward_reference<float>(ctx, d_dqkv.get(), d_dout.get(), d_qkv.get(),
                                             d_att.get(), s.B, s.T, C, s.NH, nullptr);
    std::vector<float> out(static_cast<std::size_t>(N * C)), att(att_elems);
    auto dqkv = dqkv_init;
    cpu::attention_forward<float>(out.data(), att.data(), qkv.data(), s.B, s.T, C, s.NH);
    cpu::attention_backward<float>(dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, C,
                                   s.NH);
    check_close(d_out.download(), out, "reference attention out");
    check_close(d_att.download(), att, "reference attention att");
    check_close(d_dqkv.download(), dqkv, "reference attention dqkv");
  }
}
