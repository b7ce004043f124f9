// Engine shards to checkpoint and back: units sharded by UnitPartition at one world size and
// alignment are saved (master and an optimizer state) and loaded into the shards of another
// world size and alignment; every shard equals the slice of the single-process flat buffer,
// padding zeroed.
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::checkpoint;
using zero::parallel::LocalComm;
using zero::testing::TempDir;

namespace {

const std::vector<nn::ParamSpec> unit_params = {
    {"transformer.h.0.attn.c_attn.weight", Shape{9, 4}},
    {"transformer.h.0.attn.c_attn.bias", Shape{9}},
    {"transformer.h.0.ln_1.weight", Shape{4}},
};

/// Element i of the unit's flat buffer (without padding) for state s.
double flat_value(int state, std::int64_t i) {
  return state * 1000.0 + static_cast<double>(i) * 0.25;
}

/// Rank's shard of state under partition, built from the flat values (padding zero).
std::vector<double> expected_shard(const engine::UnitPartition& p, int rank, int state) {
  std::vector<double> shard(static_cast<std::size_t>(p.shard_numel()), 0.0);
  for (std::int64_t k = 0; k < p.shard_numel(); ++k) {
    const std::int64_t i = p.shard_begin(rank) + k;
    if (i < p.numel()) shard[static_cast<std::size_t>(k)] = flat_value(state, i);
  }
  return shard;
}

}  // namespace

TEST_CASE("unit shards saved at one world size load into another", "[unit]") {
  const char* suffixes[2] = {"", "/exp_avg"};
  for (int n : {1, 3, 4}) {
    TempDir dir("ckpt-units");
    const engine::UnitPartition saving(unit_params, n, 4);
    LocalComm::run(n, [&](LocalComm& comm) {
      std::vector<std::vector<double>> states;
      for (int s = 0; s < 2; ++s) states.push_back(expected_shard(saving, comm.rank(), s));
      std::vector<TensorSpec> specs;
      std::vector<Segment> segments;
      for (int s = 0; s < 2; ++s) {
        for (auto& t : unit_tensor_specs<double>(unit_params, suffixes[s])) specs.push_back(t);
        for (auto& g : unit_segments(unit_params, saving, comm.rank(),
                                     std::span<const double>(states[static_cast<std::size_t>(s)]),
                                     suffixes[s])) {
          segments.push_back(g);
        }
      }
      save(comm, dir.path(), "t", std::span<const TensorSpec>(specs),
           std::span<const Segment>(segments));
    });
    for (int m : {1, 2, 5}) {
      const engine::UnitPartition loading(unit_params, m, 3);
      std::vector<int> wrong(static_cast<std::size_t>(m), 0);
      LocalComm::run(m, [&](LocalComm& comm) {
        const Reader reader = load(comm, dir.path());
        for (int s = 0; s < 2; ++s) {
          std::vector<double> shard(static_cast<std::size_t>(loading.shard_numel()), -1.0);
          read_unit_shard(reader, unit_params, loading, comm.rank(), std::span<double>(shard),
                          suffixes[s]);
          wrong[static_cast<std::size_t>(comm.rank())] +=
              shard != expected_shard(loading, comm.rank(), s);
        }
      });
      INFO("saved by " << n << " ranks, loaded by " << m);
      CHECK(wrong == std::vector<int>(static_cast<std::size_t>(m), 0));
    }
  }
  // Negative control: the optimizer state is not the master.
  CHECK(expected_shard(engine::UnitPartition(unit_params, 2, 1), 0, 0) !=
        expected_shard(engine::UnitPartition(unit_params, 2, 1), 0, 1));
}
