#pragma once
// Shared by the LocalComm and MPI engine tests: the tiny GPT, the global batches, and the
// single-process references the engine must equal (f64 SGD with optional global-norm clipping;
// f32 AdamW with DeepSpeed's no-decay groups).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <optim/adam.hpp>
#include <optim/grad_norm.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/worse.hpp"

namespace zero::test {

inline constexpr std::int64_t seq = 6;
inline constexpr std::int64_t micro_rows = 2;

/// fn(std::integral_constant<int, S>{}) for S = stage (0-3): a layout's run-time stage to the
/// engine's template argument.
template <class Fn>
decltype(auto) with_stage(int stage, Fn&& fn) {
  switch (stage) {
    case 0:
      return fn(std::integral_constant<int, 0>{});
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    default:
      return fn(std::integral_constant<int, 3>{});
  }
}

inline nn::GPTConfig tiny() {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");
  c.num_layers = 2;
  return c;
}

// Rows of the global batch of a step: tokens and targets [rows, seq], every target valid.
struct GlobalBatch {
  std::vector<std::int32_t> tokens, targets;
  GlobalBatch(std::int64_t rows, int step, std::int64_t vocab) {
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      tokens.push_back(static_cast<std::int32_t>((i * 7 + step * 13 + 1) % vocab));
      targets.push_back(static_cast<std::int32_t>((i * 11 + step * 5 + 3) % vocab));
    }
  }
  // Rank's micro-batch m: any fixed split of the rows works; this one interleaves micro-steps
  // and ranks. placed: the micro-batch says where its rows sit (MicroBatch::first_row), so its
  // dropout masks follow them.
  engine::MicroBatch micro(int m, int rank, int world, bool placed = false) const {
    const std::int64_t first = (m * world + rank) * micro_rows;
    engine::MicroBatch b{tokens.data() + first * seq, targets.data() + first * seq, micro_rows,
                         seq};
    if (placed) b.first_row = first;
    return b;
  }
};

// A rank's micro-batches of a step: micro-batch i < m of its data rank of data_ranks, and of them
// its T/sp positions under Ulysses (slices holds them; the batches are valid while it lives).
inline std::vector<engine::MicroBatch> rank_batches(const GlobalBatch& b, int data_rank,
                                                    int data_ranks, int m,
                                                    const parallel::SequenceParallel& sp,
                                                    std::vector<parallel::SequenceSlice>& slices) {
  std::vector<engine::MicroBatch> out;
  slices.clear();
  slices.reserve(static_cast<std::size_t>(m));
  for (int i = 0; i < m; ++i) {
    const engine::MicroBatch whole = b.micro(i, data_rank, data_ranks);
    if (!sp.active()) {
      out.push_back(whole);
      continue;
    }
    const auto& mine =
        slices.emplace_back(whole.tokens, whole.targets, whole.batch, whole.seq_len, sp);
    out.push_back({mine.tokens.data(), mine.targets.data(), mine.batch, mine.seq_len});
  }
  return out;
}

template <class T>
void sgd(double lr, std::span<T> p, std::span<const T> g) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= static_cast<T>(lr * g[i]);
}

