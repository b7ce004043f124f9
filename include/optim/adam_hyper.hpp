#pragma once
// Adam's and AdamW's hyper-parameters and the per-step constants of their update rule, shared by
// the host optimizer (adam.hpp) and the CUDA one (cuda/adamw.cuh); free of host SIMD code so nvcc
// can include it.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Hyper-parameters of Adam and AdamW (PyTorch's defaults; AdamW's weight decay 0.01).
struct AdamHyper {
  double lr = 1e-3;           ///< learning rate
  double beta1 = 0.9;         ///< first-moment decay
  double beta2 = 0.999;       ///< second-moment decay
  double eps = 1e-8;          ///< added to sqrt(v_hat)
  double weight_decay = 0.0;  ///< L2 (Adam) or decoupled (AdamW)
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
  r.decay =
      mode == WeightDecayMode::decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
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

}  // namespace zero::optim
