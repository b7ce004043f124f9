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

#include <zero/core/error.hpp>
#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>

namespace zero::optim {

/// Hyper-parameters of Adam and AdamW (PyTorch's defaults; AdamW's weight decay 0.01).
struct AdamHyper {
  double lr = 1e-3;            ///< learning rate
  double beta1 = 0.9;          ///< first-moment decay
  double beta2 = 0.999;        ///< second-moment decay
  double eps = 1e-8;           ///< added to sqrt(v_hat)
  double weight_decay = 0.0;   ///< L2 (Adam) or decoupled (AdamW)
};

/// Where weight decay enters: the gradient (Adam) or the parameter (AdamW).
enum class WeightDecayMode { l2, decoupled };

/// The AdamRule constants for hyper at step t (t >= 1), bias corrections computed in double.
inline AdamRule make_adam_rule(const AdamHyper& h, std::int64_t t, WeightDecayMode mode) {
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
  AdamRule r{};
  r.beta1 = static_cast<float>(h.beta1);
  r.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  r.beta2 = static_cast<float>(h.beta2);
  r.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  r.eps = static_cast<float>(h.eps);
  r.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  r.neg_step_size = static_cast<float>(-h.lr / bias1);
  r.l2 = mode == WeightDecayMode::l2 ? static_cast<float>(h.weight_decay) : 0.0f;
  r.decay = mode == WeightDecayMode::decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay)
                                               : 1.0f;
  return r;
}

/// Throws ConfigError naming the bad Adam hyper-parameter of group index group.
inline void validate(const AdamHyper& h, std::size_t group, const char* who) {
  expect<ConfigError>(h.lr >= 0.0, who, ": group ", group, ": lr must be >= 0, got ", h.lr);
  expect<ConfigError>(h.beta1 >= 0.0 && h.beta1 < 1.0, who, ": group ", group,
                      ": beta1 must be in [0, 1), got ", h.beta1);
  expect<ConfigError>(h.beta2 >= 0.0 && h.beta2 < 1.0, who, ": group ", group,
                      ": beta2 must be in [0, 1), got ", h.beta2);
  expect<ConfigError>(h.eps >= 0.0, who, ": group ", group, ": eps must be >= 0, got ", h.eps);
  expect<ConfigError>(h.weight_decay >= 0.0, who, ": group ", group,
                      ": weight_decay must be >= 0, got ", h.weight_decay);
}

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
    for (std::size_t k = 0; k < groups_.size(); ++k) validate(groups_[k].hyper, k, name);
  }

  /// One fused step: unscale and clip the gradient by io.grad_scale, update param, m and v,
  /// write the low-precision copy when io asks for one.
  void step(const FusedIo& io, const StepOptions& options = {}) {
    optim::validate(io, numel_, true, name);
    ++step_;
    std::vector<AdamRule> rules;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      validate(groups_[k].hyper, k, name);
      rules.push_back(make_adam_rule(groups_[k].hyper, step_, Mode));
    }
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