// One process on the whole global batch for `steps` steps; per step: global gradient norm,
// clip coefficient, then update(unit, values, grads, specs, coefficient). Returns each unit's
// values. The model is tiny() unless cfg says otherwise; with its dropout on, step s draws the
// masks an engine (EngineOptions' default seed) draws at optimizer step s for placed rows.
template <class T, class Update>
std::vector<std::vector<T>> reference_run(std::int64_t global_rows, int steps, double clip,
                                          Update update, const nn::GPTConfig& cfg = tiny()) {
  nn::GPT<T> model(cfg);
  nn::LocalParameters<nn::GPT<T>> params(model, 1234);
  Arena<> arena(64 << 20);
  for (int step = 0; step < steps; ++step) {
    params.zero_grads();
    const GlobalBatch b(global_rows, step, cfg.vocab_size);
    nn::StepContext<T> ctx;
    ctx.arena = &arena;
    ctx.tokens = b.tokens.data();
    ctx.targets = b.targets.data();
    ctx.batch = global_rows;
    ctx.seq_len = seq;
    ctx.step = static_cast<std::uint64_t>(step);
    ctx.seed = engine::EngineOptions{}.seed;
    ctx.first_row = 0;
    model.forward(ctx);
    model.backward(ctx);
    arena.reset();
    double sq = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      for (T g : params.unit_grads(u)) sq += static_cast<double>(g) * static_cast<double>(g);
    }
    const double coefficient = optim::clip_coefficient(std::sqrt(sq), clip);
    for (int u = 0; u < model.num_units(); ++u) {
      update(u, params.unit_values(u).span(), params.unit_grads(u).span(), params.unit_specs(u),
             coefficient);
    }
  }
  std::vector<std::vector<T>> out;
  for (int u = 0; u < model.num_units(); ++u) {
    const auto v = params.unit_values(u);
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

// f64 SGD reference with lr and clipping.
inline std::vector<std::vector<double>> reference_sgd(std::int64_t global_rows, int steps,
                                                      double lr, double clip = 0.0,
                                                      const nn::GPTConfig& cfg = tiny()) {
  return reference_run<double>(
      global_rows, steps, clip,
      [&](int, std::span<double> p, std::span<double> g, const std::vector<nn::ParamSpec>&,
          double coefficient) { sgd<double>(lr * coefficient, p, g); },
      cfg);
}

// f32 AdamW reference: one AdamW per unit over its whole (unpadded) buffer, no weight decay on
// parameters flagged so, the fused pass scaling gradients by the clip coefficient.
inline std::vector<std::vector<float>> reference_adamw(std::int64_t global_rows, int steps,
                                                       const optim::AdamHyper& hyper, double clip) {
  std::vector<optim::AdamW> opts;
  return reference_run<float>(
      global_rows, steps, clip,
      [&](int u, std::span<float> p, std::span<float> g, const std::vector<nn::ParamSpec>& specs,
          double coefficient) {
        if (opts.size() <= static_cast<std::size_t>(u)) {
          std::vector<std::uint8_t> mask;
          for (const auto& s : specs)
            mask.insert(mask.end(), static_cast<std::size_t>(s.numel()), s.weight_decay ? 0 : 1);
          optim::AdamHyper nd = hyper;
          nd.weight_decay = 0;
          opts.emplace_back(
              p.size(), optim::groups_from_mask(std::span<const std::uint8_t>(mask), hyper, nd));
        }
        opts[static_cast<std::size_t>(u)].step(optim::FusedIo::over(p, std::span<const float>(g))
                                                   .scale_grad(static_cast<float>(coefficient)));
      });
}

// The DeepSpeed config of the AdamW runs.
// Stage 3 gathers every unit per use (persistence threshold 0) unless a test changes it.
inline Config adamw_config(int stage, int accumulation, double clip) {
  Config c = Config::from_json_string(R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )" +
                                      std::to_string(accumulation) + R"(,
    "gradient_clipping": )" + std::to_string(clip) +
                                      R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95],
                  "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": )" +
                                      std::to_string(stage) +
                                      R"(, "stage3_param_persistence_threshold": 0}})");
  return c;
}
inline optim::AdamHyper adamw_hyper() {
  optim::AdamHyper h;
  h.lr = 0.001;
  h.beta1 = 0.9;
  h.beta2 = 0.95;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  return h;
}

