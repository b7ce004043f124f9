#pragma once
// The token router of a mixture-of-experts layer, as DeepSpeed's TopKGate (sharded_moe.py) and
// GShard / Switch define it, on the router logits [N, E] of N tokens over E experts:
//   probs = softmax(logits); the first choice is each token's most probable expert (ties: the
//   lowest index), the second (k = 2) the most probable of the others;
//   capacity = max(min_capacity, ceil(k * N / E * capacity_factor)) slots per expert
//   (unlimited without drop_tokens); slots are handed out in token order, every token's first
//   choice before any second choice, and a choice past its expert's capacity is dropped;
//   with random token selection (DeepSpeed's use_rts, top-1 only) an expert chosen by more
//   tokens than it has slots keeps those of the highest random priority instead of the first
//   ones (DeepSpeed's topk over the choice mask times a uniform draw), the kept ones taking its
//   slots in token order; outside training the capacity takes eval_capacity_factor;
//   DeepSpeed's noise, asked for: noisy_gate_policy RSample (top-1, training) picks each token's
//   expert by its logits plus Gumbel noise, and top2_2nd_expert_sampling (top-2) its second
//   choice so, among the others; the probabilities stay the clean softmax's. (Jitter, the other
//   policy, scales the router's input: MixtureOfExperts applies it);
//   combine weight: k = 1 the first choice's probability; k = 2 each kept choice's probability
//   over the sum of the kept ones (a dropped choice weighs 0, DeepSpeed's normalisation);
//   load-balancing loss l_aux = E * sum_e me_e * ce_e, me the mean probability of expert e and ce
//   the fraction of tokens whose first choice it is (counted before dropping, as DeepSpeed);
//   router z-loss (ST-MoE) z = mean_t logsumexp(logits_t)^2.
// Without those settings routing is deterministic (DeepSpeed's top-2 adds Gumbel noise to the
// logits that pick the second choice by default; here it is asked for). The random draws come
// from the caller (RouterDraws: MixtureOfExperts draws them from counter-based streams, so a rerun
// or a recomputed forward routes alike). route() computes all of it; router_backward() turns the
// gradients of the combine weights, with the auxiliary losses' coefficients, into the gradient of
// the logits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::nn {

/// DeepSpeed's noisy_gate_policy values (RouterConfig::noise).
enum class GateNoise { none, jitter, rsample };

/// DeepSpeed's MoE gate settings (the `moe` section: num_experts, k, capacity_factor,
/// min_capacity, drop_tokens) and the auxiliary losses' coefficients.
struct RouterConfig {
  int num_experts = 1;
  int k = 1;                          ///< experts per token: 1 (Switch) or 2 (GShard)
  double capacity_factor = 1.0;       ///< slots per expert = ceil(k * tokens / experts * this)
  double eval_capacity_factor = 1.0;  ///< capacity_factor outside training (DeepSpeed's)
  int min_capacity = 4;               ///< at least this many slots per expert
  bool drop_tokens = true;            ///< false: no capacity limit, nothing dropped
  /// Random token selection (DeepSpeed's use_rts, top-1 only): an expert over capacity keeps the
  /// tokens of the highest random priority (route()'s priorities), not the first ones.
  bool random_token_selection = false;
  /// DeepSpeed's noisy_gate_policy: none, jitter (the router's input times a uniform draw in
  /// [1 - 1e-2, 1 + 1e-2] per element, training only) or rsample (top-1: each token's expert
  /// picked by its logits plus Gumbel noise, training only).
  GateNoise noise = GateNoise::none;
  /// DeepSpeed's top2_2nd_expert_sampling (top-2): the second choice picked by the logits plus
  /// Gumbel noise among the other experts. DeepSpeed defaults it to true; here it is asked for.
  bool second_expert_sampling = false;
  double aux_loss_coef = 0.01;  ///< weight of the load-balancing loss in the training loss
  double z_loss_coef = 0.0;     ///< weight of the router z-loss (ST-MoE; 0: off)

