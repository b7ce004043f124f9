#pragma once
// What every optimizer over a flat fp32 shard shares: the shard size, the parameter groups, the
// step counter and the named state buffers (each as long as the shard, element i belonging to
// parameter element i), with a save/restore of all of them as a StateDict.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <optim/param_groups.hpp>
#include <optim/state_dict.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Base of the flat-shard optimizers; Hyper needs members `lr` and `weight_decay`.
template <class Hyper>
class FlatOptimizer {
 public:
  using hyper_type = Hyper;  ///< the per-group hyper-parameters

  /// Elements in the shard.
  std::size_t numel() const { return numel_; }
  /// The groups; hyper-parameters may be changed between steps (schedules do).
  std::span<ParamGroup<Hyper>> groups() { return groups_; }
  /// The groups, read-only.
  std::span<const ParamGroup<Hyper>> groups() const { return groups_; }
  /// Steps taken so far (PyTorch's `step` state; bias corrections use it).
  std::int64_t step_count() const { return step_; }
  /// Sets the step counter (a checkpoint restoring the state buffers in place sets it after).
  void set_step_count(std::int64_t step) {
    expect<CheckpointError>(step >= 0, name_, ": negative step ", step);
    step_ = step;
  }
  /// Sets the learning rate of every group (what a schedule does each step).
  void set_lr(double lr) {
    for (auto& g : groups_) g.hyper.lr = lr;
  }
  /// Sets every group's (beta1, beta2) when the hyper-parameters have betas (a momentum
  /// schedule: DeepSpeed's OneCycle); false, changing nothing, for an optimizer without them.
  bool set_betas(double beta1, double beta2) {
    if constexpr (requires(Hyper h) {
                    h.beta1 = 0.0;
                    h.beta2 = 0.0;
                  }) {
      for (auto& g : groups_) {
        g.hyper.beta1 = beta1;
        g.hyper.beta2 = beta2;
      }
      return true;
    } else {
      return false;
    }
  }
  /// Names of the state buffers, in the order the update rule uses them.
  const std::vector<std::string>& state_names() const { return names_; }
  /// The state buffer called name (numel floats).
  std::span<float> state(std::string_view name) {
    const auto ptrs = state_pointers();
    for (std::size_t k = 0; k < names_.size(); ++k) {
      if (names_[k] == name) return {ptrs[k], numel_};
    }
    raise<Error>(name_, ": no state buffer '", std::string(name), "'");
  }
  /// Gives up the state buffers' memory: from now on the states live where the owner keeps them
  /// (NVMe offload swaps them in for each step), and bind_state must point the optimizer at
  /// them before step() or state(). Copy or save the states first.
  void release_state_storage() {
    buffers_.clear();
    buffers_.shrink_to_fit();
    external_.assign(names_.size(), nullptr);
    released_ = true;
  }
  /// Points the (released) states at memory the owner keeps, one span per state name in
  /// state_names() order, each numel() long; an empty list unbinds them.
  void bind_state(std::span<const std::span<float>> states) {
    expect<Error>(released_, name_, ": bind_state needs release_state_storage first");
    if (states.empty()) {
      external_.assign(names_.size(), nullptr);
      return;
    }
    expect<ShapeError>(states.size() == names_.size(), name_, ": bind_state got ", states.size(),
                       " buffers for ", names_.size(), " states");
    for (std::size_t k = 0; k < states.size(); ++k) {
      expect<ShapeError>(states[k].size() >= numel_, name_, ": state '", names_[k], "' bound to ",
                         states[k].size(), " elements, needs ", numel_);
      external_[k] = states[k].data();
    }
  }
  /// Bytes of state this object holds in memory (0 once released).
  std::size_t state_bytes() const { return buffers_.size() * numel_ * sizeof(float); }
  /// A copy of the step counter and every state buffer.
  StateDict state_dict() const {
    StateDict out;
    out.counters["step"] = step_;
    for (std::size_t k = 0; k < names_.size(); ++k) {
      const float* data = released_ ? external_[k] : buffers_[k].data();
      expect<Error>(data != nullptr, name_, ": state '", names_[k], "' is not bound");
      out.buffers[names_[k]].assign(data, data + numel_);
    }
    return out;
  }
  /// Restores what state_dict saved; CheckpointError names a missing or mis-sized buffer.
  void load_state_dict(const StateDict& in) {
    const std::int64_t step = in.counter("step", name_);
    expect<CheckpointError>(step >= 0, name_, ": negative step ", step, " in state");
    for (std::size_t k = 0; k < names_.size(); ++k) {
      const auto& values = in.buffer(names_[k], numel_, name_);
      std::copy(values.begin(), values.end(), state_pointers()[k]);
    }
    step_ = step;
  }

 protected:
  /// An optimizer called name over numel elements with the given groups and state buffers,
  /// each initialised to initial_value.
  FlatOptimizer(const char* name, std::size_t numel, std::vector<ParamGroup<Hyper>> groups,
                std::vector<std::string> state_names, float initial_value = 0.0f)
      : name_(name), numel_(numel), groups_(std::move(groups)), names_(std::move(state_names)) {
    std::vector<Range> ranges;
    for (const auto& g : groups_) ranges.push_back(g.range);
    validate_ranges(ranges, numel_, name_);
    for (std::size_t k = 0; k < names_.size(); ++k) {
      buffers_.emplace_back(numel_);
      if (initial_value != 0.0f) std::fill_n(buffers_.back().data(), numel_, initial_value);
    }
  }

  /// Checks every group's hyper-parameters (validate(Hyper, group, name), of the optimizer's
  /// header): at construction, and at every step, since a schedule may have changed them.
  void validate_groups() const {
    for (std::size_t k = 0; k < groups_.size(); ++k) validate(groups_[k].hyper, k, name_);
  }
  /// Starts a step: validate_groups, then counts it, so a step refused for a bad value (a
  /// schedule's negative learning rate) leaves the counter, and the bias corrections that
  /// follow it, as they were.
  void begin_counted_step() {
    validate_groups();
    ++step_;
  }

  /// The group ranges, in group order.
  std::vector<Range> ranges() const {
    std::vector<Range> out;
    for (const auto& g : groups_) out.push_back(g.range);
    return out;
  }
  /// Pointers to the state buffers, in name order (the bound ones once released).
  std::vector<float*> state_pointers() {
    if (released_) {
      for (std::size_t k = 0; k < external_.size(); ++k) {
        expect<Error>(external_[k] != nullptr, name_, ": state '", names_[k],
                      "' is not bound (released storage; call bind_state)");
      }
      return external_;
    }
    std::vector<float*> out;
    for (auto& b : buffers_) out.push_back(b.data());
    return out;
  }

  const char* name_;                       ///< for messages
  std::size_t numel_;                      ///< shard size
  std::vector<ParamGroup<Hyper>> groups_;  ///< ranges and their hyper-parameters
  std::vector<std::string> names_;         ///< state buffer names
  std::vector<Buffer<float>> buffers_;     ///< state buffers (empty once released)
  std::vector<float*> external_;           ///< bound states after release_state_storage
  bool released_ = false;                  ///< release_state_storage was called (a stateless
                                           ///< optimizer has no external_ to say so)
  std::int64_t step_ = 0;                  ///< steps taken
};

}  // namespace zero::optim
