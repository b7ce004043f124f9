#pragma once
// Monitor: switches on and prints zero::profile's reports as a DeepSpeed config asks, so a
// training loop needs three calls (begin_step, end_step, finish):
//   flops_profiler        the FlopsProfile of step profile_step, once (text, or JSON when
//                         output_file ends in .json; standard output when it is empty);
//   wall_clock_breakdown  the WallClockBreakdown every steps_per_print steps;
//   memory_breakdown      the MemoryBreakdown every steps_per_print steps;
//   comms_logger          a CommLogger to install on the communicators before building the
//                         engine, and its log_summary at finish (verbose: a line per op).
// Rank 0 prints; every rank measures. end_step returns the figures due at that step as JSON,
// for the program's metrics file.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <parallel/comm/comm_logger.hpp>
#include <zero/config/config.hpp>
#include <zero/core/error.hpp>
#include <zero/profile/flops_profile.hpp>
#include <zero/profile/memory_breakdown.hpp>
#include <zero/profile/step_timers.hpp>
#include <zero/profile/wall_clock.hpp>

namespace zero::profile {

/// Drives the observability sections of a config (see the file comment).
class Monitor {
 public:
  /// For rank (rank 0 prints) of a run whose micro-batches have batch_per_rank rows.
  Monitor(const Config& cfg, int rank, std::int64_t batch_per_rank)
      : cfg_(cfg), rank_(rank), batch_per_rank_(batch_per_rank) {
    if (cfg_.comms_logger.enabled || cfg_.wall_clock_breakdown) {
      logger_ = std::make_shared<parallel::CommLogger>();
      if (cfg_.comms_logger.enabled && !cfg_.comms_logger.prof_all) {
        std::vector<parallel::CommOp> ops;
        for (const auto& name : cfg_.comms_logger.prof_ops) {
          ops.push_back(parallel::comm_op_named(name));
        }
        logger_->record_only(std::move(ops));
      }
      if (cfg_.comms_logger.enabled && cfg_.comms_logger.verbose && rank_ == 0) {
        logger_->set_verbose(
            [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
      }
    }
  }

  /// The logger to install on the communicators (set_logger), or null when nothing needs one.
  std::shared_ptr<parallel::CommLogger> logger() const { return logger_; }

  /// Call before optimizer step `step` (1-based) begins: switches the engine's timers on when
  /// this step is profiled or the breakdown is on. The first step of a breakdown window starts
  /// its count here, so what ran between windows (the engine's construction, a checkpoint's
  /// load, an evaluation) is not in it.
  template <class Engine>
  void begin_step(Engine& engine, std::int64_t step) {
    const bool profiled = cfg_.flops_profiler.profiles(step);
    engine.timers().enable(profiled || cfg_.wall_clock_breakdown);
    if (profiled) before_profile_ = engine.timers();
    if (window_steps_ == 0) {
      window_start_ = engine.timers();
      window_comm_s_ = 0;
    }
    // The window's communication is what the steps themselves log: a checkpoint's agreement or
    // an evaluation between two steps of a window is not in it, as the timers do not count it.
    step_comm_start_s_ = logger_ ? logger_->seconds_in_flight() : 0.0;
  }

  /// Call after optimizer step `step` ended: prints (rank 0) what is due and returns it as JSON
  /// ("flops_profile", "wall_clock", "memory"; empty when nothing is due).
  template <class Engine, class Model>
  nlohmann::json end_step(Engine& engine, const Model& model, std::int64_t step) {
    nlohmann::json due = nlohmann::json::object();
    if (cfg_.flops_profiler.profiles(step)) {
      StepTimers only_this = engine.timers().since(before_profile_);
      int mp_size = 1;       // the tensor-parallel group, where the engine has one
      int sample_ranks = 0;  // Ulysses' sp ranks share their samples
      if constexpr (requires { engine.groups().tp_size(); }) {
        mp_size = engine.groups().tp_size();
        sample_ranks = engine.groups().sample_ranks;
      }
      FlopsProfile p = collect_flops_profile(only_this_engine(engine, only_this), model, step,
                                             batch_per_rank_, mp_size, sample_ranks);
      due["flops_profile"] = p.to_json();
      if (rank_ == 0) write_profile(p);
    }
    ++window_steps_;
    if (logger_) window_comm_s_ += logger_->seconds_in_flight() - step_comm_start_s_;
    const bool print = step % cfg_.steps_per_print == 0;
    if (cfg_.wall_clock_breakdown && print) {
      const WallClockBreakdown b =
          WallClockBreakdown::of(engine.timers().since(window_start_), window_steps_,
                                 logger_ ? std::optional<double>(window_comm_s_) : std::nullopt);
      due["wall_clock"] = b.to_json();
      if (rank_ == 0) std::printf("%s\n", b.text().c_str());
    }
    if (print) window_steps_ = 0;
    if (cfg_.memory_breakdown && print) {
      // The estimate of what memory_report counts: the model states at rest, on the device and
      // offloaded to host memory alike.
      const auto e = engine.memory_estimate();
      const MemoryBreakdown m = memory_breakdown(engine, e.device_at_rest + e.host);
      due["memory"] = m.to_json();
      if (rank_ == 0) std::printf("%s\n", m.text().c_str());
    }
    if (rank_ == 0 && !due.empty()) std::fflush(stdout);
    return due;
  }

  /// Call at the end of the run: prints the comms summary (rank 0) when comms_logger is on.
  void finish() {
    if (cfg_.comms_logger.enabled && logger_ && rank_ == 0) {
      std::printf("Communication summary (rank 0):\n%s", logger_->log_summary().c_str());
      std::fflush(stdout);
    }
  }

 private:
  // The engine's queries with other timers: what collect_flops_profile reads.
  template <class Engine>
  struct EngineWithTimers {
    const Engine& engine;
    const StepTimers& t;
    const StepTimers& timers() const { return t; }
    int world_size() const { return engine.world_size(); }
    int num_units() const { return engine.num_units(); }
    const auto& unit_specs(int u) const { return engine.unit_specs(u); }
  };
  template <class Engine>
  static EngineWithTimers<Engine> only_this_engine(const Engine& e, const StepTimers& t) {
    return {e, t};
  }

  void write_profile(const FlopsProfile& p) const {
    const std::string& file = cfg_.flops_profiler.output_file;
    const bool json = file.size() >= 5 && file.compare(file.size() - 5, 5, ".json") == 0;
    const std::string text = json ? p.to_json().dump(2) + "\n" : p.report(cfg_.flops_profiler);
    if (file.empty()) {
      std::printf("%s", text.c_str());
      return;
    }
    std::ofstream out(file);
    expect<IoError>(out.good(), "flops_profiler.output_file: cannot write '", file, "'");
    out << text;
    std::printf("flops profile of step %lld written to %s\n", static_cast<long long>(p.step),
                file.c_str());
  }

  Config cfg_;
  int rank_;
  std::int64_t batch_per_rank_;
  std::shared_ptr<parallel::CommLogger> logger_;
  StepTimers before_profile_, window_start_;
  double window_comm_s_ = 0;      // the communication the window's steps logged
  double step_comm_start_s_ = 0;  // the logger's total when this step began
  std::int64_t window_steps_ = 0;
};

}  // namespace zero::profile