  /// Throws ConfigError naming the setting when one is out of range.
  void validate() const {
    expect<ConfigError>(num_experts >= 1, "moe.num_experts = ", num_experts, "; expected >= 1");
    expect<ConfigError>(k == 1 || k == 2, "moe.k = ", k, "; expected 1 (top-1) or 2 (top-2)");
    expect<ConfigError>(k <= num_experts, "moe.k = ", k,
                        " is more than num_experts = ", num_experts);
    expect<ConfigError>(capacity_factor > 0, "moe.capacity_factor = ", capacity_factor,
                        "; expected > 0");
    expect<ConfigError>(eval_capacity_factor > 0,
                        "moe.eval_capacity_factor = ", eval_capacity_factor, "; expected > 0");
    expect<ConfigError>(noise != GateNoise::rsample || k == 1,
                        "moe.noisy_gate_policy RSample applies to top-1 routing, but moe.k = ", k,
                        " (DeepSpeed's top-2 gate samples its second choice instead: "
                        "moe.top2_2nd_expert_sampling)");
    expect<ConfigError>(!second_expert_sampling || k == 2,
                        "moe.top2_2nd_expert_sampling applies to top-2 routing, but moe.k = ", k);
    expect<ConfigError>(min_capacity >= 0, "moe.min_capacity = ", min_capacity, "; expected >= 0");
    expect<ConfigError>(!random_token_selection || k == 1, "moe.use_rts (random token selection) ",
                        "applies to top-1 routing, but moe.k = ", k,
                        " (DeepSpeed's top-2 gate has no random token selection)");
    expect<ConfigError>(aux_loss_coef >= 0 && z_loss_coef >= 0,
                        "moe: the auxiliary loss coefficients must be >= 0 (aux ", aux_loss_coef,
                        ", z ", z_loss_coef, ")");
  }
  /// Slots per expert for tokens tokens (in training, else at eval_capacity_factor). No expert
  /// can receive more than tokens * k choices, so a larger factor (1e300: "never drop") is capped
  /// there before the conversion to an integer.
  std::int64_t capacity(std::int64_t tokens, bool training = true) const {
    if (!drop_tokens) return tokens * k;
    const double factor = training ? capacity_factor : eval_capacity_factor;
    const double slots = std::ceil(static_cast<double>(k) * static_cast<double>(tokens) /
                                   static_cast<double>(num_experts) * factor);
    const double most = static_cast<double>(tokens) * static_cast<double>(k);
    return std::max(static_cast<std::int64_t>(min_capacity),
                    static_cast<std::int64_t>(std::min(slots, most)));
  }
  /// True when route() reads RouterDraws::gumbel (in training, or not).
  bool samples_choices(bool training) const {
    return (k == 1 && noise == GateNoise::rsample && training) ||
           (k == 2 && second_expert_sampling);
  }
};

/// The random draws route() reads (see RouterConfig): empty spans where cfg asks for none.
struct RouterDraws {
  std::span<const double> priority = {};  ///< [N] random token selection: larger kept first
  std::span<const double> gumbel = {};    ///< [N * E] Gumbel noise on the logits picking a choice
  bool training = true;  ///< capacity_factor and RSample; else eval_capacity_factor
};

/// Where route() sent N tokens: per token and choice j < k (index t * k + j), the expert, the
/// slot it got there (-1 when dropped), its probability and its combine weight.
template <class A>
struct Routing {
  std::int64_t tokens = 0, capacity = 0;
  int k = 1, experts = 1;
  std::vector<int> expert;            ///< [N * k]
  std::vector<std::int64_t> slot;     ///< [N * k], -1: dropped
  std::vector<A> prob;                ///< [N * k] the chosen expert's probability
  std::vector<A> weight;              ///< [N * k] combine weight (0 when dropped)
  std::vector<std::int64_t> kept;     ///< [E] slots used per expert
  std::vector<A> probs;               ///< [N * E] softmax of the logits
  std::vector<A> lse;                 ///< [N] logsumexp of each token's logits
  std::vector<A> first_choice_share;  ///< [E] ce: tokens whose first choice is e, over N
  A aux_loss = 0;                     ///< l_aux (unweighted)
  A z_loss = 0;                       ///< z (unweighted)
  std::int64_t dropped = 0;           ///< choices past capacity

  /// The index of token t's choice j.
  std::size_t at(std::int64_t t, int j) const { return static_cast<std::size_t>(t * k + j); }
};

