#pragma once
// MemoryBreakdown: what one rank holds, measured: model states by kind (Engine::memory_report),
// the activation arena's high-water mark, bytes swapped out to files (NVMe offload) and the
// process's resident set (Linux /proc/self/status), beside the memory estimator's prediction of
// the model states for the same layout, so a user sees whether the formulas hold.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include <zero/engine/memory_report.hpp>

namespace zero::profile {

/// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); empty where unreadable.
inline std::optional<std::size_t> process_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == field + ":") {
      std::size_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
    std::getline(in, key);
  }
  return std::nullopt;
}

/// One rank's memory (see the file comment).
struct MemoryBreakdown {
  engine::MemoryReport states;                           ///< model states by kind
  std::size_t activation_peak_bytes = 0;                 ///< the activation arena's high-water mark
  std::optional<std::size_t> rss_bytes, rss_peak_bytes;  ///< process resident set (now, peak)
  std::optional<double> estimate_bytes;  ///< the estimator's model states in memory, if given

  /// Swapped out to files (NVMe offload).
  std::size_t swap_bytes() const { return states.offloaded_bytes; }

  /// One line in MB (1e6 bytes).
  std::string text() const {
    auto mb = [](double b) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f", b / 1e6);
      return std::string(buf);
    };
    auto mbz = [&](std::size_t b) { return mb(static_cast<double>(b)); };
    std::string s =
        "memory (MB) | model states " + mbz(states.total()) + " (master " +
        mbz(states.master_bytes) + ", optimizer " + mbz(states.optimizer_bytes) +
        ", grad accumulators " + mbz(states.grad_accumulator_bytes) + ", whole params " +
        mbz(states.whole_param_bytes) + ", whole grads " + mbz(states.whole_grad_bytes) +
        (states.secondary_param_bytes > 0
             ? ", hpZ secondary params " + mbz(states.secondary_param_bytes)
             : std::string()) +
        ", scratch " + mbz(states.scratch_bytes) +
        (states.kept_error_bytes > 0 ? ", LoCo kept errors " + mbz(states.kept_error_bytes)
                                     : std::string()) +
        ") | estimate " + (estimate_bytes ? mb(*estimate_bytes) : "n/a") + " | activations peak " +
        mbz(activation_peak_bytes) + " | swap " + mbz(swap_bytes()) + " | RSS " +
        (rss_bytes ? mbz(*rss_bytes) : "n/a") + " (peak " +
        (rss_peak_bytes ? mbz(*rss_peak_bytes) : "n/a") + ")";
    return s;
  }

  /// The breakdown as JSON (bytes).
  nlohmann::json to_json() const {
    auto opt = [](const auto& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
    return {{"model_states", states.total()},
            {"master", states.master_bytes},
            {"optimizer", states.optimizer_bytes},
            {"grad_accumulators", states.grad_accumulator_bytes},
            {"whole_params", states.whole_param_bytes},
            {"whole_grads", states.whole_grad_bytes},
            {"secondary_params", states.secondary_param_bytes},
            {"scratch", states.scratch_bytes},
            {"kept_errors", states.kept_error_bytes},
            {"estimate", opt(estimate_bytes)},
            {"activations_peak", activation_peak_bytes},
            {"swap", swap_bytes()},
            {"rss", opt(rss_bytes)},
            {"rss_peak", opt(rss_peak_bytes)}};
  }
};

/// The breakdown of engine now, with the estimator's figure when given.
template <class Engine>
MemoryBreakdown memory_breakdown(const Engine& engine,
                                 std::optional<double> estimate_bytes = std::nullopt) {
  MemoryBreakdown m;
  m.states = engine.memory_report();
  m.activation_peak_bytes = engine.activation_peak_bytes();
  m.rss_bytes = process_status_bytes("VmRSS");
  m.rss_peak_bytes = process_status_bytes("VmHWM");
  m.estimate_bytes = estimate_bytes;
  return m;
}

}  // namespace zero::profile
