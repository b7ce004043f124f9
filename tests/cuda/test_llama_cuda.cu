// Llama's kernels of zero::ops::cuda against their host twins in zero::ops::cpu on the same
// inputs: RMSNorm (rows of whole 16-byte packs and not, one row, many), the rotary embedding
// (grouped qkv rows, positions from 0 and from an offset, head sizes 2 to 128; the host's bits),
// repeat_kv (the host's bits) and SwiGLU; each backward both adding into its gradient and
// writing it.
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/ops/cpu/activation.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/rms_norm.hpp>
#include <zero/ops/cpu/rotary.hpp>
#include <zero/ops/cuda/activation.cuh>
#include <zero/ops/cuda/grouped_qkv.cuh>
#include <zero/ops/cuda/rms_norm.cuh>
#include <zero/ops/cuda/rotary.cuh>

#include "ops_test_util.hpp"

// No `using namespace zero`: zero::cuda would make CUB's unqualified cuda::std ambiguous in
// nvcc's generated kernel stubs.
using zero::bf16;
using zero::test::as_float;
using zero::test::check_close;
using zero::test::DeviceVector;
using zero::test::random_vector;
using zero::test::same_bits;

namespace cpu = zero::ops::cpu;
namespace gpu = zero::ops::cuda;

namespace {

/// n copies of a quiet NaN: a gradient the kernel must write without reading.
template <class T>
std::vector<T> nans(std::size_t n) {
  return std::vector<T>(n, zero::convert<T>(std::numeric_limits<float>::quiet_NaN()));
}

}  // namespace

TEMPLATE_TEST_CASE("RMSNorm forward and backward equal the host's", "[cuda][llama]", float, bf16) {
  using T = TestType;
  struct Shape {
    std::int64_t N, C;
  };
  std::uint32_t seed = 700;
  // C 4096 and 96 are whole packs in both types (the packed path); 100 is for float only; 33 and
  // 1 for neither. 3001 rows: the weight gradient's column sums in several chunks, and a partial
  // last block of 8 warps.
  for (const Shape s : {Shape{1, 1}, Shape{7, 33}, Shape{5, 100}, Shape{3001, 96}, Shape{4, 4096},
                        Shape{1, 4096}}) {
    INFO("N=" << s.N << " C=" << s.C);
    const auto n = static_cast<std::size_t>(s.N * s.C);
    const auto x = random_vector<T>(n, seed++, -2.0f, 3.0f);
    const auto w = random_vector<T>(static_cast<std::size_t>(s.C), seed++, 0.5f, 1.5f);
    const auto dy = random_vector<T>(n, seed++);
    DeviceVector<T> d_x(x), d_w(w), d_dy(dy), d_out(n);
    DeviceVector<float> d_rstd(static_cast<std::size_t>(s.N));
    gpu::rms_norm_forward<T>(d_out.get(), d_rstd.get(), d_x.get(), d_w.get(), s.N, s.C, 1e-5f,
                             nullptr);
    std::vector<T> out(n);
    std::vector<float> rstd(static_cast<std::size_t>(s.N));
    cpu::rms_norm_forward<T>(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, 1e-5f);
    check_close(d_out.download(), out, "rms_norm_forward out");
    check_close(d_rstd.download(), rstd, "rms_norm_forward rstd");

    // The backward from the host's rstd on both sides, added into random gradients.
    auto dx = random_vector<T>(n, seed++);
    auto dw = random_vector<T>(w.size(), seed++);
    DeviceVector<T> d_dx(dx), d_dw(dw);
    d_rstd.upload(rstd);
    gpu::rms_norm_backward<T>(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(),
                              d_rstd.get(), s.N, s.C, nullptr);
    cpu::rms_norm_backward<T>(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), s.N,
                              s.C);
    // dx = rstd (w dy - x rstd^2 mean(w dy x)) cancels (exactly at C = 1): bounds relative to its
    // terms' mean size, rstd |w dy|, as well as to the result's.
    double term_scale = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      term_scale += static_cast<double>(rstd[i / static_cast<std::size_t>(s.C)]) *
                    std::fabs(as_float(dy[i]) * as_float(w[i % static_cast<std::size_t>(s.C)]));
    }
    term_scale /= static_cast<double>(n);
    check_close(d_dx.download(), dx, "rms_norm_backward dinp", 1e-5, 2.0, term_scale);
    check_close(d_dw.download(), dw, "rms_norm_backward dweight");
    // The weight gradient's column sums repeat bit for bit.
    DeviceVector<T> d_dw_again(std::vector<T>(w.size(), zero::convert<T>(0.0f))),
        d_dw_once_more(std::vector<T>(w.size(), zero::convert<T>(0.0f))),
        d_scratch(std::vector<T>(n, zero::convert<T>(0.0f)));
    for (DeviceVector<T>* out_dw : {&d_dw_again, &d_dw_once_more}) {
      gpu::rms_norm_backward<T>(d_scratch.get(), out_dw->get(), d_dy.get(), d_x.get(), d_w.get(),
                                d_rstd.get(), s.N, s.C, nullptr);
    }
    CHECK(same_bits(d_dw_again.download(), d_dw_once_more.download()));
  }
}

