#pragma once
// Shared by the Ulysses engine tests (GPT and Llama): a step's token and target sequences, the
// one-process reference on the whole global batch, the training loop that feeds each rank its dp
// rank's rows and its sp rank's block of positions of every sequence (parallel::sequence_slice),
// and a layout's run on LocalComm ranks assembled into whole tensors.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <optim/grad_norm.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/core/arena.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/per_rank.hpp"
#include "engine_test_util.hpp"
#include "tp_test_util.hpp"

namespace zero::test {

/// Positions of every sequence of the Ulysses tests: divisible by sp 1, 2 and 4.
inline constexpr std::int64_t ulysses_seq_len = 8;
/// Targets ignored at the end of each sequence of a padded batch.
inline constexpr std::int64_t ulysses_padding = 3;

/// The tokens and targets of step `step`: rows sequences of ulysses_seq_len positions; padded:
/// each sequence's last ulysses_padding targets are -1.
struct SequenceBatch {
  std::vector<std::int32_t> tokens, targets;
  SequenceBatch(std::int64_t rows, int step, std::int64_t vocab, bool padded = false) {
    const std::int64_t T = ulysses_seq_len;
    for (std::int64_t i = 0; i < rows * T; ++i) {
      tokens.push_back(static_cast<std::int32_t>((i * 7 + step * 13 + 1) % vocab));
      const bool ignored = padded && i % T >= T - ulysses_padding;
      targets.push_back(ignored ? -1 : static_cast<std::int32_t>((i * 11 + step * 5 + 3) % vocab));
    }
  }
  /// The first row of dp rank d's micro-batch m (micro-steps and dp ranks interleaved).
  static std::int64_t first_row(int m, int d, int dp) { return (m * dp + d) * micro_rows; }
};

/// One process on the whole global batch of global_rows sequences: `steps` steps, each clipping
/// the gradient's global norm to `clip` (tp_test_util.hpp) and then calling update(u, values,
/// grads) per unit; the whole tensors. The parameters are initialised from seed, and dropout,
/// where the model has it, draws the masks of the engines' placed rows (optimizer step s, seed).
template <class M, class Update>
LogicalValues sequence_reference(M& model, std::uint64_t seed, std::int64_t global_rows, int steps,
                                 std::int64_t vocab, bool padded, Update&& update) {
  nn::LocalParameters<M> params(model, seed);
  Arena<> arena(64 << 20);
  for (int step = 0; step < steps; ++step) {
    params.zero_grads();
    const SequenceBatch b(global_rows, step, vocab, padded);
    nn::StepContext<double> ctx;
    ctx.arena = &arena;
    ctx.tokens = b.tokens.data();
    ctx.targets = b.targets.data();
    ctx.batch = global_rows;
    ctx.seq_len = ulysses_seq_len;
    ctx.step = static_cast<std::uint64_t>(step);
    ctx.seed = seed;
    ctx.first_row = 0;
    model.forward(ctx);
    model.backward(ctx);
    arena.reset();
    double sq = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      for (double g : params.unit_grads(u)) sq += g * g;
    }
    const double coefficient = optim::clip_coefficient(std::sqrt(sq), clip);
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u);
      for (double& x : g) x *= coefficient;
      update(u, params.unit_values(u).span(), std::span<const double>(g.span()));
    }
  }
  return values_of(params, model.num_units());
}

/// How a rank is fed: its dp rank of dp, and the sp rank of sp whose positions it gets.
struct SequenceFeed {
  int dp_rank = 0, dp = 1, fed_rank = 0, sp = 1;
  bool padded = false;  // SequenceBatch's padded targets
  bool placed = false;  // the micro-batches give first_row (dropout masks follow the rows)
};

/// A step's micro-batches as f feeds a rank: their token and target slices, and the
/// MicroBatches that point at them (valid while this object lives; not copyable).
struct SequenceMicroBatches {
  std::vector<std::vector<std::int32_t>> tokens, targets;
  std::vector<engine::MicroBatch> batches;

  SequenceMicroBatches(const SequenceFeed& f, int step, int accumulation, std::int64_t vocab) {
    const std::int64_t T = ulysses_seq_len;
    const SequenceBatch b(micro_rows * accumulation * f.dp, step, vocab, f.padded);
    for (int m = 0; m < accumulation; ++m) {
      const std::int64_t row = SequenceBatch::first_row(m, f.dp_rank, f.dp);
      const auto n = static_cast<std::size_t>(micro_rows * T);
      const auto at = static_cast<std::size_t>(row * T);
      tokens.push_back(parallel::sequence_slice<std::int32_t>(std::span(b.tokens).subspan(at, n),
                                                              micro_rows, T, f.sp, f.fed_rank));
      targets.push_back(parallel::sequence_slice<std::int32_t>(std::span(b.targets).subspan(at, n),
                                                               micro_rows, T, f.sp, f.fed_rank));
      engine::MicroBatch micro{tokens.back().data(), targets.back().data(), micro_rows, T / f.sp};
      if (f.placed) micro.first_row = row;
      batches.push_back(micro);
    }
  }
  SequenceMicroBatches(const SequenceMicroBatches&) = delete;
  SequenceMicroBatches& operator=(const SequenceMicroBatches&) = delete;
};

/// Trains steps [first, last), `accumulation` micro-steps each, on eng as f feeds it.
template <class Eng>
void train_sequences(Eng& eng, const SequenceFeed& f, int first, int last, int accumulation,
                     std::int64_t vocab) {
  for (int step = first; step < last; ++step) {
    const SequenceMicroBatches micro(f, step, accumulation, vocab);
    for (const engine::MicroBatch& b : micro.batches) {
      eng.forward(b);
      eng.backward();
      eng.step();
    }
  }
}

/// The whole tensors of a layout's run, and the largest disagreement between ranks' copies.
struct LayoutRun {
  LogicalValues values;
  double copies_differ = 0;
};

/// Runs rank_fn(world, stage) (stage a std::integral_constant, for the engine's template
/// argument) on `ranks` LocalComm ranks and assembles their parameters.
template <class RankFn>
LayoutRun run_layout(int ranks, int stage, RankFn&& rank_fn) {
  const auto held =
      testing::per_rank<std::vector<HeldParam>>(ranks, [&](parallel::LocalComm& world) {
        return with_stage(stage, [&](auto s) { return rank_fn(world, s); });
      });
  LayoutRun r;
  r.values = assemble(held, &r.copies_differ);
  return r;
}

}  // namespace zero::test