/// Routes N tokens by their logits [N, E] (row-major) under cfg (see the file comment), with
/// the random draws cfg asks for in draws.
template <class A>
Routing<A> route(const A* logits, std::int64_t N, const RouterConfig& cfg,
                 const RouterDraws& draws = {}) {
  cfg.validate();
  const std::span<const double> priority = draws.priority;
  expect<ShapeError>(!cfg.random_token_selection || priority.size() == static_cast<std::size_t>(N),
                     "route: random token selection needs a priority for each of the ", N,
                     " tokens, got ", priority.size());
  const int E = cfg.num_experts, k = cfg.k;
  const bool sampled = cfg.samples_choices(draws.training);
  expect<ShapeError>(!sampled || draws.gumbel.size() == static_cast<std::size_t>(N * E),
                     "route: sampled choices need Gumbel noise for each of the ", N, " x ", E,
                     " logits, got ", draws.gumbel.size());
  Routing<A> r;
  r.tokens = N;
  r.k = k;
  r.experts = E;
  r.capacity = cfg.capacity(N, draws.training);
  const auto n = static_cast<std::size_t>(N);
  r.expert.assign(n * static_cast<std::size_t>(k), 0);
  r.slot.assign(r.expert.size(), -1);
  r.prob.assign(r.expert.size(), A(0));
  r.weight.assign(r.expert.size(), A(0));
  r.kept.assign(static_cast<std::size_t>(E), 0);
  r.probs.assign(n * static_cast<std::size_t>(E), A(0));
  r.lse.assign(n, A(0));
  r.first_choice_share.assign(static_cast<std::size_t>(E), A(0));
  for (std::int64_t t = 0; t < N; ++t) {
    const A* l = logits + t * E;
    A* p = r.probs.data() + t * E;
    A max = l[0];
    for (int e = 1; e < E; ++e) max = std::max(max, l[e]);
    A sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - max));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    r.lse[static_cast<std::size_t>(t)] = max + std::log(sum);
    // A sampled choice (RSample's first, or top-2's second) by the logits plus Gumbel noise;
    // the others by probability.
    const double* noise = sampled ? draws.gumbel.data() + t * E : nullptr;
    for (int j = 0; j < k; ++j) {
      const bool by_noise = sampled && j == k - 1;
      const auto score = [&](int e) {
        return by_noise ? static_cast<double>(l[e]) + noise[e] : static_cast<double>(p[e]);
      };
      int best = -1;
      for (int e = 0; e < E; ++e) {
        if (j == 1 && e == r.expert[r.at(t, 0)]) continue;
        if (best < 0 || score(e) > score(best)) best = e;
      }
      r.expert[r.at(t, j)] = best;
      r.prob[r.at(t, j)] = p[best];
    }
  }
  // Random token selection: each expert over capacity keeps its choices of the highest
  // priority (ties: the lower token), marked here; the others are dropped below.
  std::vector<char> chosen;
  if (cfg.random_token_selection) {
    chosen.assign(n, 1);
    std::vector<std::int64_t> by_expert;
    for (int e = 0; e < E; ++e) {
      by_expert.clear();
      for (std::int64_t t = 0; t < N; ++t) {
        if (r.expert[r.at(t, 0)] == e) by_expert.push_back(t);
      }
      if (static_cast<std::int64_t>(by_expert.size()) <= r.capacity) continue;
      const auto kept_end = by_expert.begin() + r.capacity;
      std::nth_element(by_expert.begin(), kept_end, by_expert.end(),
                       [&](std::int64_t a, std::int64_t b) {
                         const double pa = priority[static_cast<std::size_t>(a)];
                         const double pb = priority[static_cast<std::size_t>(b)];
                         return pa > pb || (pa == pb && a < b);
                       });
      for (auto it = kept_end; it != by_expert.end(); ++it)
        chosen[static_cast<std::size_t>(*it)] = 0;
    }
  }
  // Slots in token order, first choices before second choices; counted whether kept or not.
  std::vector<std::int64_t> taken(static_cast<std::size_t>(E), 0);
  for (int j = 0; j < k; ++j) {
    for (std::int64_t t = 0; t < N; ++t) {
      const auto e = static_cast<std::size_t>(r.expert[r.at(t, j)]);
      const bool selected = chosen.empty() || chosen[static_cast<std::size_t>(t)] != 0;
      const std::int64_t position = selected ? taken[e]++ : r.capacity;
      if (position < r.capacity) {
        r.slot[r.at(t, j)] = position;
        ++r.kept[e];
      } else {
        ++r.dropped;
      }
    }
  }
  for (std::int64_t t = 0; t < N; ++t) {
    if (k == 1) {
      if (r.slot[r.at(t, 0)] >= 0) r.weight[r.at(t, 0)] = r.prob[r.at(t, 0)];
      continue;
    }
    A g[2];
    for (int j = 0; j < 2; ++j) g[j] = r.slot[r.at(t, j)] >= 0 ? r.prob[r.at(t, j)] : A(0);
    const A denominator = std::max(g[0] + g[1], std::numeric_limits<A>::epsilon());
    for (int j = 0; j < 2; ++j) r.weight[r.at(t, j)] = g[j] / denominator;
  }
  // The auxiliary losses.
  for (std::int64_t t = 0; t < N; ++t) {
    r.first_choice_share[static_cast<std::size_t>(r.expert[r.at(t, 0)])] += A(1);
  }
  A balance = 0, z = 0;
  // No tokens (an empty micro-batch on an ep rank that still joins the all-to-alls): no
  // balance term, rather than 0/0.
  for (int e = 0; e < E && N > 0; ++e) {
    A me = 0;
    for (std::int64_t t = 0; t < N; ++t) me += r.probs[static_cast<std::size_t>(t * E + e)];
    me /= static_cast<A>(N);
    r.first_choice_share[static_cast<std::size_t>(e)] /= static_cast<A>(N);
    balance += me * r.first_choice_share[static_cast<std::size_t>(e)];
  }
  for (const A v : r.lse) z += v * v;
  r.aux_loss = static_cast<A>(E) * balance;
  r.z_loss = N > 0 ? z / static_cast<A>(N) : A(0);
  return r;
}