TEMPLATE_TEST_CASE("RMSNorm of rows of whole packs at unaligned addresses equals the host's",
                   "[cuda][llama]", float, bf16) {
  // C = 96 is whole 16-byte packs, but x, dy, out and dx start one element past an aligned
  // address: the launchers must take the element-wise path.
  using T = TestType;
  constexpr std::int64_t N = 5, C = 96;
  const auto n = static_cast<std::size_t>(N * C);
  const auto x = random_vector<T>(n + 1, 710, -2.0f, 3.0f);
  const auto w = random_vector<T>(static_cast<std::size_t>(C), 711, 0.5f, 1.5f);
  const auto dy = random_vector<T>(n + 1, 712);
  const std::vector<T> zeros(n + 1, zero::convert<T>(0.0f));
  DeviceVector<T> d_x(x), d_w(w), d_dy(dy), d_out(zeros), d_dx(zeros), d_dw(zeros);
  DeviceVector<float> d_rstd(static_cast<std::size_t>(N));
  gpu::rms_norm_forward<T>(d_out.get() + 1, d_rstd.get(), d_x.get() + 1, d_w.get(), N, C, 1e-5f,
                           nullptr);
  gpu::rms_norm_backward<T>(d_dx.get() + 1, d_dw.get(), d_dy.get() + 1, d_x.get() + 1, d_w.get(),
                            d_rstd.get(), N, C, nullptr);
  std::vector<T> out(zeros), dx(zeros), dw(w.size(), zero::convert<T>(0.0f));
  std::vector<float> rstd(static_cast<std::size_t>(N));
  cpu::rms_norm_forward<T>(out.data() + 1, rstd.data(), x.data() + 1, w.data(), N, C, 1e-5f);
  cpu::rms_norm_backward<T>(dx.data() + 1, dw.data(), dy.data() + 1, x.data() + 1, w.data(),
                            rstd.data(), N, C);
  check_close(d_out.download(), out, "rms_norm_forward out, unaligned");
  check_close(d_dx.download(), dx, "rms_norm_backward dinp, unaligned", 1e-5, 2.0, 1.0);
  std::vector<T> got_dw = d_dw.download();
  got_dw.resize(w.size());
  check_close(got_dw, dw, "rms_norm_backward dweight, unaligned");
}

