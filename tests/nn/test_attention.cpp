// Attention through GEMMs (ops/cpu/attention.hpp) against the loop reference
// (attention_reference.hpp): the same contract on the same inputs, at lengths around the query
// block (1, 7, 63, 64, 65, 130), with and without dropout, in f64, f32 and bf16; bit-identical
// results at 1 and 2 threads; and the causal tiling that the CUDA flash kernels share
// (ops/causal_tiles.hpp) against a count of each tile's visible entries.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <catch2/catch.hpp>

#include <zero/ops/causal_tiles.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/attention_reference.hpp>
#include "../support/worse.hpp"
#include "gradcheck.hpp"

using namespace zero::ops::cpu;
using zero::bf16;
using zero::testing::random_vector;

namespace {

struct Shape {
  std::int64_t B, T, C, NH;
};

// Forward and backward outputs of one attention call.
template <class T>
struct Result {
  std::vector<T> out, att, dqkv;
};

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = zero::convert<T>(static_cast<float>(v[i]));
  if constexpr (std::is_same_v<T, double>) {
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i];
  }
  return out;
}

template <class T, bool reference>
Result<T> run(const Shape& s, const DropoutMask& mask) {
  const auto qkv = as<T>(random_vector(static_cast<std::size_t>(s.B * s.T * 3 * s.C), 41, 2.0));
  const auto dout = as<T>(random_vector(static_cast<std::size_t>(s.B * s.T * s.C), 42));
  Result<T> r;
  r.out.resize(static_cast<std::size_t>(s.B * s.T * s.C));
  r.att.resize(static_cast<std::size_t>(s.B * s.NH * s.T * s.T));
  r.dqkv = as<T>(random_vector(qkv.size(), 43, 0.5));  // backward accumulates into this
  if constexpr (reference) {
    attention_forward_reference(r.out.data(), r.att.data(), qkv.data(), s.B, s.T, s.C, s.NH, mask);
    attention_backward_reference(r.dqkv.data(), dout.data(), qkv.data(), r.att.data(), s.B, s.T,
                                 s.C, s.NH, mask);
  } else {
    attention_forward(r.out.data(), r.att.data(), qkv.data(), s.B, s.T, s.C, s.NH, mask);
    attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.att.data(), s.B, s.T, s.C, s.NH,
                       mask);
  }
  return r;
}

// Largest |got - ref| / (|ref| + mean |ref|) over the elements.
template <class T>
double worst_relative(const std::vector<T>& got, const std::vector<T>& ref) {
  REQUIRE(got.size() == ref.size());
  double mean = 0;
  for (const T& x : ref) mean += std::abs(static_cast<double>(zero::convert<float>(x)));
  if constexpr (std::is_same_v<T, double>) {
    mean = 0;
    for (const T& x : ref) mean += std::abs(x);
  }
  mean /= static_cast<double>(ref.size());
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double g, r;
    if constexpr (std::is_same_v<T, double>) {
      g = got[i], r = ref[i];
    } else {
      g = zero::convert<float>(got[i]), r = zero::convert<float>(ref[i]);
    }
    worst = zero::testing::worse(worst, std::abs(g - r) / (std::abs(r) + mean));
  }
  return worst;
}

