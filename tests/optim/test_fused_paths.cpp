// The fused pass gives the same bits on every path: scalar, AVX2, AVX-512 (each forced, where the
// running CPU supports it), any OpenMP thread count, every gradient type and write-back format.
// Data include tails (sizes not a multiple of 16), signed zeros and denormals. Why bitwise: the
// rules contain no contractible multiply-add (lane_ops.hpp), so any difference is a bug. A pass
// handed to an executor (fused_executor.hpp) gives the same bits too.
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <optim/adagrad.hpp>
#include <optim/adam.hpp>
#include <optim/lamb.hpp>
#include <optim/lion.hpp>
#include <optim/rmsprop.hpp>
#include <optim/sgd.hpp>

#include "../support/recording_executor.hpp"
#include "optim_test_util.hpp"

namespace {

using namespace zero::optim;
using zero::bf16;
using zero::DType;
using zero::f16;

// What a run produced.
struct Outcome {
  std::vector<float> param;
  std::vector<std::vector<float>> states;
  std::vector<std::uint16_t> lowp;
};

enum class WriteBack { none, bf16_nearest, bf16_stochastic, f16_nearest };

struct Setup {
  std::size_t n;
  DType grad_dtype;
  WriteBack write_back;
  StepOptions options;
  std::size_t lowp_offset = 0;  // elements of the copy past a 64-byte boundary
};

bool is_second_moment(const std::string& name) {
  return name == "exp_avg_sq" || name == "square_avg" || name == "sum";
}

template <class Opt, class Make>
Outcome run(const Make& make, const Setup& s) {
  Opt opt = make(s.n);
  std::uint64_t seed = 50;
  for (const auto& name : opt.state_names()) {
    const auto init = is_second_moment(name) ? optim_test::make_positive(s.n, ++seed, 1.0)
                                             : optim_test::make_data(s.n, ++seed, 0.1);
    std::copy(init.begin(), init.end(), opt.state(name).begin());
  }
  Outcome out;
  out.param = optim_test::make_data(s.n, 5, 1.0);
  std::vector<std::uint16_t> lowp(s.n + 64, 0);
  const auto address = reinterpret_cast<std::uintptr_t>(lowp.data());
  std::uint16_t* const raw = lowp.data() + (64 - address % 64) % 64 / 2 + s.lowp_offset;
  for (int step = 1; step <= 3; ++step) {
    const auto g32 = optim_test::make_data(s.n, 600 + step, 2.0);
    const auto gb = optim_test::convert_all<bf16>(g32);
    const auto gh = optim_test::convert_all<f16>(g32);
    FusedIo io = s.grad_dtype == DType::bf16  ? FusedIo::over<bf16>(out.param, gb)
                 : s.grad_dtype == DType::f16 ? FusedIo::over<f16>(out.param, gh)
                                              : FusedIo::over<float>(out.param, g32);
    io.scale_grad(step == 2 ? 1e-3f : 0.25f);
    io.first_index = 1000;
    switch (s.write_back) {
      case WriteBack::none:
        break;
      case WriteBack::bf16_nearest:
        io.write_back(std::span<bf16>(reinterpret_cast<bf16*>(raw), s.n));
        break;
      case WriteBack::bf16_stochastic:
        io.write_back(std::span<bf16>(reinterpret_cast<bf16*>(raw), s.n), Rounding::stochastic,
                      0x1234);
        break;
      case WriteBack::f16_nearest:
        io.write_back(std::span<f16>(reinterpret_cast<f16*>(raw), s.n));
        break;
    }
    opt.step(io, s.options);
  }
  for (const auto& name : opt.state_names()) {
    const auto st = opt.state(name);
    out.states.emplace_back(st.begin(), st.end());
  }
  out.lowp.assign(raw, raw + s.n);
  return out;
}

std::size_t differences(const Outcome& a, const Outcome& b, bool lowp_is_bf16) {
  std::size_t bad =
      optim_test::count_bit_differences(a.param.data(), b.param.data(), a.param.size());
  for (std::size_t k = 0; k < a.states.size(); ++k) {
    bad += optim_test::count_bit_differences(a.states[k].data(), b.states[k].data(),
                                             a.states[k].size());
  }
  bad += optim_test::count_bit_differences16(a.lowp.data(), b.lowp.data(), a.lowp.size(),
                                             lowp_is_bf16);
  return bad;
}

std::vector<Isa> vector_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

// Every vector ISA the CPU has, every gradient type and write-back, several awkward sizes:
// identical bits to the scalar path.
template <class Opt, class Make>
void check_all_paths(const Make& make) {
  const std::size_t sizes[] = {1, 7, 15, 16, 17, 33, 255, 16384 + 37};
  for (Isa isa : vector_isas()) {
    for (DType gt : {DType::f32, DType::bf16, DType::f16}) {
      for (WriteBack wb : {WriteBack::none, WriteBack::bf16_nearest, WriteBack::bf16_stochastic,
                           WriteBack::f16_nearest}) {
        for (std::size_t n : sizes) {
          const Setup scalar{n, gt, wb, StepOptions{Isa::scalar, 1}};
          const Setup simd{n, gt, wb, StepOptions{isa, 1}};
          INFO("isa " << name_of(isa) << " grad " << zero::name_of(gt) << " write-back "
                      << static_cast<int>(wb) << " n " << n);
          CHECK(differences(run<Opt>(make, scalar), run<Opt>(make, simd),
                            wb != WriteBack::f16_nearest) == 0);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("Fused paths: the CPU offers at least the scalar path", "[unit][optim]") {
  CHECK(cpu_supports(Isa::scalar));
  CHECK(resolve_isa(Isa::automatic) == best_isa());
  if (!cpu_supports(Isa::avx512)) {
    CHECK_THROWS_WITH(resolve_isa(Isa::avx512), Catch::Contains("does not support"));
  }
  WARN("vector paths tested on this CPU: " << vector_isas().size()
                                           << " (best: " << name_of(best_isa()) << ")");
}

TEST_CASE("Fused paths: SIMD equals scalar bit for bit", "[unit][optim]") {
  SECTION("AdamW") {
    check_all_paths<AdamW>([](std::size_t n) {
      return AdamW(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1});
    });
  }
  SECTION("Adam") {
    check_all_paths<Adam>([](std::size_t n) {
      return Adam(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1});
    });
  }
  SECTION("SGD with Nesterov momentum") {
    check_all_paths<Sgd>([](std::size_t n) {
      return Sgd(n, SgdHyper{0.1, 0.01}, SgdOptions{0.9, 0.0, true});
    });
  }
  SECTION("SGD plain") {
    check_all_paths<Sgd>([](std::size_t n) { return Sgd(n, SgdHyper{0.1, 0.01}); });
  }
  SECTION("RMSprop centered with momentum") {
    check_all_paths<Rmsprop>([](std::size_t n) {
      return Rmsprop(n, RmspropHyper{1e-2, 0.99, 1e-8, 0.01}, RmspropOptions{0.9, true});
    });
  }
  SECTION("RMSprop plain") {
    check_all_paths<Rmsprop>([](std::size_t n) { return Rmsprop(n); });
  }
  SECTION("Adagrad") {
    check_all_paths<Adagrad>([](std::size_t n) {
      return Adagrad(n, AdagradHyper{0.1, 0.01, 1e-10, 0.01});
    });
  }
  SECTION("Lion") {
    check_all_paths<Lion>([](std::size_t n) { return Lion(n, LionHyper{1e-3, 0.9, 0.99, 0.1}); });
  }
  SECTION("LAMB") {
    check_all_paths<Lamb>([](std::size_t n) {
      std::vector<Range> tensors{{0, n / 2}, {n / 2, n - n / 2}};
      return Lamb(n, LambHyper{}, tensors);
    });
  }
}

TEST_CASE("Fused paths: a large shard's copy written past the cache has the scalar bits",
          "[unit][optim]") {
  // fused_stream_min_elems and more: the copy goes out through non-temporal stores where the
  // address allows (aligned) and plain ones elsewhere (offset by one element), on 2 threads.
  const std::size_t n = zero::optim::detail::fused_stream_min_elems + 37;
  const auto make = [](std::size_t size) {
    return AdamW(size, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1});
  };
  for (WriteBack wb :
       {WriteBack::bf16_nearest, WriteBack::bf16_stochastic, WriteBack::f16_nearest}) {
    for (std::size_t offset : {0, 1}) {
      const Setup scalar{n, DType::f32, wb, StepOptions{Isa::scalar, 2}, offset};
      const Outcome reference = run<AdamW>(make, scalar);
      for (Isa isa : vector_isas()) {
        for (bool stream : {true, false}) {
          StepOptions options{isa, 2};
          options.stream_lowp = stream;
          INFO("isa " << name_of(isa) << " write-back " << static_cast<int>(wb) << " offset "
                      << offset << " stream " << stream);
          CHECK(differences(reference, run<AdamW>(make, Setup{n, DType::f32, wb, options, offset}),
                            wb != WriteBack::f16_nearest) == 0);
        }
      }
    }
  }
}

TEST_CASE("Fused paths: results do not depend on the thread count", "[unit][optim]") {
  const std::size_t n = 3 * 16384 + 5;  // several chunks and a tail
  const auto make = [](std::size_t size) {
    std::vector<Range> tensors{{0, 20000}, {20000, size - 20000}};
    return Lamb(size, LambHyper{}, tensors);
  };
  const auto make_adamw = [](std::size_t size) { return AdamW(size); };
  for (int threads : {2, 3}) {
    const Setup one{n, DType::bf16, WriteBack::bf16_stochastic, StepOptions{Isa::automatic, 1}};
    const Setup many{n, DType::bf16, WriteBack::bf16_stochastic,
                     StepOptions{Isa::automatic, threads}};
    CHECK(differences(run<AdamW>(make_adamw, one), run<AdamW>(make_adamw, many), true) == 0);
    CHECK(differences(run<Lamb>(make, one), run<Lamb>(make, many), true) == 0);
  }
}

TEST_CASE("Fused paths: write-back of special values equals the scalar conversions",
          "[unit][optim]") {
  // Lion with lr 0 and no decay leaves p unchanged (Inf and NaN included: it never multiplies p
  // by 0), so the low-precision copy is the conversion of p itself.
  std::vector<float> values{0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            1e-40f,
                            -1e-45f,
                            3.4e38f,
                            -3.4e38f,
                            65504.0f,
                            65520.0f,
                            65519.99f,
                            6e-8f,
                            2.9e-8f,
                            1e-7f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::bit_cast<float>(0x3f808000u),  // bf16 tie, even below
                            std::bit_cast<float>(0x3f818000u),  // bf16 tie, odd below
                            std::bit_cast<float>(0x3f800001u),
                            std::bit_cast<float>(0x7f7fffffu),
                            std::bit_cast<float>(0x387fc000u)};  // f16 subnormal boundary
  while (values.size() % 16 != 3) values.push_back(static_cast<float>(values.size()) * 0.37f);
  const std::size_t n = values.size();
  std::vector<float> grad(n, 0.0f);
  std::vector<Isa> isas{Isa::scalar};
  for (Isa isa : vector_isas()) isas.push_back(isa);
  for (Isa isa : isas) {
    INFO("isa " << name_of(isa));
    std::vector<float> p = values;
    std::vector<bf16> b(n);
    std::vector<f16> h(n);
    Lion opt(n, LionHyper{0.0, 0.9, 0.99, 0.0});
    opt.step(FusedIo::over<float>(p, grad).write_back(std::span<bf16>(b)), {isa, 1});
    p = values;
    opt.step(FusedIo::over<float>(p, grad).write_back(std::span<f16>(h)), {isa, 1});
    for (std::size_t i = 0; i < n; ++i) {
      INFO("value " << values[i]);
      const std::uint16_t eb = bf16::round_nearest_even(values[i]);
      const std::uint16_t eh = f16::round_nearest_even(values[i]);
      CHECK(optim_test::count_bit_differences16(&b[i].bits, &eb, 1, true) == 0);
      CHECK(optim_test::count_bit_differences16(&h[i].bits, &eh, 1, false) == 0);
    }
  }
}

TEST_CASE("Stochastic rounding: unbiased, reproducible, independent of the shard split",
          "[unit][optim]") {
  const std::size_t n = 40000;
  const float x = std::bit_cast<float>(0x3f804000u);  // 1 + 2^-9: a quarter of a bf16 ulp up
  std::vector<float> grad(n, 0.0f);
  std::vector<float> p(n, x);
  std::vector<bf16> whole(n);
  Sgd opt(n, SgdHyper{0.0, 0.0});
  opt.step(
      FusedIo::over<float>(p, grad).write_back(std::span<bf16>(whole), Rounding::stochastic, 99));
  double mean = 0.0;
  for (const bf16& b : whole) mean += bf16::to_float(b.bits);
  mean /= n;
  // Expected 1 + 2^-9; the standard error of the mean is about 2^-7 * 0.43 / 200.
  CHECK(std::fabs(mean - x) < 1e-4);
  std::size_t ups = 0;
  for (const bf16& b : whole) ups += b.bits == 0x3f81u;
  CHECK(ups > n / 5);
  CHECK(ups < n / 3);

  // Two shards with their global first_index produce the same bits as the whole (same step).
  const std::size_t half = 12345;
  std::vector<bf16> parts(n);
  Sgd a(half, SgdHyper{0.0, 0.0}), b(n - half, SgdHyper{0.0, 0.0});
  FusedIo io_a = FusedIo::over<float>(std::span<float>(p.data(), half),
                                      std::span<const float>(grad.data(), half));
  io_a.write_back(std::span<bf16>(parts.data(), half), Rounding::stochastic, 99);
  FusedIo io_b = FusedIo::over<float>(std::span<float>(p.data() + half, n - half),
                                      std::span<const float>(grad.data() + half, n - half));
  io_b.write_back(std::span<bf16>(parts.data() + half, n - half), Rounding::stochastic, 99);
  io_b.first_index = half;
  a.step(io_a);
  b.step(io_b);
  std::size_t same = 0;
  for (std::size_t i = 0; i < n; ++i) same += parts[i].bits == whole[i].bits;
  CHECK(same == n);
}

TEST_CASE("Fused paths: an executor runs the same passes", "[unit][optim]") {
  // Every optimizer whose passes all go through run_fused hands them to StepOptions::executor
  // (a device's kernels in the engine; the recording executor here), which gives the host's bits.
  zero::testing::RecordingExecutor executor;
  const auto same_on_executor = [&]<class Opt>(const auto& make) {
    for (DType gt : {DType::f32, DType::bf16}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{33}, std::size_t{16384 + 37}}) {
        StepOptions on_executor{Isa::scalar, 1};
        on_executor.executor = &executor;
        executor.elements = 0;
        const Outcome host = run<Opt>(make, Setup{n, gt, WriteBack::bf16_stochastic, {}});
        const Outcome moved = run<Opt>(make, Setup{n, gt, WriteBack::bf16_stochastic, on_executor});
        INFO("grad " << zero::name_of(gt) << " n " << n);
        CHECK(differences(host, moved, true) == 0);
        CHECK(executor.elements == 3 * n);  // three steps, every element once
      }
    }
  };
  same_on_executor.operator()<AdamW>([](std::size_t n) {
    return AdamW(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1});
  });
  same_on_executor.operator()<Sgd>([](std::size_t n) {
    return Sgd(n, SgdHyper{0.1, 0.01}, SgdOptions{0.9, 0.0, true});
  });
  same_on_executor.operator()<Rmsprop>([](std::size_t n) {
    return Rmsprop(n, RmspropHyper{1e-2, 0.99, 1e-8, 0.01}, RmspropOptions{0.9, true});
  });
  same_on_executor.operator()<Adagrad>([](std::size_t n) {
    return Adagrad(n, AdagradHyper{0.1, 0.01, 1e-10, 0.01});
  });
  same_on_executor.operator()<Lion>([](std::size_t n) {
    return Lion(n, LionHyper{1e-3, 0.9, 0.99, 0.1});
  });

  // LAMB sums its norms on the host between passes: it refuses an executor before changing
  // anything.
  Lamb lamb(8, LambHyper{}, {{0, 8}});
  std::vector<float> p(8, 1.0f), g(8, 0.5f);
  StepOptions on_executor;
  on_executor.executor = &executor;
  CHECK_THROWS_WITH(lamb.step(FusedIo::over<float>(p, g), on_executor),
                    Catch::Contains("LAMB") && Catch::Contains("a test executor"));
  CHECK(lamb.step_count() == 0);
}
