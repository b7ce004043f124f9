#pragma once
// SGD with momentum, Nesterov and weight decay over a flat fp32 shard, fused with unscale, clip
// and the bf16/f16 write-back. Semantics of PyTorch's torch.optim.SGD (docs: "SGD" algorithm
// box; Nesterov after Sutskever et al. 2013): the first momentum step copies the gradient into
// the buffer. The per-element formula is SgdRule in update_rules.hpp.

#include <cstdint>
#include <vector>

#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Per-group hyper-parameters of SGD (PyTorch's defaults).
struct SgdHyper {
  double lr = 1e-3;           ///< learning rate
  double weight_decay = 0.0;  ///< L2 term added to the gradient
};

/// Throws ConfigError naming the bad SGD hyper-parameter of group index group (as
/// torch.optim.SGD refuses them).
inline void validate(const SgdHyper& h, std::size_t group, const char* who) {
  expect<ConfigError>(h.lr >= 0.0, who, ": group ", group, ": lr must be >= 0, got ", h.lr);
  expect<ConfigError>(h.weight_decay >= 0.0, who, ": group ", group,
                      ": weight_decay must be >= 0, got ", h.weight_decay);
}

/// Optimizer-wide SGD options (they decide which state buffers exist).
struct SgdOptions {
  double momentum = 0.0;   ///< 0 disables the momentum buffer
  double dampening = 0.0;  ///< scales the gradient entering the buffer
  bool nesterov = false;   ///< Nesterov momentum (needs momentum > 0 and dampening 0)
};

/// SGD over a flat shard; state momentum_buffer when momentum > 0.
class Sgd : public FlatOptimizer<SgdHyper> {
 public:
  /// One group over the whole shard.
  explicit Sgd(std::size_t numel, const SgdHyper& hyper = {}, const SgdOptions& options = {})
      : Sgd(numel, single_group(numel, hyper), options) {}
  /// Several groups.
  Sgd(std::size_t numel, std::vector<ParamGroup<SgdHyper>> groups, const SgdOptions& options)
      : FlatOptimizer<SgdHyper>("SGD", numel, std::move(groups),
                                options.momentum > 0.0 ? std::vector<std::string>{"momentum_buffer"}
                                                       : std::vector<std::string>{}),
        options_(options) {
    expect<ConfigError>(options.momentum >= 0.0, "SGD: momentum must be >= 0, got ",
                        options.momentum);
    expect<ConfigError>(!options.nesterov || (options.momentum > 0.0 && options.dampening == 0.0),
                        "SGD: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
    validate_groups();
  }

  /// The optimizer-wide options.
  const SgdOptions& options() const { return options_; }

  /// One fused step.
  void step(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, true, "SGD");
    begin_counted_step();
    if (options_.momentum > 0.0) {
      run_rules<true>(io, run);
    } else {
      run_rules<false>(io, run);
    }
  }

 private:
  template <bool Momentum>
  void run_rules(const FusedIo& io, const StepOptions& run) {
    std::vector<SgdRule<Momentum>> rules;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const auto& g = groups_[k];
      SgdRule<Momentum> r{};
      r.weight_decay = static_cast<float>(g.hyper.weight_decay);
      r.momentum = static_cast<float>(options_.momentum);
      r.one_minus_dampening = static_cast<float>(1.0 - options_.dampening);
      r.neg_lr = static_cast<float>(-g.hyper.lr);
      r.nesterov = options_.nesterov;
      r.first_step = step_ == 1;
      rules.push_back(r);
    }
    const auto ranges_ = ranges();
    const auto s = state_pointers();
    run_fused<SgdRule<Momentum>>(rules, ranges_, io, s, static_cast<std::uint32_t>(step_), run);
  }

  SgdOptions options_;
};

}  // namespace zero::optim