/// Adds into dlogits [N, E] the gradient of the logits, from dweight [N * k] (the loss's
/// gradient with respect to each choice's combine weight) and the auxiliary losses weighted by
/// cfg's coefficients times seed (the loss's own gradient seed: the loss scale).
template <class A>
void router_backward(A* dlogits, const Routing<A>& r, const A* dweight, const RouterConfig& cfg,
                     A seed) {
  const int E = r.experts, k = r.k;
  const std::int64_t N = r.tokens;
  std::vector<A> dp(static_cast<std::size_t>(E));
  const A aux = seed * static_cast<A>(cfg.aux_loss_coef) * static_cast<A>(E) / static_cast<A>(N);
  const A zc = seed * static_cast<A>(cfg.z_loss_coef) * A(2) / static_cast<A>(N);
  for (std::int64_t t = 0; t < N; ++t) {
    const A* p = r.probs.data() + t * E;
    // The load-balancing loss through me (ce counts choices: no gradient).
    for (int e = 0; e < E; ++e) dp[static_cast<std::size_t>(e)] = aux * r.first_choice_share[e];
    if (k == 1) {
      if (r.slot[r.at(t, 0)] >= 0) dp[r.expert[r.at(t, 0)]] += dweight[r.at(t, 0)];
    } else {
      A g[2];
      for (int j = 0; j < 2; ++j) g[j] = r.slot[r.at(t, j)] >= 0 ? r.prob[r.at(t, j)] : A(0);
      const A s = g[0] + g[1];
      const A dw0 = dweight[r.at(t, 0)], dw1 = dweight[r.at(t, 1)];
      for (int j = 0; j < 2; ++j) {
        if (r.slot[r.at(t, j)] < 0) continue;
        const A dw = j == 0 ? dw0 : dw1;
        // w_j = g_j / s (s above epsilon; below it the denominator is a constant).
        const A dg = s > std::numeric_limits<A>::epsilon()
                         ? dw / s - (dw0 * g[0] + dw1 * g[1]) / (s * s)
                         : dw / std::numeric_limits<A>::epsilon();
        dp[static_cast<std::size_t>(r.expert[r.at(t, j)])] += dg;
      }
    }
    // Through the softmax, plus the z-loss's d(lse^2)/dlogits = 2 lse p.
    A dot = 0;
    for (int e = 0; e < E; ++e) dot += dp[static_cast<std::size_t>(e)] * p[e];
    const A z = zc * r.lse[static_cast<std::size_t>(t)];
    for (int e = 0; e < E; ++e) {
      dlogits[t * E + e] += p[e] * (dp[static_cast<std::size_t>(e)] - dot) + z * p[e];
    }
  }
}

}  // namespace zero::nn
