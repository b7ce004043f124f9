// ZeRO++'s quantized gradients (qgZ; EngineOptions::quantized_gradients, zero_optimization.
// zero_quantized_gradients): at stages 2-3 each unit's gradient reduce-scatter is an all-to-all of
// the gradient packed as block-wise int8 (core/int8_blocks.hpp), a run for each rank's shard, whose
// runs each rank averages in f32. Packing in runs equals packing each run alone; a sum of runs is
// the f32 sum of their values in run order, rounded once; the engine trains near the f64
// reference at stages 2-3 with accumulation and clipping, with hybrid sharding and with qwZ,
// repeatably; the exchange moves the packed bytes in place of the reduce-scatters; stages 0-1 are
// refused by name and the config key applies at stage 3. At 4 bits (DeepSpeed's width) the
// exchanges move half the bytes and the engine trains further from the reference. With LoCo's
// error feedback (EngineOptions::loco) the packings' losses are carried into the next ones, so the
// engine ends nearer the reference; reset every reduction it is plain qgZ.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/core/rng.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "sgd_engine.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::CommOp;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::thrown_message;

namespace {

constexpr int steps = 3;

engine::EngineOptions qgz_options(int accumulation, double clip, int shard_size = 0) {
  engine::EngineOptions options = sgd_options(accumulation, clip, shard_size);
  options.quantized_gradients = true;
  return options;
}

// Every rank's units after `steps` steps of stage S at world ranks under options.
template <int S>
std::vector<std::vector<double>> trained(int world, const engine::EngineOptions& options) {
  return sgd_trained<S>(world, steps, options);
}

// The worst difference from the f64 reference over every rank of a stage-S run of `count` steps.
template <int S>
double worst_error(int world, int accumulation, double clip, const engine::EngineOptions& options,
                   int count = steps) {
  const auto want = reference_sgd(micro_rows * accumulation * world, count, 1.0, clip);
  const auto errors = per_rank<double>(world, [&](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    auto eng = sgd_engine<S>(model, comm, options);
    return max_error(eng, comm, accumulation, count, want);
  });
  return *std::max_element(errors.begin(), errors.end());
}

}  // namespace

