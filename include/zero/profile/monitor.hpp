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
// for the program's metrics file. In a pipeline each stage runs its own units, so rank 0's
// figures are stage 0's alone: collect_stages (with parallel::all_gather_text over the
// pipeline group) makes every report a collective over the stages, which rank 0 prints stage by
// stage and the JSON carries as "<report>_stages" arrays beside its own.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
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
  /// Gathers one string from every pipeline stage, stage by stage (a collective over the
  /// pipeline group: parallel::all_gather_text).
  using StageGather = std::function<std::vector<std::string>(const std::string&)>;

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

  /// In a pipeline: every report is gathered from all stages through gather (every rank of the
  /// pipeline group calls end_step and finish, as without it); rank 0 prints each stage's.
  void collect_stages(StageGather gather) { stages_ = std::move(gather); }

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
  /// ("flops_profile", "wall_clock", "memory"; with collect_stages also "flops_profile_stages",
  /// "wall_clock_stages", "memory_stages", arrays by stage; empty when nothing is due).
  template <class Engine, class Model>
  nlohmann::json end_step(Engine& engine, const Model& model, std::int64_t step) {
    nlohmann::json due = nlohmann::json::object();
    // The step's communication ends with it (the reports' own gathers below are not in it).
    if (logger_) window_comm_s_ += logger_->seconds_in_flight() - step_comm_start_s_;
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
      const Report r = report("flops_profile", p.to_json(), p.report(cfg_.flops_profiler), due);
      if (rank_ == 0) write_profile(r, p.step);
    }
    ++window_steps_;
    const bool print = step % cfg_.steps_per_print == 0;
    if (cfg_.wall_clock_breakdown && print) {
      const WallClockBreakdown b =
          WallClockBreakdown::of(engine.timers().since(window_start_), window_steps_,
                                 logger_ ? std::optional<double>(window_comm_s_) : std::nullopt);
      print_report(report("wall_clock", b.to_json(), b.text(), due));
    }
    if (print) window_steps_ = 0;
    if (cfg_.memory_breakdown && print) {
      // The estimate of what memory_report counts: the model states at rest, on the device and
      // offloaded to host memory alike.
      const auto e = engine.memory_estimate();
      const MemoryBreakdown m = memory_breakdown(engine, e.device_at_rest + e.host);
      print_report(report("memory", m.to_json(), m.text(), due));
    }
    if (rank_ == 0 && !due.empty()) std::fflush(stdout);
    return due;
  }

  /// Call at the end of the run: prints the comms summary (rank 0) when comms_logger is on.
  void finish() {
    if (!cfg_.comms_logger.enabled || !logger_) return;
    const std::string summary = logger_->log_summary();
    if (!stages_) {
      if (rank_ == 0) std::printf("Communication summary (rank 0):\n%s", summary.c_str());
    } else {
      const std::vector<std::string> all = stages_(summary);
      for (std::size_t k = 0; rank_ == 0 && k < all.size(); ++k) {
        std::printf("Communication summary (pipeline stage %zu, with rank 0's coordinates):\n%s", k,
                    all[k].c_str());
      }
    }
    if (rank_ == 0) std::fflush(stdout);
  }

 private:
  // A report as text: this rank's alone, or every stage's headed by its index.
  struct Report {
    std::vector<std::string> texts;     // one per stage (this rank's alone without stages)
    std::vector<nlohmann::json> jsons;  // the same reports as JSON
    bool staged = false;                // gathered over the pipeline's stages
  };
  // This rank's report (json, text), whose JSON goes into due[name]; with collect_stages every
  // stage's too, whose JSON goes into due[name + "_stages"].
  Report report(const std::string& name, nlohmann::json json, const std::string& text,
                nlohmann::json& due) const {
    due[name] = json;
    if (!stages_) return {{text}, {std::move(json)}, false};
    // One gather of both: the JSON's dump has no raw control character, the separator's.
    const std::vector<std::string> both = stages_(json.dump() + '\x1f' + text);
    Report r{{}, {}, true};
    for (const std::string& b : both) {
      const std::size_t cut = b.find('\x1f');
      expect<Error>(cut != std::string::npos, "Monitor: a stage's ", name, " report is malformed");
      r.jsons.push_back(nlohmann::json::parse(b.substr(0, cut)));
      r.texts.push_back(b.substr(cut + 1));
    }
    due[name + "_stages"] = r.jsons;
    return r;
  }
  // Rank 0 prints a one-line report (each stage's, headed, in a pipeline).
  void print_report(const Report& r) const {
    if (rank_ != 0) return;
    if (!r.staged) {
      std::printf("%s\n", r.texts.front().c_str());
      return;
    }
    for (std::size_t k = 0; k < r.texts.size(); ++k) {
      std::printf("pipeline stage %zu | %s\n", k, r.texts[k].c_str());
    }
  }

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

  // The flops profile of step `step`: this rank's, or every stage's (text: each headed by its
  // stage; a .json file: the array of the stages' profiles).
  void write_profile(const Report& r, std::int64_t step) const {
    const std::string& file = cfg_.flops_profiler.output_file;
    const bool json = file.size() >= 5 && file.compare(file.size() - 5, 5, ".json") == 0;
    std::string text;
    if (json) {
      text = (r.staged ? nlohmann::json(r.jsons) : r.jsons.front()).dump(2) + "\n";
    } else if (!r.staged) {
      text = r.texts.front();
    } else {
      for (std::size_t k = 0; k < r.texts.size(); ++k) {
        text += "pipeline stage " + std::to_string(k) + " of " + std::to_string(r.texts.size()) +
                ":\n" + r.texts[k];
      }
    }
    if (file.empty()) {
      std::printf("%s", text.c_str());
      return;
    }
    std::ofstream out(file);
    expect<IoError>(out.good(), "flops_profiler.output_file: cannot write '", file, "'");
    out << text;
    std::printf("flops profile of step %lld written to %s\n", static_cast<long long>(step),
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
  StageGather stages_;  // set in a pipeline (collect_stages)
};

}  // namespace zero::profile
