#pragma once
// MoEBlocks: which blocks of a GPT (nn::LayerGPT) are mixture-of-experts blocks, and how their
// experts are routed and split: Megatron-DeepSpeed's --num-experts and --expert-interval, and
// DeepSpeed's MoE settings (the `moe` config section, RouterConfig) with the expert-parallel
// group. Block l (from 0) is an MoE block when (l + 1) is a multiple of `every`: every = 1 makes
// every block MoE, every = 2 (the default, Megatron-DeepSpeed's) every second one. With a
// tensor-parallel model, `expert_tp` says how tp splits the experts (expert_tensor_parallel.hpp).

#include <cstdint>
#include <utility>

#include <parallel/moe/expert_parallel.hpp>
#include <zero/config/moe.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/moe/expert_tensor_parallel.hpp>
#include <zero/nn/moe/router.hpp>

namespace zero::nn {

/// The mixture-of-experts blocks of a GPT (see the file comment).
struct MoEBlocks {
  RouterConfig router;          ///< num_experts <= 1: no MoE block (a dense GPT)
  int every = 2;                ///< every `every`-th block is an MoE block
  parallel::ExpertParallel ep;  ///< the experts' expert-parallel group (none: ep = 1)
  /// How a tensor-parallel group splits the experts: each one's hidden units (Megatron's
  /// default), or whole experts over the tp ranks (expert_tensor_parallel_size = 1).
  ExpertTensorParallel expert_tp = ExpertTensorParallel::hidden;

  /// True when the model has MoE blocks.
  bool active() const { return router.num_experts > 1; }
  /// True when block l is an MoE block.
  bool is_moe_block(std::int64_t l) const { return active() && (l + 1) % every == 0; }
  /// Throws ConfigError naming the setting when `every` is out of range (the router and the
  /// experts' split over ep are checked by the layers that use them).
  void validate() const {
    expect<ConfigError>(!active() || every >= 1, "moe.expert_interval = ", every,
                        "; expected >= 1");
  }

  /// The MoE blocks of a config's `moe` section, their experts split over ep (whose size must be
  /// moe.ep_size: ConfigError naming the key otherwise) and, in a model split over tp ranks, as
  /// moe.expert_tensor_parallel_size says (1 or tp; ConfigError naming it otherwise).
  static MoEBlocks from_config(const config::MoEConfig& c, parallel::ExpertParallel ep = {},
                               int tp = 1) {
    expect<ConfigError>(!c.active() || c.ep_size == ep.size(), "moe.ep_size = ", c.ep_size,
                        " but the model's expert-parallel group has ", ep.size(), " ranks");
    MoEBlocks m;
    m.expert_tp = expert_tensor_parallel_of(c.expert_tensor_parallel_size, tp);
    m.router.num_experts = static_cast<int>(c.num_experts);
    m.router.k = static_cast<int>(c.k);
    m.router.capacity_factor = c.capacity_factor;
    m.router.min_capacity = static_cast<int>(c.min_capacity);
    m.router.drop_tokens = c.drop_tokens;
    m.router.random_token_selection = c.use_rts;
    m.router.eval_capacity_factor = c.eval_capacity_factor;
    m.router.noise = c.noisy_gate_policy == "jitter"    ? GateNoise::jitter
                     : c.noisy_gate_policy == "rsample" ? GateNoise::rsample
                                                        : GateNoise::none;
    m.router.second_expert_sampling = c.top2_2nd_expert_sampling;
    m.router.aux_loss_coef = c.aux_loss_coef;
    m.router.z_loss_coef = c.z_loss_coef;
    m.every = static_cast<int>(c.expert_interval);
    m.ep = std::move(ep);
    return m;
  }
};

}  // namespace zero::nn
