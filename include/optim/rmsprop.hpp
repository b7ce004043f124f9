#pragma once
// RMSProp over a flat fp32 shard, fused with unscale, clip and the bf16/f16 write-back.
// Semantics of PyTorch's torch.optim.RMSprop (Hinton's lecture 6e; centered form after Graves
// 2013): eps added after the square root, optional centering and momentum. The per-element
// formula is RmspropRule in update_rules.hpp.

#include <cstdint>
#include <string>
#include <vector>

#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Per-group hyper-parameters of RMSProp (PyTorch's defaults).
struct RmspropHyper {
  double lr = 1e-2;           ///< learning rate
  double alpha = 0.99;        ///< smoothing of the squared gradient
  double eps = 1e-8;          ///< added to the root
  double weight_decay = 0.0;  ///< L2 term added to the gradient
};

/// Throws ConfigError naming the bad RMSprop hyper-parameter of group index group (as
/// torch.optim.RMSprop refuses them).
inline void validate(const RmspropHyper& h, std::size_t group, const char* who) {
  expect<ConfigError>(h.lr >= 0.0, who, ": group ", group, ": lr must be >= 0, got ", h.lr);
  expect<ConfigError>(h.alpha >= 0.0 && h.alpha < 1.0, who, ": group ", group,
                      ": alpha must be in [0, 1), got ", h.alpha);
  expect<ConfigError>(h.eps >= 0.0, who, ": group ", group, ": eps must be >= 0, got ", h.eps);
  expect<ConfigError>(h.weight_decay >= 0.0, who, ": group ", group,
                      ": weight_decay must be >= 0, got ", h.weight_decay);
}

/// Optimizer-wide RMSProp options (they decide which state buffers exist).
struct RmspropOptions {
  double momentum = 0.0;  ///< 0 disables the momentum buffer
  bool centered = false;  ///< subtract the squared mean gradient
};

/// RMSProp over a flat shard; states square_avg [, grad_avg] [, momentum_buffer].
class Rmsprop : public FlatOptimizer<RmspropHyper> {
 public:
  /// One group over the whole shard.
  explicit Rmsprop(std::size_t numel, const RmspropHyper& hyper = {},
                   const RmspropOptions& options = {})
      : Rmsprop(numel, single_group(numel, hyper), options) {}
  /// Several groups.
  Rmsprop(std::size_t numel, std::vector<ParamGroup<RmspropHyper>> groups,
          const RmspropOptions& options)
      : FlatOptimizer<RmspropHyper>("RMSprop", numel, std::move(groups), names_for(options)),
        options_(options) {
    expect<ConfigError>(options.momentum >= 0.0, "RMSprop: momentum must be >= 0, got ",
                        options.momentum);
    validate_groups();
  }

  /// One fused step.
  void step(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, true, "RMSprop");
    begin_counted_step();
    const bool momentum = options_.momentum > 0.0;
    if (options_.centered) {
      momentum ? run_rules<true, true>(io, run) : run_rules<true, false>(io, run);
    } else {
      momentum ? run_rules<false, true>(io, run) : run_rules<false, false>(io, run);
    }
  }

 private:
  static std::vector<std::string> names_for(const RmspropOptions& o) {
    std::vector<std::string> names{"square_avg"};
    if (o.centered) names.emplace_back("grad_avg");
    if (o.momentum > 0.0) names.emplace_back("momentum_buffer");
    return names;
  }

  template <bool Centered, bool Momentum>
  void run_rules(const FusedIo& io, const StepOptions& run) {
    std::vector<RmspropRule<Centered, Momentum>> rules;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const auto& g = groups_[k];
      RmspropRule<Centered, Momentum> r{};
      r.weight_decay = static_cast<float>(g.hyper.weight_decay);
      r.alpha = static_cast<float>(g.hyper.alpha);
      r.one_minus_alpha = static_cast<float>(1.0 - g.hyper.alpha);
      r.eps = static_cast<float>(g.hyper.eps);
      r.momentum = static_cast<float>(options_.momentum);
      r.neg_lr = static_cast<float>(-g.hyper.lr);
      rules.push_back(r);
    }
    const auto r = ranges();
    const auto s = state_pointers();
    run_fused<RmspropRule<Centered, Momentum>>(rules, r, io, s, static_cast<std::uint32_t>(step_),
                                               run);
  }

  RmspropOptions options_;
};

}  // namespace zero::optim
