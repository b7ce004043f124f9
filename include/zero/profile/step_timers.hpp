#pragma once
// StepTimers: wall-clock accumulators the engine fills while switched on, for the wall-clock
// breakdown and the flops profiler: time in forward, backward, the optimizer step, and the time
// the engine sat waiting for a gradient reduction or a parameter gather (communication that did
// not hide behind compute), plus each unit's own forward and backward. Off (the default) each
// hook costs one branch; nothing is timed.
//
// Forward, backward and step exclude each other: one opened inside another (the deferred
// optimizer update of overlap_offload_update, applied as the next forward gathers a unit) moves
// its time out of the enclosing one, so their sum stays the wall time. The waits are parts of
// them and stay counted in both.

#include <array>
#include <chrono>
#include <cstddef>
#include <vector>

namespace zero::profile {

/// The phases the engine times.
enum class Phase : unsigned char { forward, backward, reduction_wait, gather_wait, step };
/// Number of phases.
inline constexpr std::size_t phase_count = 5;

/// Accumulated seconds per phase and per unit (see the file comment).
class StepTimers {
 public:
  using Clock = std::chrono::steady_clock;

  /// Adds the time from construction to destruction to one accumulator (or to none).
  class Scope {
   public:
    /// Times into target; a null target times nothing.
    explicit Scope(double* target) : Scope(target, nullptr, -1) {}
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() {
      if (target_ == nullptr) return;
      const double s = std::chrono::duration<double>(Clock::now() - start_).count();
      *target_ += s;
      if (owner_ == nullptr) return;
      if (outer_ >= 0) owner_->phase_s_[static_cast<std::size_t>(outer_)] -= s;
      owner_->open_ = outer_;
    }

   private:
    friend class StepTimers;
    // An exclusive phase of owner: on its end, its time leaves phase outer (-1: none), which
    // is open again.
    Scope(double* target, StepTimers* owner, int outer)
        : target_(target), owner_(owner), outer_(outer) {
      if (target_ != nullptr) start_ = Clock::now();
    }
    double* target_;
    StepTimers* owner_;
    int outer_;
    Clock::time_point start_;
  };

  /// Switches timing on or off (the accumulators keep their values).
  void enable(bool on = true) { enabled_ = on; }
  /// True while timing.
  bool enabled() const { return enabled_; }
  /// Zeroes every accumulator and counter.
  void reset() {
    phase_s_.fill(0.0);
    for (double& t : unit_forward_s_) t = 0;
    for (double& t : unit_backward_s_) t = 0;
    micro_steps_ = 0;
  }

  /// Times phase p for the scope's life (see the file comment for phases inside phases).
  Scope phase(Phase p) {
    if (!enabled_) return Scope(nullptr);
    double* target = &phase_s_[static_cast<std::size_t>(p)];
    if (p == Phase::reduction_wait || p == Phase::gather_wait) return Scope(target);
    const int outer = open_;
    if (outer == static_cast<int>(p)) return Scope(nullptr);  // already timed by the outer one
    open_ = static_cast<int>(p);
    return Scope(target, this, outer);
  }
  /// Times unit u's own forward (when counted) or backward.
  Scope unit(Phase p, int u, bool counted = true) {
    if (!enabled_ || !counted) return Scope(nullptr);
    auto& slots = p == Phase::backward ? unit_backward_s_ : unit_forward_s_;
    if (slots.size() <= static_cast<std::size_t>(u)) slots.resize(static_cast<std::size_t>(u) + 1);
    return Scope(&slots[static_cast<std::size_t>(u)]);
  }
  /// Counts one training micro-step (forward of every unit) while timing.
  void count_micro_step() {
    if (enabled_) ++micro_steps_;
  }

  /// The time accumulated since earlier, a copy of these timers taken before (the same units).
  StepTimers since(const StepTimers& earlier) const {
    StepTimers d = *this;
    for (std::size_t i = 0; i < phase_count; ++i) d.phase_s_[i] -= earlier.phase_s_[i];
    for (std::size_t u = 0; u < d.unit_forward_s_.size(); ++u) {
      d.unit_forward_s_[u] -= at(earlier.unit_forward_s_, static_cast<int>(u));
    }
    for (std::size_t u = 0; u < d.unit_backward_s_.size(); ++u) {
      d.unit_backward_s_[u] -= at(earlier.unit_backward_s_, static_cast<int>(u));
    }
    d.micro_steps_ -= earlier.micro_steps_;
    return d;
  }

  /// Seconds accumulated in phase p.
  double seconds(Phase p) const { return phase_s_[static_cast<std::size_t>(p)]; }
  /// Seconds of unit u's own forward (0 when never timed).
  double unit_forward_s(int u) const { return at(unit_forward_s_, u); }
  /// Seconds of unit u's own backward.
  double unit_backward_s(int u) const { return at(unit_backward_s_, u); }
  /// Training micro-steps counted since the last reset.
  long micro_steps() const { return micro_steps_; }

 private:
  static double at(const std::vector<double>& v, int u) {
    return static_cast<std::size_t>(u) < v.size() ? v[static_cast<std::size_t>(u)] : 0.0;
  }

  bool enabled_ = false;
  int open_ = -1;  ///< the exclusive phase being timed (forward, backward or step), or -1
  std::array<double, phase_count> phase_s_{};
  std::vector<double> unit_forward_s_, unit_backward_s_;
  long micro_steps_ = 0;
};

}  // namespace zero::profile