TEMPLATE_TEST_CASE("the rotary embedding equals the host bit for bit, forward and backward",
                   "[cuda][llama]", float, bf16) {
  using T = TestType;
  struct Shape {
    std::int64_t B, T, first, kv_heads, group, head_size;
  };
  std::uint32_t seed = 800;
  for (const Shape s : {Shape{1, 1, 0, 1, 1, 2}, Shape{2, 5, 0, 2, 2, 8}, Shape{2, 5, 3, 2, 2, 8},
                        Shape{1, 16, 0, 8, 4, 128}, Shape{3, 7, 7, 1, 3, 64}}) {
    INFO("B=" << s.B << " T=" << s.T << " first=" << s.first << " kv_heads=" << s.kv_heads
              << " group=" << s.group << " head_size=" << s.head_size);
    const std::int64_t N = s.B * s.T;
    const std::int64_t width = cpu::grouped_qkv_width(s.kv_heads, s.group, s.head_size);
    const auto n = static_cast<std::size_t>(N * width);
    const auto table = static_cast<std::size_t>(s.T * s.head_size / 2);
    std::vector<float> cos_t(table), sin_t(table);
    cpu::rotary_table(cos_t.data(), sin_t.data(), s.first, s.T, s.head_size, 10000.0);
    const auto x = random_vector<T>(n, seed++, -2.0f, 2.0f);
    const auto dy = random_vector<T>(n, seed++);
    DeviceVector<float> d_cos(cos_t), d_sin(sin_t);
    DeviceVector<T> d_x(x), d_dy(dy), d_out(n);
    gpu::rotary_forward<T>(d_out.get(), d_x.get(), d_cos.get(), d_sin.get(), N, s.T, s.kv_heads,
                           s.group, s.head_size, nullptr);
    std::vector<T> out(n);
    cpu::rotary_forward<T>(out.data(), x.data(), cos_t.data(), sin_t.data(), N, s.T, s.kv_heads,
                           s.group, s.head_size);
    CHECK(same_bits(d_out.download(), out));  // the host's operations, written out on both

    auto dx = random_vector<T>(n, seed++);
    DeviceVector<T> d_dx(dx), d_written(nans<T>(n));
    gpu::rotary_backward<T>(d_dx.get(), d_dy.get(), d_cos.get(), d_sin.get(), N, s.T, s.kv_heads,
                            s.group, s.head_size, false, nullptr);
    gpu::rotary_backward<T>(d_written.get(), d_dy.get(), d_cos.get(), d_sin.get(), N, s.T,
                            s.kv_heads, s.group, s.head_size, true, nullptr);
    std::vector<T> written(n);
    cpu::rotary_backward<T>(dx.data(), dy.data(), cos_t.data(), sin_t.data(), N, s.T, s.kv_heads,
                            s.group, s.head_size, false);
    cpu::rotary_backward<T>(written.data(), dy.data(), cos_t.data(), sin_t.data(), N, s.T,
                            s.kv_heads, s.group, s.head_size, true);
    CHECK(same_bits(d_dx.download(), dx));
    CHECK(same_bits(d_written.download(), written));
  }
  DeviceVector<T> d(16);
  DeviceVector<float> d_table(16);
  CHECK_THROWS_AS(gpu::rotary_forward<T>(d.get(), d.get(), d_table.get(), d_table.get(), 4, 3, 1, 1,
                                         4, nullptr),
                  zero::ShapeError);  // 4 rows are not whole sequences of 3
  CHECK_THROWS_AS(gpu::rotary_forward<T>(d.get(), d.get(), d_table.get(), d_table.get(), 2, 1, 1, 1,
                                         3, nullptr),
                  zero::ShapeError);  // an odd head size
}