TEST_CASE(
    "int8 blocks: runs pack and read back as each run alone, and a sum of runs is their "
    "f32 sum rounded once",
    "[unit][engine]") {
  // 3 runs of 300 values (a whole block and a short one of 44 each); run 1 is 100 times larger.
  const std::int64_t runs = 3, n = 300;
  std::vector<float> in = random_values(static_cast<std::size_t>(runs * n), 0.02f, 11);
  for (std::int64_t i = n; i < 2 * n; ++i) in[static_cast<std::size_t>(i)] *= 100.0f;
  const auto packed = static_cast<std::size_t>(quant::int8_packed_bytes(n));
  std::vector<std::uint8_t> all(packed * runs);
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(all), runs);
  std::vector<float> back(in.size());
  ops::cpu::dequantize_int8_blocks(std::span<const std::uint8_t>(all), std::span<float>(back),
                                   runs);
  for (std::int64_t r = 0; r < runs; ++r) {
    INFO("run " << r);
    const auto at = static_cast<std::size_t>(r * n);
    std::vector<std::uint8_t> one(packed);
    ops::cpu::quantize_int8_blocks(std::span<const float>(in.data() + at, n),
                                   std::span<std::uint8_t>(one));
    CHECK(
        std::equal(one.begin(), one.end(), all.begin() + static_cast<std::ptrdiff_t>(r * packed)));
    std::vector<float> one_back(static_cast<std::size_t>(n));
    ops::cpu::dequantize_int8_blocks(std::span<const std::uint8_t>(one),
                                     std::span<float>(one_back));
    CHECK(std::equal(one_back.begin(), one_back.end(),
                     back.begin() + static_cast<std::ptrdiff_t>(at)));
  }
  // The mean of the runs: each value's f32 sum over the runs in order, times 1/3, rounded once
  // (to bf16 here), and within the runs' rounding of the exact mean.
  std::vector<bf16> mean(static_cast<std::size_t>(n));
  ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(all), std::span<bf16>(mean), 1.0f / 3);
  float worst = 0, largest_step = 0;
  for (std::int64_t r = 0; r < runs; ++r) {
    for (std::int64_t i = 0; i < n; ++i) {
      largest_step = std::max(largest_step, std::fabs(in[static_cast<std::size_t>(r * n + i)]));
    }
  }
  largest_step /= 127.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    float exact = 0;
    for (std::int64_t r = 0; r < runs; ++r) exact += in[static_cast<std::size_t>(r * n + i)];
    float want = 0;
    for (std::int64_t r = 0; r < runs; ++r) {
      want = quant::int8_add_value(
          want, static_cast<std::int8_t>(all[r * packed + i]),
          quant::int8_scale_at(all.data() + r * packed, n, i / quant::int8_block));
    }
    INFO("value " << i);
    CHECK(mean[static_cast<std::size_t>(i)].bits == convert<bf16>(want * (1.0f / 3)).bits);
    worst = std::max(worst,
                     std::fabs(static_cast<float>(mean[static_cast<std::size_t>(i)]) - exact / 3));
  }
  // Half a step of the largest block in each run, a third of it each, plus bf16's rounding.
  CHECK(worst <= 0.5f * largest_step + 0.01f);
  // Sizes that are not whole runs are refused by name.
  CHECK_THAT(thrown_message([&] {
               ops::cpu::quantize_int8_blocks(std::span<const float>(in.data(), 899),
                                              std::span<std::uint8_t>(all), runs);
             }),
             Catch::Contains("quantize_int8_blocks: 899 values do not split into 3 equal runs"));
  CHECK_THAT(thrown_message([&] {
               ops::cpu::dequantize_int8_blocks(std::span<const std::uint8_t>(all.data(), 100),
                                                std::span<float>(back), runs);
             }),
             Catch::Contains("dequantize_int8_blocks: 900 values in 3 runs pack into 924 bytes, "
                             "not 100"));
  CHECK_THAT(thrown_message([&] {
               ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(all.data(), 2 * packed - 1),
                                         std::span<bf16>(mean), 1.0f);
             }),
             Catch::Contains("sum_int8_blocks: 615 bytes are not whole runs of 300 values (308 "
                             "bytes each)"));
}

