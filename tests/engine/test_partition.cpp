// Flat unit layout and sharding: shards tile the padded buffer, segments cover every parameter
// exactly once, and sharded initialisation equals the single-process one at any world size.
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/buffer.hpp>
#include <zero/engine/partition.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

using namespace zero;

TEST_CASE("segments cover every parameter element exactly once", "[unit][partition]") {
  const std::vector<nn::ParamSpec> specs = {
      {"a", {7}}, {"b", {3, 5}}, {"c", {1}}, {"d", {0}}, {"e", {2, 2}}};  // 27 elements
  for (int world = 1; world <= 8; ++world) {
    for (std::int64_t align : {1, 4, 64}) {
      engine::UnitPartition p(specs, world, align);
      CHECK(p.numel() == 27);
      CHECK(p.padded_numel() >= 27);
      CHECK(p.padded_numel() - 27 < world * align);  // padding below one aligned row per rank
      CHECK(p.shard_numel() % align == 0);
      std::vector<int> seen(27, 0);
      for (int r = 0; r < world; ++r) {
        std::int64_t previous_end = 0;
        for (const auto& seg : p.segments(r)) {
          REQUIRE(seg.shard_offset >= previous_end);  // in flat order, no overlap
          REQUIRE(seg.shard_offset + seg.count <= p.shard_numel());
          previous_end = seg.shard_offset + seg.count;
          const auto flat = p.slot(seg.param).offset + seg.param_offset;
          REQUIRE(flat == p.shard_begin(r) + seg.shard_offset);
          for (std::int64_t i = 0; i < seg.count; ++i) ++seen[static_cast<std::size_t>(flat + i)];
        }
      }
      for (int s : seen) REQUIRE(s == 1);
    }
  }
  CHECK_THROWS_AS(engine::UnitPartition(specs, 0), Error);
  CHECK_THROWS_AS(engine::UnitPartition(specs, 2).segments(2), Error);
}

TEST_CASE("sharded initialisation equals the single-process model at any world size",
          "[unit][partition]") {
  nn::GPT<float> model(nn::GPTConfig::preset("tiny"));
  nn::LocalParameters<nn::GPT<float>> reference(model, 1234);
  for (int world : {1, 2, 3, 5, 8}) {
    for (int u = 0; u < model.num_units(); ++u) {
      const auto specs = model.unit_params(u);
      engine::UnitPartition p(specs, world, 4);
      Buffer<float> flat(static_cast<std::size_t>(p.padded_numel()));
      for (int r = 0; r < world; ++r) {
        engine::initialise_shard(specs, p, r, flat.view().slice(p.shard_begin(r), p.shard_numel()),
                                 1234);
      }
      const auto want = reference.unit_values(u);
      for (std::int64_t i = 0; i < p.numel(); ++i) REQUIRE(flat.view().at(i) == want.at(i));
      for (std::int64_t i = p.numel(); i < p.padded_numel(); ++i)
        REQUIRE(flat.view().at(i) == 0.0f);
    }
  }
  // Negative control: another seed gives other weights.
  const auto specs = model.unit_params(1);
  engine::UnitPartition p(specs, 2);
  Buffer<float> shard(static_cast<std::size_t>(p.shard_numel()));
  engine::initialise_shard(specs, p, 0, shard.view(), 999);
  bool differs = false;
  for (const auto& seg : p.segments(0)) {
    const auto want = reference.unit_values(1);
    for (std::int64_t i = 0; i < seg.count; ++i) {
      differs |= shard.view().at(seg.shard_offset + i) !=
                 want.at(p.slot(seg.param).offset + seg.param_offset + i);
    }
  }
  CHECK(differs);
}