// Every unit's gathered values, in unit order (collective at stage 3).
template <class Eng>
auto all_unit_values(Eng& eng) {
  std::vector<typename Eng::T> out;
  for (int u = 0; u < eng.num_units(); ++u) {
    const auto v = eng.gather_unit_values(u);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Trains eng on the optimizer steps [first, last) of the GlobalBatch sequence (`accumulation`
// micro-steps each, rows split over comm's ranks), waits for the gathers the last update
// started, and returns every unit's gathered values.
template <class Eng, class Comm>
std::vector<std::vector<float>> train_steps(Eng& eng, Comm& comm, int first, int last,
                                            int accumulation) {
  const int world = comm.size();
  for (int step = first; step < last; ++step) {
    const GlobalBatch b(micro_rows * accumulation * world, step, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, comm.rank(), world));
      eng.backward();
    }
    eng.step();
  }
  eng.synchronize();
  std::vector<std::vector<float>> units;
  for (int u = 0; u < eng.num_units(); ++u) units.push_back(eng.gather_unit_values(u));
  return units;
}

// The engine options of the tiny runs: a 32 MiB activation arena, the rest by default.
inline engine::EngineOptions tiny_options() {
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  return options;
}

// Builds Eng over a tiny nn::GPT<typename Eng::T> on comm from config (and options), trains
// `steps` optimizer steps of `accumulation` micro-steps each on the GlobalBatch rows, waits for
// the gathers the last update started, and returns every unit's gathered values; the engine is
// handed to inspect (say, for memory_report()) before it goes.
template <class Eng, class Comm, class Inspect>
std::vector<std::vector<float>> train_tiny_gpt(
    Comm& comm, const Config& config, int steps, int accumulation, Inspect&& inspect,
    const engine::EngineOptions& options = tiny_options()) {
  nn::GPT<typename Eng::T> model(tiny());
  Eng eng(model, comm, config, options);
  auto units = train_steps(eng, comm, 0, steps, accumulation);
  inspect(eng);
  return units;
}

// Where a run of train_delayed applies each step's update.
enum class Delay {
  engine,    ///< EngineOptions::delayed_param_update (an Offload<CPU> engine)
  callback,  ///< in step(), through a callback that applies each step's gradient one step late
  none,      ///< in step(), each step's own gradient
};
struct DelayedRun {
  std::vector<float> losses;  // every micro-step's
  std::vector<std::vector<float>> units;
  int in_flight_after_step = 0, in_flight_after_read = 0;
  int kept_units = 0;  // units the engine keeps on the device (offload_ratio)
  engine::MemoryReport report;
  engine::MemoryEstimate estimate;
};

// Trains `steps` steps of SGD (lr 0.05, clipping 0.5, `accumulation` micro-steps) through an
// update callback on a tiny GPT, the update applied as `delay` says; the units' values after
// synchronize(). The delayed update follows P_t+1 = update(P_t, grad(P_t-1)); the callback
// delaying each gradient by one step follows the same recurrence one step behind, so window k of
// both runs at the same parameters, and `steps` delayed steps end where `steps` + 1 of the
// callback's do. sync_mid_window calls synchronize() after each window's first micro-step (it
// waits for a delayed update in flight, which must not change what the window computes).
// ratio below 1: the delayed engine keeps its last units on the device (offload_ratio), and
// those are not delayed; the callback delays only the units the same rule offloads
// (units_kept_on_device), and its last step leaves the kept ones as they are, so that it still
// ends where the delayed run does. sgd_step moves a slice that is not held back (a GPU engine's
// units kept on the device hand the callback device memory: its test passes a step that reads
// it there).
inline void host_sgd_step(std::span<float> param, std::span<const float> grad, float lr) {
  for (std::size_t i = 0; i < param.size(); ++i) param[i] -= lr * grad[i];
}
template <class Eng, class Comm, class SgdStep = decltype(&host_sgd_step)>
DelayedRun train_delayed(Comm& comm, Delay delay, int steps, int accumulation,
                         bool sync_mid_window = false, double ratio = 1.0,
                         SgdStep sgd_step = &host_sgd_step) {
  constexpr float lr = 0.05F;
  engine::EngineOptions options = tiny_options();
  options.gradient_accumulation_steps = accumulation;
  options.gradient_clipping = 0.5;
  options.delayed_param_update = delay == Delay::engine;
  if (delay == Delay::engine) options.offload_ratio = ratio;
  options.persistence_threshold = 0;     // stage 3 gathers every unit in every micro-step
  std::vector<std::vector<float>> held;  // Delay::callback: each unit's last gradient
  std::vector<bool> kept;                // Delay::callback: the units it does not delay
  bool last_step = false;
  auto sgd = [&](int u, std::span<float> param, std::span<const float> grad) {
    const bool on_time = !kept.empty() && kept[static_cast<std::size_t>(u)];
    if (delay != Delay::callback || on_time) {
      if (last_step && on_time) return;
      sgd_step(param, grad, lr);
      return;
    }
    if (held.size() <= static_cast<std::size_t>(u)) held.resize(static_cast<std::size_t>(u) + 1);
    std::vector<float>& last = held[static_cast<std::size_t>(u)];
    for (std::size_t i = 0; i < last.size(); ++i) param[i] -= lr * last[i];
    last.assign(grad.begin(), grad.end());
  };
  nn::GPT<typename Eng::T> model(tiny());
  Eng eng(model, comm, sgd, options);
  if (delay == Delay::callback && ratio < 1.0) {
    std::vector<std::int64_t> shards;
    for (int u = 0; u < eng.num_units(); ++u) shards.push_back(eng.partition(u).shard_numel());
    kept = engine::units_kept_on_device(shards, ratio);
  }
  DelayedRun out;
  for (int u = 0; u < eng.num_units(); ++u) out.kept_units += eng.unit_offloaded(u) ? 0 : 1;
  const int world = comm.size();
  const auto in_flight = [&] { return eng.update_in_flight() ? 1 : 0; };
  for (int step = 0; step < steps; ++step) {
    last_step = step + 1 == steps;
    const GlobalBatch b(micro_rows * accumulation * world, step, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      out.losses.push_back(static_cast<float>(eng.forward(b.micro(m, comm.rank(), world))));
      eng.backward();
      if (sync_mid_window && m == 0) eng.synchronize();
    }
    eng.step();
    out.in_flight_after_step += in_flight();
  }
  out.report = eng.memory_report();
  out.estimate = eng.memory_estimate();
  eng.synchronize();
  out.in_flight_after_read = in_flight();
  for (int u = 0; u < eng.num_units(); ++u) out.units.push_back(eng.gather_unit_values(u));
  return out;
}

// Trains `steps` steps on this rank and returns the largest difference to want (every rank
// gathers every unit). A run that cannot be compared (step() misplaces the accumulation
// boundary, the engine and want disagree on units or their sizes) throws std::runtime_error
// saying what and where; LocalComm::run rethrows it on the main thread (MpiComm: it leaves the
// CHECK directly), so the failing test prints the reason instead of a bare large error.
template <class Eng, class Comm, class W>
double max_error(Eng& eng, Comm& comm, int accumulation, int steps, const W& want,
                 bool placed = false) {
  const int world = comm.size();
  const std::int64_t global_rows = micro_rows * accumulation * world;
  const std::string where =
      "max_error on rank " + std::to_string(comm.rank()) + " of " + std::to_string(world) + ": ";
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch b(global_rows, step, tiny().vocab_size);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, comm.rank(), world, placed));
      eng.backward();
      const bool boundary = eng.step();
      if (boundary != (m + 1 == accumulation)) {
        throw std::runtime_error(where + "step " + std::to_string(step) + ", micro-step " +
                                 std::to_string(m) + " of " + std::to_string(accumulation) +
                                 ": step() returned " + (boundary ? "true" : "false") +
                                 ", expected the accumulation boundary only at micro-step " +
                                 std::to_string(accumulation - 1));
      }
    }
  }
  if (static_cast<std::size_t>(eng.num_units()) != want.size()) {
    throw std::runtime_error(where + "the engine has " + std::to_string(eng.num_units()) +
                             " units, the reference " + std::to_string(want.size()));
  }
  double w = 0;
  for (int u = 0; u < eng.num_units(); ++u) {
    const auto got = eng.gather_unit_values(u);
    const auto& ref = want[static_cast<std::size_t>(u)];
    if (got.size() != ref.size()) {
      throw std::runtime_error(where + "unit " + std::to_string(u) + " has " +
                               std::to_string(got.size()) + " elements, the reference " +
                               std::to_string(ref.size()));
    }
    for (std::size_t i = 0; i < got.size(); ++i) {
      w = zero::testing::worse(
          w, std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i])));
    }
  }
  return w;
}