TEST_CASE("int8 blocks: runs packed column by column, and sums of runs block by block",
          "[unit][engine]") {
  // 6 runs of 100 values as 3 rows of 2: packed column by column, run j is source run
  // (j % 3) * 2 + j / 3.
  const std::int64_t runs = 6, columns = 2, n = 100;
  const std::vector<float> in = random_values(static_cast<std::size_t>(runs * n), 1.0f, 5);
  const auto packed = static_cast<std::size_t>(quant::int8_packed_bytes(n));
  std::vector<std::uint8_t> by_column(packed * runs), in_order(packed * runs);
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(by_column),
                                 runs, columns);
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(in_order),
                                 runs);
  for (std::int64_t j = 0; j < runs; ++j) {
    const std::int64_t source = (j % 3) * 2 + j / 3;
    CHECK(quant::int8_source_run(j, runs, columns) == source);
    INFO("packed run " << j << " from run " << source);
    CHECK(std::equal(in_order.begin() + static_cast<std::ptrdiff_t>(source * packed),
                     in_order.begin() + static_cast<std::ptrdiff_t>((source + 1) * packed),
                     by_column.begin() + static_cast<std::ptrdiff_t>(j * packed)));
  }
  // Summed in blocks of 3 runs (2 blocks): output o sums run o of each block, as one sum of
  // those two runs alone does.
  std::vector<float> sums(static_cast<std::size_t>(3 * n));
  ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(in_order), std::span<float>(sums), 0.5f,
                            3);
  for (std::int64_t o = 0; o < 3; ++o) {
    std::vector<std::uint8_t> pair(2 * packed);
    std::copy_n(in_order.begin() + static_cast<std::ptrdiff_t>(o * packed), packed, pair.begin());
    std::copy_n(in_order.begin() + static_cast<std::ptrdiff_t>((3 + o) * packed), packed,
                pair.begin() + static_cast<std::ptrdiff_t>(packed));
    std::vector<float> want(static_cast<std::size_t>(n));
    ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(pair), std::span<float>(want), 0.5f);
    INFO("output " << o);
    CHECK(std::equal(want.begin(), want.end(), sums.begin() + static_cast<std::ptrdiff_t>(o * n)));
  }
  CHECK_THAT(thrown_message([&] {
               ops::cpu::quantize_int8_blocks(std::span<const float>(in),
                                              std::span<std::uint8_t>(by_column), runs, 4);
             }),
             Catch::Contains("quantize_int8_blocks: 6 runs are not rows of 4"));
  CHECK_THAT(thrown_message([&] {
               ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(in_order),
                                         std::span<float>(sums), 1.0f, 7);
             }),
             Catch::Contains("sum_int8_blocks: 300 values do not split into 7 equal runs"));
  CHECK_THAT(thrown_message([&] {
               ops::cpu::sum_int8_blocks(std::span<const std::uint8_t>(in_order.data(), 4 * packed),
                                         std::span<float>(sums), 1.0f, 3);
             }),
             Catch::Contains("bytes each) in blocks of 3 runs"));
}

TEST_CASE(
    "qgZ: stages 2 and 3 with quantized gradient exchanges train near the reference, "
    "repeatably",
    "[unit][engine]") {
  for (const int world : {1, 2, 4}) {
    for (const double clip : {0.0, 0.05}) {
      INFO(world << " ranks, clip " << clip);
      const double two = worst_error<2>(world, 2, clip, qgz_options(2, clip));
      const double three = worst_error<3>(world, 2, clip, qgz_options(2, clip));
      UNSCOPED_INFO("worst difference from the reference: stage 2 " << two << ", stage 3 "
                                                                    << three);
      // Each rank's gradient is rounded to up to 1/254 of its block's largest magnitude before
      // the mean, and SGD at lr 1 carries that into the weights; the exact reduce-scatters give
      // < 1e-10.
      CHECK(two > 1e-6);
      CHECK(two < 1e-2);
      CHECK(three > 1e-6);
      CHECK(three < 1e-2);
    }
  }
  // Two runs give the same bits, and stages 2 and 3 the same as each other (the same exchanges
  // of the same gradients).
  const auto once = trained<3>(4, qgz_options(2, 0.05));
  CHECK(once == trained<3>(4, qgz_options(2, 0.05)));
  CHECK(once == trained<2>(4, qgz_options(2, 0.05)));
}

TEST_CASE("qgZ with hybrid sharding and with qwZ: near the reference", "[unit][engine]") {
  // Shard groups of 2 of 4 ranks: the all-to-all inside each group, then the replicas' average
  // of the reduced shard (after the f32 mean written on the compute stream).
  CHECK(worst_error<3>(4, 2, 0.05, qgz_options(2, 0.05, 2)) < 1e-2);
  CHECK(worst_error<2>(4, 2, 0.0, qgz_options(2, 0.0, 2)) < 1e-2);
  // Both halves of ZeRO++'s quantization: every gather and every reduction packed.
  engine::EngineOptions both = qgz_options(2, 0.05);
  both.quantized_weights = true;
  const double worst = worst_error<3>(4, 2, 0.05, both);
  CHECK(worst > 1e-6);
  CHECK(worst < 2e-2);
}