template <class T>
void compare_with_reference(double bound) {
  for (const Shape& s : {Shape{2, 1, 8, 2}, Shape{1, 7, 12, 3}, Shape{1, 63, 16, 2},
                         Shape{2, 64, 16, 2}, Shape{1, 65, 8, 1}, Shape{1, 130, 16, 2}}) {
    for (double p : {0.0, 0.25}) {
      const DropoutMask mask = p > 0 ? DropoutMask{p, zero::CounterRng(7), 3} : DropoutMask{};
      INFO("B " << s.B << " T " << s.T << " C " << s.C << " NH " << s.NH << " dropout " << p);
      const auto got = run<T, false>(s, mask);
      const auto ref = run<T, true>(s, mask);
      CHECK(worst_relative(got.out, ref.out) <= bound);
      CHECK(worst_relative(got.att, ref.att) <= bound);
      CHECK(worst_relative(got.dqkv, ref.dqkv) <= bound);
      // Above the diagonal att is exactly zero.
      for (std::int64_t bh = 0; bh < s.B * s.NH; ++bh) {
        for (std::int64_t t = 0; t < s.T; ++t) {
          for (std::int64_t t2 = t + 1; t2 < s.T; ++t2) {
            REQUIRE(zero::convert<float>(
                        got.att[static_cast<std::size_t>((bh * s.T + t) * s.T + t2)]) == 0.0f);
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("attention through GEMMs equals the loop reference: f64", "[unit][ops]") {
  compare_with_reference<double>(1e-13);
  // Negative control: a reference run on another dropout stream differs by far more.
  const Shape s{1, 65, 8, 1};
  const auto got = run<double, false>(s, DropoutMask{0.25, zero::CounterRng(7), 3});
  const auto other = run<double, true>(s, DropoutMask{0.25, zero::CounterRng(7), 4});
  CHECK(worst_relative(got.out, other.out) > 1e-2);
}

TEST_CASE("attention through GEMMs equals the loop reference: f32 and bf16", "[unit][ops]") {
  // f32: reordered float sums, within a few ulp of the values' scale.
  compare_with_reference<float>(1e-5);
  // bf16: outputs rounded once from float sums that differ in order; two bf16 ulps (2^-7).
  compare_with_reference<bf16>(2.0 / 128);
}

TEST_CASE("attention through GEMMs: the same bits at 1 and 2 threads", "[unit][ops]") {
#if defined(_OPENMP)
  const int before = omp_get_max_threads();
  const Shape s{2, 130, 16, 2};
  const DropoutMask mask{0.1, zero::CounterRng(9), 1};
  omp_set_num_threads(1);
  const auto one = run<float, false>(s, mask);
  const auto one16 = run<bf16, false>(s, mask);
  omp_set_num_threads(2);
  const auto two = run<float, false>(s, mask);
  const auto two16 = run<bf16, false>(s, mask);
  omp_set_num_threads(before);
  CHECK(std::memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(one.dqkv.data(), two.dqkv.data(), one.dqkv.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(one16.out.data(), two16.out.data(), one16.out.size() * sizeof(bf16)) == 0);
  CHECK(std::memcmp(one16.dqkv.data(), two16.dqkv.data(), one16.dqkv.size() * sizeof(bf16)) == 0);
#else
  SUCCEED("built without OpenMP: one thread only");
#endif
}

namespace {

// Visible entries of the tile rows [r0, r0 + rows) by keys [k0, k0 + keys), and whether any entry
// lies outside the sequence.
struct TileCount {
  int visible = 0;
  bool outside = false;
};
TileCount count_tile(int r0, int rows, int k0, int keys, int Tn) {
  TileCount c;
  for (int r = r0; r < r0 + rows; ++r) {
    for (int k = k0; k < k0 + keys; ++k) {
      if (r >= Tn || k >= Tn) c.outside = true;
      if (k <= r && r < Tn && k < Tn) ++c.visible;
    }
  }
  return c;
}

}  // namespace

namespace {

// The query gradient of row t, where the probability of key 0 (whose value holds an infinity)
// is dropped, after attention_forward and attention_backward with mask.
template <class T>
std::vector<double> dq_under_dropped_infinity(const DropoutMask& mask, std::int64_t t) {
  const std::int64_t Tn = 4, C = 4;
  std::vector<T> qkv(static_cast<std::size_t>(Tn * 3 * C)), dout(static_cast<std::size_t>(Tn * C));
  for (std::size_t i = 0; i < qkv.size(); ++i) {
    qkv[i] = zero::convert<T>(0.1f * static_cast<float>(i % 7));
  }
  qkv[static_cast<std::size_t>(2 * C)] = zero::convert<T>(std::numeric_limits<float>::infinity());
  for (auto& d : dout) d = zero::convert<T>(1.0f);
  std::vector<T> out(dout.size()), att(static_cast<std::size_t>(Tn * Tn)), dqkv(qkv.size());
  for (auto& d : dqkv) d = zero::convert<T>(0.0f);
  attention_forward(out.data(), att.data(), qkv.data(), 1, Tn, C, 1, mask);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), 1, Tn, C, 1, mask);
  std::vector<double> dq;
  for (std::int64_t i = 0; i < C; ++i) {
    dq.push_back(
        static_cast<double>(zero::convert<float>(dqkv[static_cast<std::size_t>(t * 3 * C + i)])));
  }
  return dq;
}

}  // namespace

TEST_CASE("attention dropout: an infinite gradient under a dropped probability is NaN",
          "[unit][ops]") {
  // PyTorch multiplies by the mask, so 0 * inf is NaN and the overflow checks see it; selecting
  // 0 for a dropped entry gave row t a finite gradient (dropout.hpp already multiplied).
  const DropoutMask mask{0.5, zero::CounterRng(77), 3};
  std::int64_t t = 1;
  while (t < 4 && mask.keep(t * 4)) ++t;  // a row whose entry against key 0 is dropped
  REQUIRE(t < 4);
  for (const auto& dq :
       {dq_under_dropped_infinity<float>(mask, t), dq_under_dropped_infinity<double>(mask, t),
        dq_under_dropped_infinity<bf16>(mask, t)}) {
    for (double v : dq) CHECK(std::isnan(v));
  }
}

TEST_CASE("a causal tile is whole exactly when every entry of it is visible", "[unit][ops]") {
  static_assert(zero::ops::causal_tile_whole(64, 16, 0, 64, 80));
  static_assert(!zero::ops::causal_tile_whole(64, 16, 64, 64, 200));  // the diagonal tile
  int whole = 0, checked = 0;
  for (const int Tn : {1, 7, 16, 33, 64, 65, 100, 130}) {
    for (const int rows : {16, 32, 64}) {
      for (const int keys : {16, 32, 64}) {
        for (int r0 = 0; r0 < Tn + rows; r0 += 3) {  // every offset mod 16
          for (int k0 = 0; k0 < Tn + keys; k0 += 3) {
            const TileCount c = count_tile(r0, rows, k0, keys, Tn);
            const bool all = !c.outside && c.visible == rows * keys;
            INFO("Tn " << Tn << ", rows [" << r0 << ", +" << rows << "), keys [" << k0 << ", +"
                       << keys << ")");
            REQUIRE(zero::ops::causal_tile_whole(r0, rows, k0, keys, Tn) == all);
            whole += all ? 1 : 0;
            ++checked;
          }
        }
      }
    }
  }
  CHECK(whole > 0);  // both answers were checked
  CHECK(whole < checked);
  CHECK_FALSE(zero::ops::causal_tile_whole(0, 0, 0, 16, 64));
  CHECK_FALSE(zero::ops::causal_tile_whole(32, 16, 0, 0, 64));
}

TEST_CASE("causal tiles start in order of their work, the heaviest first", "[unit][ops]") {
  for (const int Tn : {1, 64, 65, 300, 1024}) {
    const int tiles = (Tn + 63) / 64;
    std::vector<int> seen_rows(static_cast<std::size_t>(tiles), 0);
    std::vector<int> seen_keys(static_cast<std::size_t>(tiles), 0);
    int last_rows_work = tiles, last_keys_work = tiles;
    for (int i = 0; i < tiles; ++i) {
      const int row_tile = zero::ops::causal_row_tile_in_work_order(i, tiles);
      const int key_tile = zero::ops::causal_key_tile_in_work_order(i, tiles);
      REQUIRE((row_tile >= 0 && row_tile < tiles && key_tile >= 0 && key_tile < tiles));
      ++seen_rows[static_cast<std::size_t>(row_tile)];
      ++seen_keys[static_cast<std::size_t>(key_tile)];
      // A block's work: the tiles of the other side it visits (those with a visible entry; a
      // partial tile past Tn costs a block as much as a full one).
      int rows_work = 0, keys_work = 0;
      for (int other = 0; other < tiles; ++other) {
        rows_work += count_tile(row_tile * 64, 64, other * 64, 64, Tn).visible > 0 ? 1 : 0;
        keys_work += count_tile(other * 64, 64, key_tile * 64, 64, Tn).visible > 0 ? 1 : 0;
      }
      CHECK(rows_work <= last_rows_work);
      CHECK(keys_work <= last_keys_work);
      last_rows_work = rows_work;
      last_keys_work = keys_work;
    }
    for (std::size_t t = 0; t < seen_rows.size(); ++t) {  // each tile once
      CHECK(seen_rows[t] == 1);
      CHECK(seen_keys[t] == 1);
    }
  }
}
