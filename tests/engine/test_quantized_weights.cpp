// ZeRO++'s quantized weights (qwZ; EngineOptions::quantized_weights, zero_optimization.
// zero_quantized_weights): stage 3's gathers from the master slices move them as block-wise int8
// (core/int8_blocks.hpp). The packing reads back within half a step of each block's scale, keeps
// zeros and short blocks, and repeats bit for bit; the engine trains near the f64 reference (the
// weights the units see are rounded; the master is not) and bit for bit the same with hpZ's
// secondary shards (they hold what the forward's gather read back); the gathers move the packed
// bytes; bad stages are refused by name.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/core/int4_blocks.hpp>
#include <zero/core/int8_blocks.hpp>
#include <zero/core/rng.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/ops/cpu/int4_blocks.hpp>
#include <zero/ops/cpu/int8_blocks.hpp>

#include "../support/per_rank.hpp"
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

engine::EngineOptions qwz_options(int accumulation, double clip, int hpz_size = 0) {
  engine::EngineOptions options = sgd_options(accumulation, clip, 0, hpz_size);
  options.quantized_weights = true;
  return options;
}

// Every rank's units after `steps` steps of stage 3 at world ranks under options.
std::vector<std::vector<double>> trained(int world, const engine::EngineOptions& options) {
  return sgd_trained<3>(world, steps, options);
}

}  // namespace

TEST_CASE("int8 blocks: a packed run reads back within half a step of its block's scale",
          "[unit][engine]") {
  // 1000 values: 3 whole blocks of 256 and a short one of 232; the second block is all zeros
  // and the third holds one large value.
  std::vector<float> in = random_values(1000, 0.05f, 7);
  std::fill(in.begin() + 256, in.begin() + 512, 0.0f);
  in[600] = 3.0f;
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(quant::int8_packed_bytes(1000)));
  CHECK(packed.size() == 1000 + 4 * 4);
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(packed));
  std::vector<float> out(in.size());
  ops::cpu::dequantize_int8_blocks(std::span<const std::uint8_t>(packed), std::span<float>(out));
  for (std::int64_t b = 0; b < quant::int8_blocks(1000); ++b) {
    const auto first = static_cast<std::size_t>(b * quant::int8_block);
    const auto last = std::min(in.size(), first + quant::int8_block);
    float absmax = 0;
    for (std::size_t i = first; i < last; ++i) absmax = std::max(absmax, std::fabs(in[i]));
    const float step = absmax / 127.0f;
    float worst = 0;  // in half steps
    for (std::size_t i = first; i < last; ++i) {
      if (step > 0) worst = std::max(worst, std::fabs(out[i] - in[i]) / (0.5f * step));
    }
    INFO("block " << b);
    CHECK(worst <= 1.0f + 1e-5f);
    if (b != 1) CHECK(worst > 0.5f);  // the rounding is there (block 1 is all zeros)
  }
  for (std::size_t i = 256; i < 512; ++i) CHECK(out[i] == 0.0f);  // a block of zeros stays zero
  CHECK(out[600] == 3.0f);  // a block's largest magnitude is exact
  // The same values pack to the same bytes (the device's kernels are held to these).
  std::vector<std::uint8_t> again(packed.size());
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(again));
  CHECK(again == packed);
  // A wrong size is refused by name.
  std::vector<std::uint8_t> short_buffer(packed.size() - 1);
  CHECK_THAT(thrown_message([&] {
               ops::cpu::quantize_int8_blocks(std::span<const float>(in),
                                              std::span<std::uint8_t>(short_buffer));
             }),
             Catch::Contains("quantize_int8_blocks: 1000 values pack into 1016 bytes, not 1015"));
}

TEST_CASE("int8 and int4 blocks: a block of NaNs alone packs with scale 0 and codes 0",
          "[unit][engine]") {
  // The largest magnitude skips NaNs from 0 (the device's kernels floor their fmaxf reduction
  // at 0 to give the same): a block of NaNs alone has scale 0, codes 0 and reads back 0; a NaN
  // among finite values takes the code -max (a NaN quotient's, through fmaxf's rule).
  std::vector<float> in = random_values(600, 0.05f, 11);
  std::fill(in.begin(), in.begin() + 256, std::nanf(""));
  in[300] = std::nanf("");
  const auto scale_of = [](const std::vector<std::uint8_t>& packed, std::int64_t offset, int b) {
    float scale = 0;
    std::memcpy(&scale, packed.data() + offset + 4 * b, 4);
    return scale;
  };
  std::vector<std::uint8_t> int8(static_cast<std::size_t>(quant::int8_packed_bytes(600)));
  ops::cpu::quantize_int8_blocks(std::span<const float>(in), std::span<std::uint8_t>(int8));
  CHECK(scale_of(int8, quant::int8_scales_offset(600), 0) == 0.0f);
  CHECK(std::all_of(int8.begin(), int8.begin() + 256, [](std::uint8_t c) { return c == 0; }));
  CHECK(static_cast<std::int8_t>(int8[300]) == -127);
  CHECK(scale_of(int8, quant::int8_scales_offset(600), 1) > 0.0f);
  std::vector<float> out(in.size());
  ops::cpu::dequantize_int8_blocks(std::span<const std::uint8_t>(int8), std::span<float>(out));
  CHECK(std::all_of(out.begin(), out.begin() + 256, [](float v) { return v == 0.0f; }));
  std::vector<std::uint8_t> int4(static_cast<std::size_t>(quant::int4_packed_bytes(600)));
  ops::cpu::quantize_int4_blocks(std::span<const float>(in), std::span<std::uint8_t>(int4));
  CHECK(scale_of(int4, quant::int4_scales_offset(600), 0) == 0.0f);
  CHECK(std::all_of(int4.begin(), int4.begin() + 128, [](std::uint8_t c) { return c == 0; }));
  CHECK(quant::int4_code_at(int4.data(), 300) == -7);
}