TEST_CASE("qgZ with hpZ: two hops, inside the secondary groups and then across them",
          "[unit][engine]") {
  // 4 ranks in secondary groups of 2: each gradient's runs go first inside the pair (each rank
  // sums the runs of the 2 shards at its place of both pairs), then the 2 partial means across
  // the pairs. Twice rounded, so not one hop's bits, but as near the reference.
  engine::EngineOptions two_hops = qgz_options(2, 0.05);
  two_hops.hpz_size = 2;
  const double worst = worst_error<3>(4, 2, 0.05, two_hops);
  CHECK(worst > 1e-6);
  CHECK(worst < 1e-2);
  CHECK(trained<3>(4, two_hops) != trained<3>(4, qgz_options(2, 0.05)));
  // With hpZ's secondary groups the whole group (hpz_size 4 of 4 ranks) the exchange is one hop.
  engine::EngineOptions whole = qgz_options(2, 0.05);
  whole.hpz_size = 4;
  CHECK(trained<3>(4, whole) == trained<3>(4, qgz_options(2, 0.05)));

  // What crosses between the pairs: the second hop's all-to-all, a third of the one-hop
  // exchange's bus bytes (half the bytes, over 2 ranks instead of 4: (2-1)/2 against (4-1)/4).
  const auto traffic = [&](int hpz) {
    engine::EngineOptions options = qgz_options(1, 0.0);
    options.hpz_size = hpz;
    return one_step_traffic<3>(4, options,
                               {{CommOp::all_to_all, "world"},
                                {CommOp::all_to_all, "dp-secondary"},
                                {CommOp::all_to_all, "dp-across"}});
  };
  const auto one_hop = traffic(0), hops = traffic(2);
  REQUIRE(one_hop[0].count > 0);
  CHECK(hops[0].count == 0);
  CHECK(hops[1].count == one_hop[0].count);
  CHECK(hops[2].count == one_hop[0].count);
  CHECK(hops[1].bytes == one_hop[0].bytes);  // the whole gradient, packed, inside the pair
  CHECK(hops[2].bytes * 2 == one_hop[0].bytes);
  CHECK(hops[2].bus_bytes * 3 == Approx(one_hop[0].bus_bytes));
}

TEST_CASE("qgZ: the reductions move the packed gradients by all-to-all", "[unit][engine]") {
  struct Traffic {
    parallel::CommStats reduce_scatter, all_to_all;
  };
  const auto traffic = [](bool quantized) {
    engine::EngineOptions options = sgd_options(1, 0.0);
    options.quantized_gradients = quantized;
    const auto t = one_step_traffic<3>(
        4, options, {{CommOp::reduce_scatter, "world"}, {CommOp::all_to_all, "world"}});
    return Traffic{t[0], t[1]};
  };
  const Traffic plain = traffic(false), quantized = traffic(true);
  REQUIRE(plain.reduce_scatter.count > 0);
  CHECK(plain.all_to_all.count == 0);
  CHECK(quantized.reduce_scatter.count == 0);
  CHECK(quantized.all_to_all.count == plain.reduce_scatter.count);  // one exchange a reduction
  // Each sends a code a value plus a 4-byte scale per 256 (and at most 3 bytes of padding a
  // run) where the reduce-scatter sends 8 bytes a value.
  CHECK(quantized.all_to_all.bytes * 8 >= plain.reduce_scatter.bytes);
  CHECK(static_cast<double>(quantized.all_to_all.bytes) * 8 <=
        static_cast<double>(plain.reduce_scatter.bytes) * 1.05);
}

