#pragma once
// Lion over a flat fp32 shard, fused with unscale, clip and the bf16/f16 write-back.
// Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023, Algorithm 2
// (decoupled weight decay; update = sign of an interpolation of momentum and gradient).
// The per-element formula is LionRule in update_rules.hpp.

#include <cstdint>
#include <vector>

#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Per-group hyper-parameters of Lion (the paper's defaults).
struct LionHyper {
  double lr = 1e-4;           ///< learning rate
  double beta1 = 0.9;         ///< interpolation for the update direction
  double beta2 = 0.99;        ///< momentum decay
  double weight_decay = 0.0;  ///< decoupled: p *= 1 - lr * wd
};

/// Throws ConfigError naming the bad Lion hyper-parameter of group index group.
inline void validate(const LionHyper& h, std::size_t group, const char* who) {
  expect<ConfigError>(h.lr >= 0.0, who, ": group ", group, ": lr must be >= 0, got ", h.lr);
  expect<ConfigError>(h.beta1 >= 0.0 && h.beta1 <= 1.0 && h.beta2 >= 0.0 && h.beta2 < 1.0, who,
                      ": group ", group, ": betas must be in [0, 1] and [0, 1), got ", h.beta1,
                      ", ", h.beta2);
  expect<ConfigError>(h.weight_decay >= 0.0, who, ": group ", group,
                      ": weight_decay must be >= 0, got ", h.weight_decay);
}

/// Lion over a flat shard; state exp_avg.
class Lion : public FlatOptimizer<LionHyper> {
 public:
  /// One group over the whole shard.
  explicit Lion(std::size_t numel, const LionHyper& hyper = {})
      : Lion(numel, single_group(numel, hyper)) {}
  /// Several groups.
  Lion(std::size_t numel, std::vector<ParamGroup<LionHyper>> groups)
      : FlatOptimizer<LionHyper>("Lion", numel, std::move(groups), {"exp_avg"}) {
    validate_groups();
  }

  /// One fused step.
  void step(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, true, "Lion");
    begin_counted_step();
    std::vector<LionRule> rules;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const LionHyper& h = groups_[k].hyper;
      rules.push_back({static_cast<float>(h.beta1), static_cast<float>(1.0 - h.beta1),
                       static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2),
                       static_cast<float>(-h.lr), static_cast<float>(1.0 - h.lr * h.weight_decay)});
    }
    const auto r = ranges();
    const auto s = state_pointers();
    run_fused<LionRule>(rules, r, io, s, static_cast<std::uint32_t>(step_), run);
  }
};

}  // namespace zero::optim