// The options of the f64 SGD runs (sgd_error): accumulation, clipping, stage 3 gathering every
// unit one ahead, sharded in groups of shard_size ranks (0: over all), the backward gathering
// inside groups of hpz_size ranks (ZeRO++ hpZ; 0: none).
inline engine::EngineOptions sgd_options(int accumulation, double clip, int shard_size = 0,
                                         int hpz_size = 0) {
  engine::EngineOptions options;
  options.gradient_accumulation_steps = accumulation;
  options.activation_bytes = 32 << 20;
  options.gradient_clipping = clip;
  options.persistence_threshold = 0;
  options.prefetch_elems = 1;  // stage 3: gather one unit ahead
  options.shard_size = shard_size;
  options.hpz_size = hpz_size;
  return options;
}

// Stage S, f64 SGD (lr 1, optional clipping) on comm, against want; the model is cfg (tiny()
// by default), its micro-batches placed or not (GlobalBatch::micro), sharded in groups of
// shard_size ranks (hybrid sharding; 0: over all), with hpZ's secondary groups of hpz_size (0:
// none).
template <int S, class Comm>
double sgd_error(Comm& comm, int accumulation, int steps, double clip,
                 const std::vector<std::vector<double>>& want, const nn::GPTConfig& cfg = tiny(),
                 bool placed = false, int shard_size = 0, int hpz_size = 0) {
  nn::GPT<double> model(cfg);
  engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(
      model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(1.0, p, g); },
      sgd_options(accumulation, clip, shard_size, hpz_size));
  return max_error(eng, comm, accumulation, steps, want, placed);
}

// Stage S, f32 AdamW from a DeepSpeed config on comm, against want.
template <int S, class Comm>
double adamw_error(Comm& comm, int accumulation, int steps, double clip,
                   const std::vector<std::vector<float>>& want) {
  nn::GPT<float> model(tiny());
  engine::EngineOptions options;
  options.activation_bytes = 32 << 20;
  engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(model, comm, adamw_config(S, accumulation, clip),
                                                   options);
  return max_error(eng, comm, accumulation, steps, want);
}

}  // namespace zero::test