TEST_CASE(
    "qgZ at 4 bits (DeepSpeed's width): near the reference, further than 8 bits, repeatably, in "
    "half the bytes, one hop and two",
    "[unit][engine]") {
  const auto int4 = [](int accumulation, double clip) {
    engine::EngineOptions options = qgz_options(accumulation, clip);
    options.quantized_gradient_bits = 4;
    return options;
  };
  for (const int world : {2, 4}) {
    INFO(world << " ranks");
    const double eight = worst_error<3>(world, 2, 0.05, qgz_options(2, 0.05));
    const double four = worst_error<3>(world, 2, 0.05, int4(2, 0.05));
    const double two = worst_error<2>(world, 2, 0.0, int4(2, 0.0));
    UNSCOPED_INFO("worst difference from the reference: 8 bits " << eight << ", 4 bits " << four
                                                                 << ", stage 2 " << two);
    // Up to 1/14 of each block's largest magnitude a rank's contribution instead of 1/254.
    CHECK(four > eight);
    CHECK(four < 0.1);
    CHECK(two > 1e-6);
    CHECK(two < 0.1);
  }
  const auto once = trained<3>(4, int4(2, 0.05));
  CHECK(once == trained<3>(4, int4(2, 0.05)));
  CHECK(once == trained<2>(4, int4(2, 0.05)));
  // Two hops under hpZ, each at 4 bits.
  engine::EngineOptions two_hops = int4(2, 0.05);
  two_hops.hpz_size = 2;
  CHECK(worst_error<3>(4, 2, 0.05, two_hops) < 0.1);
  CHECK(trained<3>(4, two_hops) != once);

  // The exchanges: half of 8 bits' bytes (the codes; the scales stay 4 bytes per 256 values).
  const auto bytes = [&](int bits, int hpz) {
    engine::EngineOptions options = qgz_options(1, 0.0);
    options.quantized_gradient_bits = bits;
    options.hpz_size = hpz;
    return one_step_traffic<3>(4, options,
                               {{CommOp::all_to_all, "world"},
                                {CommOp::all_to_all, "dp-secondary"},
                                {CommOp::all_to_all, "dp-across"}});
  };
  const auto eight = bytes(8, 0), four = bytes(4, 0);
  REQUIRE(eight[0].count > 0);
  CHECK(four[0].count == eight[0].count);
  CHECK(static_cast<double>(four[0].bytes) < 0.52 * static_cast<double>(eight[0].bytes));
  CHECK(static_cast<double>(four[0].bytes) > 0.49 * static_cast<double>(eight[0].bytes));
  const auto eight_hops = bytes(8, 2), four_hops = bytes(4, 2);
  CHECK(static_cast<double>(four_hops[2].bytes) < 0.52 * static_cast<double>(eight_hops[2].bytes));
  CHECK(static_cast<double>(four_hops[1].bytes) < 0.52 * static_cast<double>(eight_hops[1].bytes));
}