TEST_CASE("qwZ: stage 3 with quantized gathers trains near the reference, repeatably",
          "[unit][engine]") {
  for (const int world : {1, 2, 4}) {
    for (const double clip : {0.0, 0.05}) {
      INFO(world << " ranks, clip " << clip);
      const auto want = reference_sgd(micro_rows * 2 * world, steps, 1.0, clip);
      const auto errors = per_rank<double>(world, [&](LocalComm& comm) {
        nn::GPT<double> model(tiny());
        auto eng = sgd_engine<3>(model, comm, qwz_options(2, clip));
        return max_error(eng, comm, 2, steps, want);
      });
      const double worst = *std::max_element(errors.begin(), errors.end());
      UNSCOPED_INFO("worst difference from the reference " << worst);
      // The units compute on rounded weights, so the run is not the reference's: the rounding
      // is up to 1/254 of a block's largest weight, and SGD at lr 1 carries the gradients'
      // change into the weights (0.6e-3 to 5e-3 here, against 1e-10 for the exact gathers).
      CHECK(worst > 1e-6);
      CHECK(worst < 1e-2);
    }
  }
  // Two runs give the same bits.
  CHECK(trained(2, qwz_options(1, 0.0)) == trained(2, qwz_options(1, 0.0)));
}

TEST_CASE("qwZ with hpZ: the backward's gathers from secondary shards give the same bits",
          "[unit][engine]") {
  // Without hpZ the backward gathers and reads back the same packed slices again.
  CHECK(trained(4, qwz_options(2, 0.05, 2)) == trained(4, qwz_options(2, 0.05)));
}

TEST_CASE("qwZ: the gathers move the packed slices", "[unit][engine]") {
  const auto traffic = [](bool quantized) {
    engine::EngineOptions options = sgd_options(1, 0.0);
    options.quantized_weights = quantized;
    return one_step_traffic<3>(4, options, {{CommOp::all_gather, "world"}})[0];
  };
  const parallel::CommStats plain = traffic(false), quantized = traffic(true);
  REQUIRE(plain.count > 0);
  CHECK(quantized.count == plain.count);  // the same gathers
  // Each moves a code a value plus a 4-byte scale per 256 (and at most 3 bytes of padding) where
  // the plain gather moves 8 bytes a value.
  CHECK(quantized.bytes * 8 >= plain.bytes);
  CHECK(static_cast<double>(quantized.bytes) * 8 <= static_cast<double>(plain.bytes) * 1.03);
}

TEST_CASE("qwZ: a stage that gathers no parameters per pass is refused, and the config key",
          "[unit][engine][config]") {
  const auto message = per_rank<std::string>(2, [](LocalComm& comm) {
    nn::GPT<double> model(tiny());
    return thrown_message([&] {
      engine::EngineOptions options = sgd_options(1, 0.0);
      options.quantized_weights = true;
      auto eng = sgd_engine<2>(model, comm, options);
    });
  })[0];
  CHECK_THAT(message, Catch::Contains("quantized_weights (ZeRO++ qwZ"));
  CHECK_THAT(message, Catch::Contains("stage 2 gathers no parameters per pass: use stage 3"));
  const auto options = [](int stage) {
    const Config c = Config::from_json_string(
        R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": )" +
        std::to_string(stage) + R"(, "zero_quantized_weights": true}})");
    return engine::EngineOptions{}.with_config(c, 4);
  };
  CHECK(options(3).quantized_weights);
  CHECK_FALSE(options(2).quantized_weights);  // the key has no effect below stage 3
  // A config without the key leaves the option as the program set it (engine_bench's did not
  // take effect while with_config cleared it).
  engine::EngineOptions set;
  set.quantized_weights = true;
  CHECK(set.with_config(
               Config::from_json_string(
                   R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})"),
               4)
            .quantized_weights);
}