TEMPLATE_TEST_CASE("repeat_kv equals the host bit for bit, forward and backward", "[cuda][llama]",
                   float, bf16) {
  using T = TestType;
  struct Shape {
    std::int64_t N, kv_heads, group, head_size;
  };
  std::uint32_t seed = 900;
  for (const Shape s :
       {Shape{1, 1, 1, 1}, Shape{10, 2, 2, 8}, Shape{7, 8, 4, 128}, Shape{5, 3, 5, 12}}) {
    INFO("N=" << s.N << " kv_heads=" << s.kv_heads << " group=" << s.group
              << " head_size=" << s.head_size);
    const auto in =
        static_cast<std::size_t>(s.N * cpu::grouped_qkv_width(s.kv_heads, s.group, s.head_size));
    const auto out_n = static_cast<std::size_t>(s.N * 3 * s.kv_heads * s.group * s.head_size);
    const auto x = random_vector<T>(in, seed++);
    const auto dy = random_vector<T>(out_n, seed++);
    DeviceVector<T> d_x(x), d_dy(dy), d_out(out_n);
    gpu::repeat_kv_forward<T>(d_out.get(), d_x.get(), s.N, s.kv_heads, s.group, s.head_size,
                              nullptr);
    std::vector<T> out(out_n);
    cpu::repeat_kv_forward<T>(out.data(), x.data(), s.N, s.kv_heads, s.group, s.head_size);
    CHECK(same_bits(d_out.download(), out));

    auto dx = random_vector<T>(in, seed++);
    DeviceVector<T> d_dx(dx), d_written(nans<T>(in));
    gpu::repeat_kv_backward<T>(d_dx.get(), d_dy.get(), s.N, s.kv_heads, s.group, s.head_size, false,
                               nullptr);
    gpu::repeat_kv_backward<T>(d_written.get(), d_dy.get(), s.N, s.kv_heads, s.group, s.head_size,
                               true, nullptr);
    std::vector<T> written(in);
    cpu::repeat_kv_backward<T>(dx.data(), dy.data(), s.N, s.kv_heads, s.group, s.head_size, false);
    cpu::repeat_kv_backward<T>(written.data(), dy.data(), s.N, s.kv_heads, s.group, s.head_size,
                               true);
    CHECK(same_bits(d_dx.download(), dx));
    CHECK(same_bits(d_written.download(), written));
  }
}

TEMPLATE_TEST_CASE("SwiGLU forward and backward equal the host's", "[cuda][llama]", float, bf16) {
  using T = TestType;
  struct Shape {
    std::int64_t rows, f;
  };
  std::uint32_t seed = 1000;
  for (const Shape s : {Shape{1, 1}, Shape{9, 48}, Shape{33, 1000}, Shape{4, 11008}}) {
    INFO("rows=" << s.rows << " f=" << s.f);
    const auto in = static_cast<std::size_t>(s.rows * 2 * s.f);
    const auto out_n = static_cast<std::size_t>(s.rows * s.f);
    // Gates from -12 to 12: the sigmoid's saturated tails as well as its middle; and gates past
    // exp's range, where the host clamps exp's argument (-g above 88.7 overflowed expf, and the
    // backward's s * e was 0 * inf).
    auto x = random_vector<T>(in, seed++, -12.0f, 12.0f);
    const float far[] = {-100.0f, -89.0f, -87.5f, 90.0f, 100.0f};
    for (std::size_t i = 0; i < std::size(far) && i < static_cast<std::size_t>(s.f); ++i) {
      x[i] = zero::convert<T>(far[i]);
    }
    const auto dy = random_vector<T>(out_n, seed++);
    DeviceVector<T> d_x(x), d_dy(dy), d_out(out_n);
    gpu::swiglu_forward<T>(d_out.get(), d_x.get(), s.rows, s.f, nullptr);
    std::vector<T> out(out_n);
    cpu::swiglu_forward<T>(out.data(), x.data(), s.rows, s.f);
    check_close(d_out.download(), out, "swiglu_forward");

    auto dx = random_vector<T>(in, seed++);
    DeviceVector<T> d_dx(dx), d_written(nans<T>(in));
    gpu::swiglu_backward<T>(d_dx.get(), d_x.get(), d_dy.get(), s.rows, s.f, false, nullptr);
    gpu::swiglu_backward<T>(d_written.get(), d_x.get(), d_dy.get(), s.rows, s.f, true, nullptr);
    std::vector<T> written(in);
    cpu::swiglu_backward<T>(dx.data(), x.data(), dy.data(), s.rows, s.f, false);
    cpu::swiglu_backward<T>(written.data(), x.data(), dy.data(), s.rows, s.f, true);
    check_close(d_dx.download(), dx, "swiglu_backward, added");
    check_close(d_written.download(), written, "swiglu_backward, written");
  }
}