TEST_CASE("qgZ: stages that reduce no gradient per micro-step are refused, and the config key",
          "[unit][engine][config]") {
  const auto message = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      engine::EngineOptions options = sgd_options(1, 0.0);
      options.quantized_gradients = true;
      auto eng = sgd_engine<1>(model, comm, options);
    });
  })[0];
  CHECK_THAT(message, Catch::Contains("quantized_gradients (ZeRO++ qgZ"));
  CHECK_THAT(message, Catch::Contains("stage 1 reduces the fp32 accumulator at the window's end: "
                                      "use stage 2 or 3"));
  const auto options = [](int stage) {
    const Config c = Config::from_json_string(
        R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": )" +
        std::to_string(stage) + R"(, "zero_quantized_gradients": true}})");
    return engine::EngineOptions{}.with_config(c, 4);
  };
  CHECK(options(3).quantized_gradients);
  CHECK_FALSE(options(2).quantized_gradients);  // ZeRO++'s keys are stage 3's, as in DeepSpeed
  engine::EngineOptions set;
  set.quantized_gradients = true;
  CHECK(set.with_config(
               Config::from_json_string(
                   R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})"),
               4)
            .quantized_gradients);
  // Ranks that disagree are refused before anything is allocated.
  const auto disagree = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      engine::EngineOptions options = sgd_options(1, 0.0);
      options.quantized_gradients = comm.rank() == 0;
      auto eng = sgd_engine<3>(model, comm, options);
    });
  });
  CHECK_THAT(disagree[0], Catch::Contains("quantized_gradients"));

  // The bits: zero's own key (absent: the engine's 8, or what was set directly), 8 or 4.
  const auto bits = [](const std::string& zero) {
    return engine::EngineOptions{}
        .with_config(
            Config::from_json_string(
                R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, )"
                R"("zero_quantized_gradients": true)" +
                zero + "}}"),
            4)
        .quantized_gradient_bits;
  };
  CHECK(bits("") == 8);
  CHECK(bits(R"(, "zero_quantized_gradient_bits": 4)") == 4);
  CHECK_THAT(thrown_message([&] { bits(R"(, "zero_quantized_gradient_bits": 5)"); }),
             Catch::Contains("zero_quantized_gradient_bits: 5 is not 8 or 4"));
  engine::EngineOptions four;
  four.quantized_gradient_bits = 4;
  CHECK(four.with_config(
                Config::from_json_string(
                    R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})"),
                4)
            .quantized_gradient_bits == 4);
  // Set directly, other widths are refused by name; ranks must agree on it.
  const auto odd = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      engine::EngineOptions options = qgz_options(1, 0.0);
      options.quantized_gradient_bits = 2;
      auto eng = sgd_engine<3>(model, comm, options);
    });
  });
  CHECK_THAT(odd[0], Catch::Contains("quantized_gradient_bits (zero_optimization."
                                     "zero_quantized_gradient_bits) is 2; qgZ packs gradients in "
                                     "8 or 4 bits a code"));
  const auto apart = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      engine::EngineOptions options = qgz_options(1, 0.0);
      options.quantized_gradient_bits = comm.rank() == 0 ? 4 : 8;
      auto eng = sgd_engine<3>(model, comm, options);
    });
  });
  CHECK_THAT(apart[0], Catch::Contains("quantized_gradient_bits"));
}

