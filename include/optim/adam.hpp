#pragma once
// Adam and AdamW over a flat fp32 shard, fused with unscale, clip and the bf16/f16 write-back.
//
//   Adam:  Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Algorithm 1,
//          with PyTorch's torch.optim.Adam conventions: weight decay as an L2 term added to the
//          gradient, eps added to sqrt(v_hat).
//   AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019: the decay
//          multiplies the parameter by (1 - lr * wd) instead of entering the gradient (PyTorch's
//          torch.optim.AdamW, DeepSpeed's adam_w_mode=True).
// The per-element formula is AdamRule in update_rules.hpp.

#include <cmath>
#include <cstdint>
#include <vector>

#include <optim/adam_hyper.hpp>
#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Adam (Mode = l2) or AdamW (Mode = decoupled) over a flat shard; states exp_avg, exp_avg_sq.
template <WeightDecayMode Mode>
class AdamFamily : public FlatOptimizer<AdamHyper> {
 public:
  /// Name used in messages.
  static constexpr const char* name = Mode == WeightDecayMode::l2 ? "Adam" : "AdamW";

  /// PyTorch's defaults (AdamW decays by 0.01).
  static AdamHyper default_hyper() {
    AdamHyper h;
    if constexpr (Mode == WeightDecayMode::decoupled) h.weight_decay = 0.01;
    return h;
  }
  /// One group over the whole shard.
  explicit AdamFamily(std::size_t numel, const AdamHyper& hyper = default_hyper())
      : AdamFamily(numel, single_group(numel, hyper)) {}
  /// Several groups (e.g. from groups_from_mask).
  AdamFamily(std::size_t numel, std::vector<ParamGroup<AdamHyper>> groups)
      : FlatOptimizer<AdamHyper>(name, numel, std::move(groups), {"exp_avg", "exp_avg_sq"}) {
    this->validate_groups();
  }

  /// One fused step: unscale and clip the gradient by io.grad_scale, update param, m and v,
  /// write the low-precision copy when io asks for one.
  void step(const FusedIo& io, const StepOptions& options = {}) {
    optim::validate(io, numel_, true, name);
    this->begin_counted_step();
    std::vector<AdamRule> rules;
    for (const auto& g : groups_) rules.push_back(make_adam_rule(g.hyper, step_, Mode));
    const auto r = ranges();
    const auto s = state_pointers();
    run_fused<AdamRule>(rules, r, io, s, static_cast<std::uint32_t>(step_), options);
  }
};

/// Adam with L2 weight decay (Kingma & Ba 2015; torch.optim.Adam).
using Adam = AdamFamily<WeightDecayMode::l2>;
/// Adam with decoupled weight decay (Loshchilov & Hutter 2019; torch.optim.AdamW).
using AdamW = AdamFamily<WeightDecayMode::decoupled>;

}  // namespace zero::optim
