#pragma once
// The "moe" config section: mixture-of-experts settings with DeepSpeed's names and defaults
// (deepspeed.moe.layer.MoE: num_experts, ep_size, k, capacity_factor, min_capacity,
// drop_tokens, use_rts, eval_capacity_factor, noisy_gate_policy, top2_2nd_expert_sampling) plus the
// auxiliary losses' coefficients (aux_loss_coef, Megatron's moe_aux_loss_coeff; z_loss_coef,
// Megatron's moe_z_loss_coeff), expert_interval (Megatron-DeepSpeed's --expert-interval: every
// k-th block is an MoE block) and expert_tensor_parallel_size (Megatron's: 1 keeps the experts
// whole, the tp ranks holding different ones; unset or tp splits each expert over tp; checked
// against tp where the model is built, MoEBlocks::from_config). DeepSpeed passes these to the MoE
// layer in model code; zero reads them from the config so train_gpt and users' programs take
// them from one place. Experts that do not split over ep_size (ep_size > 1 without MoE layers
// too) are a ConfigError naming both keys.

#include <cstdint>
#include <string>
#include <vector>

#include <zero/config/json_reader.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

/// Mixture-of-experts settings (see the file comment).
struct MoEConfig {
  std::int64_t num_experts = 1;       ///< experts per MoE layer (1: no MoE)
  std::int64_t ep_size = 1;           ///< expert-parallel ranks the experts split over
  std::int64_t k = 1;                 ///< experts per token: 1 (Switch) or 2 (GShard)
  double capacity_factor = 1.0;       ///< slots per expert = ceil(k tokens / experts * this)
  double eval_capacity_factor = 1.0;  ///< capacity_factor outside training
  std::int64_t min_capacity = 4;      ///< at least this many slots per expert
  bool drop_tokens = true;            ///< false: no capacity limit
  /// Random token selection, top-1 only: an expert over capacity keeps random tokens, not the
  /// first ones. DeepSpeed's MoE layer defaults it to true; here it is asked for.
  bool use_rts = false;
  /// DeepSpeed's noisy_gate_policy, lower case: "none", "jitter" or "rsample" (top-1).
  std::string noisy_gate_policy = "none";
  /// Top-2: the second choice sampled by Gumbel noise. DeepSpeed defaults it to true; here it is
  /// asked for.
  bool top2_2nd_expert_sampling = false;
  double aux_loss_coef = 0.01;       ///< load-balancing loss weight
  double z_loss_coef = 0.0;          ///< router z-loss weight
  std::int64_t expert_interval = 2;  ///< every expert_interval-th block is an MoE block
  /// Megatron's expert_tensor_parallel_size: 0 (unset) or tp splits each expert's hidden units
  /// over tp, 1 keeps the experts whole (the tp ranks hold different ones).
  std::int64_t expert_tensor_parallel_size = 0;