TEST_CASE(
    "qgZ with LoCo error feedback: nearer the reference at 4 bits, plain qgZ when reset every "
    "reduction, kept errors in the memory report and estimate, refusals and the config key",
    "[unit][engine][config]") {
  const auto int4 = [](int accumulation, double clip, bool loco, float beta = 0.8f) {
    engine::EngineOptions options = qgz_options(accumulation, clip);
    options.quantized_gradient_bits = 4;
    options.loco = loco;
    options.loco_err_beta = beta;
    return options;
  };
  constexpr int longer = 8;  // steps: the losses of plain packing add up, LoCo's do not
  for (const int world : {2, 4}) {
    INFO(world << " ranks");
    const double plain = worst_error<2>(world, 1, 0.0, int4(1, 0.0, false), longer);
    const double fed = worst_error<2>(world, 1, 0.0, int4(1, 0.0, true, 0.0f), longer);
    const double smoothed = worst_error<2>(world, 1, 0.0, int4(1, 0.0, true), longer);
    const double clipped = worst_error<3>(world, 2, 0.05, int4(2, 0.05, true), longer);
    UNSCOPED_INFO("worst difference from the reference after "
                  << longer << " steps at 4 bits: plain " << plain << ", LoCo err_beta 0 " << fed
                  << ", err_beta 0.8 " << smoothed << ", stage 3 with clipping " << clipped);
    CHECK(fed < 0.5 * plain);
    CHECK(smoothed < plain);
    CHECK(clipped < 0.1);
  }
  // Repeatable, stage 2 = stage 3; reset every reduction, nothing is fed back: plain qgZ's bits.
  const auto once = trained<3>(4, int4(2, 0.05, true));
  CHECK(once == trained<3>(4, int4(2, 0.05, true)));
  CHECK(once == trained<2>(4, int4(2, 0.05, true)));
  CHECK(once != trained<3>(4, int4(2, 0.05, false)));
  engine::EngineOptions every = int4(2, 0.05, true);
  every.loco_reset_interval = 1;
  CHECK(trained<3>(4, every) == trained<3>(4, int4(2, 0.05, false)));
  // Two hops under hpZ, each packing with its own kept error.
  engine::EngineOptions two_hops = int4(2, 0.05, true);
  two_hops.hpz_size = 2;
  CHECK(worst_error<3>(4, 2, 0.05, two_hops) < 0.1);
  CHECK(trained<3>(4, two_hops) != once);
  engine::EngineOptions every_hop = two_hops, plain_hops = int4(2, 0.05, false);
  every_hop.loco_reset_interval = 1;  // both kept errors zeroed before every packing
  plain_hops.hpz_size = 2;
  CHECK(trained<3>(4, every_hop) == trained<3>(4, plain_hops));

  // The kept errors: about a byte per parameter of each unit's whole gradient (int8 blocks), and
  // 1/2 more under hpZ's groups of 2 (the partial sums'), in the report once every unit reduced
  // and in the estimate; none without LoCo.
  const auto kept = [](const engine::EngineOptions& options) {
    return per_rank<std::vector<double>>(4, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      auto eng = sgd_engine<3>(model, comm, options);
      const double before = static_cast<double>(eng.memory_report().kept_error_bytes);
      const GlobalBatch b(micro_rows * 4, 0, tiny().vocab_size);
      eng.forward(b.micro(0, comm.rank(), 4));
      eng.backward();
      eng.step();
      eng.synchronize();
      std::int64_t padded = 0;
      for (int u = 0; u < eng.num_units(); ++u) padded += eng.partition(u).padded_numel();
      return std::vector<double>{before, static_cast<double>(eng.memory_report().kept_error_bytes),
                                 eng.memory_estimate().device_at_rest, static_cast<double>(padded)};
    })[0];
  };
  const auto none = kept(int4(1, 0.0, false));
  const auto one_hop = kept(int4(1, 0.0, true));
  engine::EngineOptions hop_options = int4(1, 0.0, true);
  hop_options.hpz_size = 2;
  const auto hops = kept(hop_options);
  UNSCOPED_INFO("kept error bytes: one hop " << one_hop[1] << ", two hops " << hops[1] << ", for "
                                             << one_hop[3] << " parameters");
  CHECK(none[1] == 0);
  CHECK(one_hop[0] == 0);
  CHECK(one_hop[1] >= one_hop[3]);
  CHECK(one_hop[1] < 1.1 * one_hop[3]);
  CHECK(one_hop[2] - none[2] == one_hop[1]);
  CHECK(hops[1] > 1.45 * one_hop[1]);
  CHECK(hops[1] < 1.55 * one_hop[1]);

  // Refused without qgZ, with err_beta outside [0, 1) and reset_T below 1, and when ranks
  // disagree.
  const auto refused = [](auto edit) {
    return per_rank<std::string>(2, [&](LocalComm& comm) {
      nn::GPT<double> model(tiny());
      return thrown_message([&] {
        engine::EngineOptions options = qgz_options(1, 0.0);
        options.loco = true;
        edit(options, comm.rank());
        auto eng = sgd_engine<3>(model, comm, options);
      });
    })[0];
  };
  CHECK_THAT(refused([](engine::EngineOptions& o, int) { o.quantized_gradients = false; }),
             Catch::Contains("loco (ZeRO++ LoCo, zero_optimization.zeropp_loco_param) feeds back "
                             "the errors of qgZ's packings; quantized_gradients is off"));
  CHECK_THAT(refused([](engine::EngineOptions& o, int) { o.loco_err_beta = 1.0f; }),
             Catch::Contains("loco_err_beta (zeropp_loco_param.err_beta) is 1; it must be in "
                             "[0, 1)"));
  CHECK_THAT(refused([](engine::EngineOptions& o, int) { o.loco_reset_interval = 0; }),
             Catch::Contains("loco_reset_interval (zeropp_loco_param.reset_T) is 0; it must be "
                             "at least 1"));
  CHECK_THAT(refused([](engine::EngineOptions& o, int rank) { o.loco = rank == 0; }),
             Catch::Contains("loco"));

  // The config key: DeepSpeed's zeropp_loco_param, its defaults for absent keys, null for off,
  // without effect unless qgZ is on.
  const auto loco = [](const std::string& zero) {
    return engine::EngineOptions{}.with_config(
        Config::from_json_string(
            R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3)" + zero +
            "}}"),
        4);
  };
  const auto both = loco(R"(, "zero_quantized_gradients": true,
                            "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 64})");
  CHECK(both.loco);
  CHECK(both.loco_err_beta == 0.5f);
  CHECK(both.loco_reset_interval == 64);
  const auto defaults = loco(R"(, "zero_quantized_gradients": true, "zeropp_loco_param": {})");
  CHECK(defaults.loco);
  CHECK(defaults.loco_err_beta == 0.8f);
  CHECK(defaults.loco_reset_interval == 1024);
  CHECK_FALSE(loco(R"(, "zero_quantized_gradients": true, "zeropp_loco_param": null)").loco);
  CHECK_FALSE(loco(R"(, "zeropp_loco_param": {"err_beta": 0.5})").loco);
  const Config alone = Config::from_json_string(
      R"({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.5}}})");
  CHECK_THAT(alone.notices.empty() ? std::string() : alone.notices[0],
             Catch::Contains("zeropp_loco_param.err_beta"));
  CHECK(Config::from_json_string(
            R"({"zero_optimization": {"stage": 3, "zero_quantized_gradients": true,
                                      "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 8}}})")
            .notices.empty());
  CHECK_THAT(
      thrown_message([&] { loco(R"(, "zeropp_loco_param": {"err_beta": 1.5})"); }),
      Catch::Contains("zero_optimization.zeropp_loco_param.err_beta: 1.5 must be in [0, 1)"));
  CHECK_THAT(thrown_message([&] { loco(R"(, "zeropp_loco_param": {"reset_T": 0})"); }),
             Catch::Contains("zero_optimization.zeropp_loco_param.reset_T: 0 must be at least 1"));
  const Config typo = Config::from_json_string(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_gradients": true,
                                "zeropp_loco_param": {"err_bta": 0.5}}})");
  CHECK(std::any_of(typo.warnings.begin(), typo.warnings.end(), [](const std::string& w) {
    return w.find("zeropp_loco_param.err_bta") != std::string::npos;
  }));
}

