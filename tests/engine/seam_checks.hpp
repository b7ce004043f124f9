#pragma once
// The Engine 2 seams, checked the same way on LocalComm and under mpiexec:
//   - stage slices: units [0, k) and [k, n) driven as two forward/backward slices, with the
//     activation and its gradient handed over by hand, train exactly as the whole model does;
//   - process groups: on a (tp x dp) Grid an engine over each data-parallel group trains a model
//     that keeps its tensor-parallel group (and uses it for nothing but a no-op) exactly as one
//     process on the dp group's global batch, and the only traffic is on the dp groups.
// Each returns numbers for the caller to assert on its main thread.
#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/topology.hpp>

#include "../support/worse.hpp"
#include "engine_test_util.hpp"

namespace zero::test {

// Options of the f64 SGD engines below (as sgd_error's).
inline engine::EngineOptions seam_options(int accumulation) {
  engine::EngineOptions options;
  options.gradient_accumulation_steps = accumulation;
  options.activation_bytes = 32 << 20;
  options.persistence_threshold = 0;
  options.prefetch_elems = 1;
  return options;
}
inline void sgd_lr1(int, std::span<double> p, std::span<const double> g) {
  sgd(1.0, p, g);
}

// Largest difference between the engine's gathered units and want (a collective).
template <class Eng>
double largest_difference(Eng& eng, const std::vector<std::vector<double>>& want) {
  double worst = 0;
  for (int u = 0; u < eng.num_units(); ++u) {
    const auto got = eng.gather_unit_values(u);
    const auto& ref = want.at(static_cast<std::size_t>(u));
    if (got.size() != ref.size()) {
      throw std::runtime_error("unit " + std::to_string(u) + " has " + std::to_string(got.size()) +
                               " values, the reference " + std::to_string(ref.size()));
    }
    for (std::size_t i = 0; i < got.size(); ++i)
      worst = zero::testing::worse(worst, std::fabs(got[i] - ref[i]));
  }
  return worst;
}

// Stage S, f64 SGD lr 1, each micro-step driven as the slices [0, split) and [split, n) with the
// activation and its gradient copied by hand between them (perturb is added to the first handed
// activation: the negative control). Returns the largest difference to want.
template <int S, class Comm>
double sliced_error(Comm& comm, int accumulation, int steps, int split,
                    const std::vector<std::vector<double>>& want, double perturb = 0.0) {
  nn::GPT<double> model(tiny());
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(model, comm, sgd_lr1,
                                                    seam_options(accumulation));
  const int n = eng.num_units(), world = comm.size();
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(micro_rows * accumulation * world, step, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      const engine::MicroBatch mb = b.micro(m, comm.rank(), world);
      const Tensor<double> out = eng.forward_units({0, split}, mb);
      std::vector<double> handed(out.data(), out.data() + out.numel());  // lives to backward
      handed[0] += perturb;
      eng.forward_units({split, n}, mb, Tensor<double>(handed.data(), out.shape()));
      const Tensor<double> dx = eng.backward_units({split, n});
      std::vector<double> grad(dx.data(), dx.data() + dx.numel());
      const Tensor<double> below =
          eng.backward_units({0, split}, Tensor<double>(grad.data(), dx.shape()));
      if (below.data() != nullptr)
        throw std::runtime_error("backward past unit 0 returned a gradient");
      if (eng.step() != (m + 1 == accumulation)) {
        throw std::runtime_error("step() disagreed with the accumulation boundary at micro-step " +
                                 std::to_string(m));
      }
    }
  }
  return largest_difference(eng, want);
}

// A GPT that also holds its tensor-parallel group and uses it for nothing but a no-op (it reads
// the group's size): the engine must leave that group alone.
template <class Comm>
class GptWithTpGroup : public nn::GPT<double> {
 public:
  GptWithTpGroup(nn::GPTConfig cfg, Comm& tp) : nn::GPT<double>(cfg), tp_(tp) {}
  void forward_unit(int unit, nn::StepContext<double>& ctx) {
    tp_ranks_ = tp_.size();  // the no-op: TP ranks replicate everything here
    nn::GPT<double>::forward_unit(unit, ctx);
  }

 private:
  Comm& tp_;
  int tp_ranks_ = 0;
};

// What one rank saw on a (tp x dp) grid.
struct GroupRun {
  double error = 0;                  // to the reference of its dp group's global batch
  double wrong_reference_error = 0;  // to a reference with half the learning rate
  std::set<std::string> groups;      // groups that carried traffic
  std::uint64_t dp_bytes = 0;        // bytes on the dp group
  std::uint64_t tp_bytes = 0;        // bytes on the tp group
};

// Stage S on world split as a Grid (tp, dp = world / tp): the engine shards over the grid's
// data-parallel group; the logger (set on world before the split, so every group shares it)
// records where the traffic went.
template <int S, class Comm>
GroupRun grid_run(Comm& world, int tp, int accumulation, int steps) {
  auto logger = std::make_shared<parallel::CommLogger>(false);
  world.set_logger(logger);
  const parallel::Grid grid = parallel::Grid::for_world(world.size(), tp, 1, 1, 1);
  parallel::ProcessGroups<Comm> groups(world, grid);
  GptWithTpGroup<Comm> model(tiny(), groups.tp());
  const int dp = groups.dp().size(), dp_rank = groups.dp().rank();
  logger->enable();
  engine::Engine<GptWithTpGroup<Comm>, ZeroStage<S>> eng(model, groups, sgd_lr1,
                                                         seam_options(accumulation));
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(micro_rows * accumulation * dp, step, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, dp_rank, dp));
      eng.backward();
      eng.step();
    }
  }
  logger->enable(false);
  GroupRun r;
  for (const auto& rec : logger->records()) {
    if (rec.stats.count == 0) continue;
    r.groups.insert(rec.group);
    if (rec.group == "dp") r.dp_bytes += rec.stats.bytes;
    if (rec.group == "tp") r.tp_bytes += rec.stats.bytes;
  }
  r.error = largest_difference(eng, reference_sgd(micro_rows * accumulation * dp, steps, 1.0));
  r.wrong_reference_error =
      largest_difference(eng, reference_sgd(micro_rows * accumulation * dp, steps, 0.5));
  world.set_logger(nullptr);
  return r;
}

}  // namespace zero::test