  /// Reads the section at r (the "moe" object); key paths nobody reads are appended to unknown.
  static MoEConfig read(JsonReader r, std::vector<std::string>& unknown) {
    MoEConfig c;
    c.num_experts = r.int32("num_experts").value_or(c.num_experts);
    c.ep_size = r.int32("ep_size").value_or(c.ep_size);
    c.k = r.int32("k").value_or(c.k);
    c.capacity_factor = r.number("capacity_factor").value_or(c.capacity_factor);
    c.min_capacity = r.int32("min_capacity").value_or(c.min_capacity);
    c.drop_tokens = r.boolean("drop_tokens").value_or(c.drop_tokens);
    c.use_rts = r.boolean("use_rts").value_or(c.use_rts);
    c.eval_capacity_factor = r.number("eval_capacity_factor").value_or(c.eval_capacity_factor);
    c.noisy_gate_policy = lowercase(r.string_or_null("noisy_gate_policy").value_or("none"));
    c.top2_2nd_expert_sampling =
        r.boolean("top2_2nd_expert_sampling").value_or(c.top2_2nd_expert_sampling);
    expect<ConfigError>(c.noisy_gate_policy == "none" || c.noisy_gate_policy == "jitter" ||
                            c.noisy_gate_policy == "rsample",
                        r.where("noisy_gate_policy"), " = \"", c.noisy_gate_policy,
                        "\"; expected null, \"None\", \"Jitter\" or \"RSample\"");
    expect<ConfigError>(c.noisy_gate_policy != "rsample" || c.k == 1, r.where("noisy_gate_policy"),
                        " RSample applies to top-1 routing, but ", r.where("k"), " = ", c.k,
                        " (top-2 samples its second choice: ", r.where("top2_2nd_expert_sampling"),
                        ")");
    expect<ConfigError>(!c.top2_2nd_expert_sampling || c.k == 2,
                        r.where("top2_2nd_expert_sampling"), " applies to top-2 routing, but ",
                        r.where("k"), " = ", c.k);
    expect<ConfigError>(c.eval_capacity_factor > 0, r.where("eval_capacity_factor"), " = ",
                        c.eval_capacity_factor, "; expected > 0");
    c.aux_loss_coef = r.number("aux_loss_coef").value_or(c.aux_loss_coef);
    c.z_loss_coef = r.number("z_loss_coef").value_or(c.z_loss_coef);
    c.expert_interval = r.int32("expert_interval").value_or(c.expert_interval);
    if (const auto etp = r.int32("expert_tensor_parallel_size")) {
      expect<ConfigError>(*etp >= 1, r.where("expert_tensor_parallel_size"), " = ", *etp,
                          "; expected >= 1");
      c.expert_tensor_parallel_size = *etp;
    }
    expect<ConfigError>(c.num_experts >= 1, r.where("num_experts"), " = ", c.num_experts,
                        "; expected >= 1");
    expect<ConfigError>(c.ep_size >= 1, r.where("ep_size"), " = ", c.ep_size, "; expected >= 1");
    // num_experts 1 (no MoE layer) with ep_size > 1 too: the ranks meant for experts would
    // silently train a dense model.
    expect<ConfigError>(c.num_experts % c.ep_size == 0, r.where("num_experts"), " = ",
                        c.num_experts, " must be a multiple of ", r.where("ep_size"), " = ",
                        c.ep_size, " (each expert-parallel rank holds num_experts / ep_size",
                        c.num_experts == 1 ? "; 1 expert is no MoE layer" : "", ")");
    expect<ConfigError>(c.k == 1 || c.k == 2, r.where("k"), " = ", c.k,
                        "; expected 1 (top-1) or 2 (top-2)");
    expect<ConfigError>(c.num_experts == 1 || c.k <= c.num_experts, r.where("k"), " = ", c.k,
                        " is more than ", r.where("num_experts"), " = ", c.num_experts);
    expect<ConfigError>(!c.use_rts || c.k == 1, r.where("use_rts"),
                        " applies to top-1 routing, but ", r.where("k"), " = ", c.k,
                        " (DeepSpeed's top-2 gate has no random token selection)");
    expect<ConfigError>(c.capacity_factor > 0, r.where("capacity_factor"), " = ", c.capacity_factor,
                        "; expected > 0");
    expect<ConfigError>(c.min_capacity >= 0, r.where("min_capacity"), " = ", c.min_capacity,
                        "; expected >= 0");
    expect<ConfigError>(c.aux_loss_coef >= 0 && c.z_loss_coef >= 0, r.where("aux_loss_coef"),
                        " and ", r.where("z_loss_coef"), " must be >= 0");
    expect<ConfigError>(c.expert_interval >= 1, r.where("expert_interval"), " = ",
                        c.expert_interval, "; expected >= 1");
    for (const auto& key : r.unknown_keys()) unknown.push_back(key);
    return c;
  }
  /// True when the model has MoE layers.
  bool active() const { return num_experts > 1; }
};

}  // namespace zero::config