TEST_CASE(
    "LoCo's kept errors are not saved and a checkpoint load drops them: a loaded engine goes on "
    "as a new engine loaded from the same checkpoint",
    "[unit][engine]") {
  const zero::testing::TempDir dir("loco-load");
  using Eng = engine::Engine<nn::GPT<float>, ZeroStage<3>>;
  const auto runs = per_rank<std::vector<std::vector<std::vector<float>>>>(2, [&](LocalComm& comm) {
    engine::EngineOptions options = tiny_options();
    options.quantized_gradients = true;
    options.quantized_gradient_bits = 4;
    options.loco = true;
    nn::GPT<float> model(tiny());
    Eng eng(model, comm, adamw_config(3, 1, 0.0), options);
    train_steps(eng, comm, 0, 2, 1);
    eng.save_checkpoint(dir.path(), "two", {});
    const auto carried_on = train_steps(eng, comm, 2, 3, 1);  // with the kept errors
    (void)eng.load_checkpoint(dir.path(), "two");
    const auto reloaded = train_steps(eng, comm, 2, 3, 1);
    nn::GPT<float> other(tiny());
    Eng fresh(other, comm, adamw_config(3, 1, 0.0), options);
    (void)fresh.load_checkpoint(dir.path(), "two");
    const auto loaded = train_steps(fresh, comm, 2, 3, 1);
    return std::vector<std::vector<std::vector<float>>>{carried_on, reloaded, loaded};
  });
  for (const auto& r : runs) {
    CHECK(r[1] == r[2]);  // the reload kept no error: as the new engine
    CHECK(r[0] != r[2]);  // the kept errors made a difference to the step after the save
  }
}
