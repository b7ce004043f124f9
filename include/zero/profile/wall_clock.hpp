#pragma once
// WallClockBreakdown: where the time of the last steps went (DeepSpeed's wall_clock_breakdown):
// forward, backward and optimizer step, and inside them the time spent waiting for gradient
// reductions and parameter gathers, i.e. communication that did not hide behind compute. The
// overlap fraction is 1 - waited / communication time, with the communication time the
// CommLogger's time in flight in the same window (the union of the collectives'
// issue-to-completion intervals; n/a without a logger): 1 means every collective finished
// behind compute, 0 that the engine waited for all of it.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include <zero/profile/step_timers.hpp>

namespace zero::profile {

/// Mean time per optimizer step over a window of steps.
struct WallClockBreakdown {
  std::int64_t steps = 0;                            ///< steps in the window
  double forward_s = 0, backward_s = 0, step_s = 0;  ///< per step
  double reduction_wait_s = 0, gather_wait_s = 0;    ///< per step, inside the above
  std::optional<double> comm_s;                      ///< per step, from the CommLogger

  /// The window's timers (accumulated over steps optimizer steps) and, when a logger recorded
  /// the window, its communication seconds.
  static WallClockBreakdown of(const StepTimers& t, std::int64_t steps,
                               std::optional<double> comm_seconds = std::nullopt) {
    WallClockBreakdown b;
    b.steps = std::max<std::int64_t>(1, steps);
    const double n = static_cast<double>(b.steps);
    b.forward_s = t.seconds(Phase::forward) / n;
    b.backward_s = t.seconds(Phase::backward) / n;
    b.step_s = t.seconds(Phase::step) / n;
    b.reduction_wait_s = t.seconds(Phase::reduction_wait) / n;
    b.gather_wait_s = t.seconds(Phase::gather_wait) / n;
    if (comm_seconds) b.comm_s = *comm_seconds / n;
    return b;
  }

  /// Fraction of the communication time that was hidden behind compute, in [0, 1].
  std::optional<double> overlap() const {
    if (!comm_s || *comm_s <= 0) return std::nullopt;
    return std::clamp(1.0 - (reduction_wait_s + gather_wait_s) / *comm_s, 0.0, 1.0);
  }

  /// One line: "time (ms) per step | forward: ... | overlap: 87.5%".
  std::string text() const {
    char buf[320];
    char overlap_text[32] = "n/a", comm_text[32] = "n/a";
    if (const auto o = overlap())
      std::snprintf(overlap_text, sizeof overlap_text, "%.1f%%", 100.0 * *o);
    if (comm_s) std::snprintf(comm_text, sizeof comm_text, "%.2f", *comm_s * 1e3);
    std::snprintf(buf, sizeof buf,
                  "time (ms) per step | forward: %.2f | backward: %.2f | reduction wait: %.2f | "
                  "gather wait: %.2f | optimizer step: %.2f | comm: %s | overlap: %s",
                  forward_s * 1e3, backward_s * 1e3, reduction_wait_s * 1e3, gather_wait_s * 1e3,
                  step_s * 1e3, comm_text, overlap_text);
    return buf;
  }

  /// The breakdown as JSON (milliseconds per step; overlap null when unknown).
  nlohmann::json to_json() const {
    const auto o = overlap();
    return {{"forward_ms", forward_s * 1e3},
            {"backward_ms", backward_s * 1e3},
            {"reduction_wait_ms", reduction_wait_s * 1e3},
            {"gather_wait_ms", gather_wait_s * 1e3},
            {"optimizer_step_ms", step_s * 1e3},
            {"comm_ms", comm_s ? nlohmann::json(*comm_s * 1e3) : nlohmann::json(nullptr)},
            {"overlap", o ? nlohmann::json(*o) : nlohmann::json(nullptr)}};
  }
};

}  // namespace zero::profile
