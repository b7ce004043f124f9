#pragma once
// Adagrad over a flat fp32 shard, fused with unscale, clip and the bf16/f16 write-back.
// Duchi, Hazan & Singer, "Adaptive Subgradient Methods", JMLR 2011, with PyTorch's
// torch.optim.Adagrad conventions (lr_decay, initial_accumulator_value, eps after the root).
// The per-element formula is AdagradRule in update_rules.hpp.

#include <cstdint>
#include <vector>

#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Per-group hyper-parameters of Adagrad (PyTorch's defaults).
struct AdagradHyper {
  double lr = 1e-2;           ///< learning rate
  double lr_decay = 0.0;      ///< lr / (1 + (t - 1) * lr_decay)
  double eps = 1e-10;         ///< added to the root
  double weight_decay = 0.0;  ///< L2 term added to the gradient
};

/// Throws ConfigError naming the bad Adagrad hyper-parameter of group index group (as
/// torch.optim.Adagrad refuses them).
inline void validate(const AdagradHyper& h, std::size_t group, const char* who) {
  expect<ConfigError>(h.lr >= 0.0, who, ": group ", group, ": lr must be >= 0, got ", h.lr);
  expect<ConfigError>(h.lr_decay >= 0.0, who, ": group ", group, ": lr_decay must be >= 0, got ",
                      h.lr_decay);
  expect<ConfigError>(h.eps >= 0.0, who, ": group ", group, ": eps must be >= 0, got ", h.eps);
  expect<ConfigError>(h.weight_decay >= 0.0, who, ": group ", group,
                      ": weight_decay must be >= 0, got ", h.weight_decay);
}

/// Adagrad over a flat shard; state sum (starting at initial_accumulator_value).
class Adagrad : public FlatOptimizer<AdagradHyper> {
 public:
  /// One group over the whole shard.
  explicit Adagrad(std::size_t numel, const AdagradHyper& hyper = {},
                   double initial_accumulator_value = 0.0)
      : Adagrad(numel, single_group(numel, hyper), initial_accumulator_value) {}
  /// Several groups.
  Adagrad(std::size_t numel, std::vector<ParamGroup<AdagradHyper>> groups,
          double initial_accumulator_value)
      : FlatOptimizer<AdagradHyper>("Adagrad", numel, std::move(groups), {"sum"},
                                    static_cast<float>(initial_accumulator_value)) {
    expect<ConfigError>(initial_accumulator_value >= 0.0,
                        "Adagrad: initial_accumulator_value must be >= 0, got ",
                        initial_accumulator_value);
    validate_groups();
  }

  /// One fused step.
  void step(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, true, "Adagrad");
    begin_counted_step();
    std::vector<AdagradRule> rules;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const auto& g = groups_[k];
      const double clr = g.hyper.lr / (1.0 + static_cast<double>(step_ - 1) * g.hyper.lr_decay);
      rules.push_back({static_cast<float>(g.hyper.weight_decay), static_cast<float>(g.hyper.eps),
                       static_cast<float>(-clr)});
    }
    const auto r = ranges();
    const auto s = state_pointers();
    run_fused<AdagradRule>(rules, r, io, s, static_cast<std::uint32_t>(step_), run);
  }
};

}  // namespace zero::optim
