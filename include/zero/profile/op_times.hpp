#pragma once
// OpTimes: wall-clock seconds per layer kind ("Linear", "LayerNorm", "CausalSelfAttention", ...)
// of the forward and backward passes that ran with it set in StepContext::op_times. Sequential
// times each layer's call; a layer that runs other layers (Residual) is charged only its own
// time, the time of the layers inside it going to their kinds, so the kinds add up to the pass.
// The gradient buffers Sequential zeroes between layers are charged to "Sequential". Off (a null
// pointer, the default) each hook costs one branch.
//
// Kernels that run asynchronously (a GPU's) return before their work is done, so the clock alone
// would charge a kernel's time to whichever later call waits for it. set_fence(f) makes every
// open and close call f first (a stream synchronize): each kind then gets its own device time,
// at the cost of one wait per layer call. The profile is for finding where a step's time goes,
// not for timing the step.

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zero::profile {

/// Accumulated seconds per layer kind (see the file comment).
class OpTimes {
 public:
  using Clock = std::chrono::steady_clock;

  /// Times one call for the scope's life: its self time (less nested scopes) goes to kind.
  class Scope {
   public:
    /// Times into times under kind; a null times times nothing.
    Scope(OpTimes* times, std::string_view kind) : times_(times) {
      if (times_ != nullptr) times_->open(kind);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() {
      if (times_ != nullptr) times_->close();
    }

   private:
    OpTimes* times_;
  };

  /// Seconds per kind, in name order.
  const std::map<std::string, double, std::less<>>& seconds() const { return seconds_; }
  /// Sum over kinds.
  double total() const {
    double sum = 0;
    for (const auto& [kind, s] : seconds_) sum += s;
    return sum;
  }
  /// Zeroes every kind.
  void clear() { seconds_.clear(); }
  /// Runs fence before each reading of the clock (see the file comment); an empty one, the
  /// default, runs nothing.
  void set_fence(std::function<void()> fence) { fence_ = std::move(fence); }

  /// The kind of a layer from its description: the first word ("Linear 'mlp.fc'" -> "Linear").
  static std::string_view kind_of(std::string_view description) {
    return description.substr(0, description.find(' '));
  }

 private:
  struct Open {
    std::string kind;
    Clock::time_point start;
    double nested = 0;  // seconds of the scopes opened inside this one
  };

  void open(std::string_view kind) {
    if (fence_) fence_();
    stack_.push_back({std::string(kind), Clock::now(), 0});
  }
  void close() {
    if (fence_) fence_();
    const Open top = std::move(stack_.back());
    stack_.pop_back();
    const double elapsed = std::chrono::duration<double>(Clock::now() - top.start).count();
    auto it = seconds_.find(top.kind);
    if (it == seconds_.end()) it = seconds_.emplace(top.kind, 0.0).first;
    it->second += elapsed - top.nested;
    if (!stack_.empty()) stack_.back().nested += elapsed;
  }

  std::map<std::string, double, std::less<>> seconds_;
  std::vector<Open> stack_;
  std::function<void()> fence_;
};

}  // namespace zero::profile
