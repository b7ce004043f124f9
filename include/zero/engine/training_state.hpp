#pragma once
// TrainingState: the engine's own checkpointable state besides the master slices and optimizer
// states: step counters, the learning rate, the LR scheduler and the fp16 loss scaler, and their
// JSON form in a checkpoint's index ("zero-engine-1"). The engine advances it; checkpoints save
// and restore it through EngineState.

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include <optim/loss_scaler.hpp>
#include <optim/lr_schedule.hpp>
#include <zero/core/error.hpp>

namespace zero::engine {

/// Counters, learning rate, scheduler and loss scaler of an engine.
struct TrainingState {
  std::int64_t steps = 0;            ///< optimizer steps applied
  std::int64_t skipped_steps = 0;    ///< boundaries whose update was skipped
  std::int64_t nonfinite_steps = 0;  ///< boundaries with an Inf/NaN loss or gradient norm
  double lr = 0.0;                   ///< learning rate of the last update
  std::optional<optim::LrScheduler> scheduler;
  std::optional<optim::LossScaler> scaler;  ///< Precision<f16> only

  /// Boundaries reached so far (applied or skipped).
  std::int64_t boundaries() const { return steps + skipped_steps; }
  /// The fp16 loss scale, 1 without a scaler.
  double loss_scale() const { return scaler ? scaler->scale() : 1.0; }

  /// Writes the counters, scheduler and scaler into j.
  void save(nlohmann::json& j) const {
    j["steps"] = steps;
    j["skipped_steps"] = skipped_steps;
    j["nonfinite_steps"] = nonfinite_steps;
    j["lr"] = lr;
    if (scheduler) j["scheduler"] = {{"last_batch_iteration", scheduler->last_batch_iteration()}};
    if (scaler) {
      const optim::StateDict d = scaler->state_dict();
      j["loss_scaler"] = {{"counters", d.counters}, {"scalars", d.scalars}};
    }
  }
  /// Restores what save wrote (nlohmann::json exceptions for missing keys; the caller names
  /// the checkpoint).
  void load(const nlohmann::json& j) {
    steps = j.at("steps").get<std::int64_t>();
    skipped_steps = j.at("skipped_steps").get<std::int64_t>();
    nonfinite_steps = j.at("nonfinite_steps").get<std::int64_t>();
    lr = j.value("lr", 0.0);
    if (scheduler && j.contains("scheduler")) {
      scheduler->step(j["scheduler"].at("last_batch_iteration").get<std::int64_t>());
    }
    if (scaler) {
      expect<CheckpointError>(j.contains("loss_scaler"),
                              "checkpoint: no loss scaler state (saved without fp16)");
      optim::StateDict d;
      d.counters = j["loss_scaler"].at("counters").get<decltype(d.counters)>();
      d.scalars = j["loss_scaler"].at("scalars").get<decltype(d.scalars)>();
      scaler->load_state_dict(d);
    }
  }
};

}  // namespace zero::engine
