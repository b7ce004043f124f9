#pragma once
// Shared by the mixture-of-experts engine tests (LocalComm and MpiComm): a GPT with one MoE
// block small enough for ep 4, and its single-process reference.
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>

#include <optim/grad_norm.hpp>
#include <parallel/moe/expert_parallel.hpp>
#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/moe/moe_blocks.hpp>

#include "engine_test_util.hpp"
#include "tp_test_util.hpp"

namespace zero::test {

// Two blocks, the second an MoE block of 4 experts, top-2 with a capacity that drops tokens,
// both auxiliary losses on.
inline nn::GPTConfig moe_cfg() {
  return tp_tiny();
}
inline nn::MoEBlocks moe_blocks(parallel::ExpertParallel ep = {}) {
  nn::MoEBlocks m;
  m.router.num_experts = 4;
  m.router.k = 2;
  m.router.capacity_factor = 0.75;
  m.router.min_capacity = 1;
  m.router.aux_loss_coef = 0.01;
  m.router.z_loss_coef = 0.001;
  m.every = 2;
  m.ep = std::move(ep);
  return m;
}

// Four blocks, the second and the fourth MoE: every stage of pp 2 holds one MoE block, and the
// 6 unit groups fill pp 2 x 2 virtual stages or pp 4.
inline nn::GPTConfig moe_pipe_cfg() {
  nn::GPTConfig c = moe_cfg();
  c.num_layers = 4;
  return c;
}

// Routing that does not depend on which of a sequence's positions a rank holds: no capacity
// limit, and no load-balancing loss (a product of two means over the rank's tokens); the router
// z-loss, a mean over tokens, stays on. Under Ulysses each rank routes its T/sp positions, so
// only such routing can equal one process routing whole sequences.
inline nn::MoEBlocks dropless_blocks(parallel::ExpertParallel ep = {}) {
  nn::MoEBlocks m = moe_blocks(std::move(ep));
  m.router.drop_tokens = false;
  m.router.aux_loss_coef = 0;
  return m;
}

// Top-1 routing with random token selection (DeepSpeed's use_rts) and the same capacity: an
// expert over capacity keeps random tokens, drawn from each token's global row in the step's
// stream, so the ranks draw as one process does.
inline nn::MoEBlocks rts_blocks(parallel::ExpertParallel ep = {}) {
  nn::MoEBlocks m = moe_blocks(std::move(ep));
  m.router.k = 1;
  m.router.capacity_factor = 0.5;
  m.router.random_token_selection = true;
  return m;
}

// DeepSpeed's noisy gate: top-2 with the second choice sampled by Gumbel noise and jitter on the
// router's input (both drawn, as random token selection, from the tokens' global rows).
inline nn::MoEBlocks noisy_blocks(parallel::ExpertParallel ep = {}) {
  nn::MoEBlocks m = moe_blocks(std::move(ep));
  m.router.noise = nn::GateNoise::jitter;
  m.router.second_expert_sampling = true;
  return m;
}

// One process: each of the world * accumulation micro-batches of a step in turn (routing and
// capacity are per micro-batch, as on the ranks), gradients summed with the loss seeded by
// 1 / (world * accumulation), then the global norm, clipping and f64 AdamW per unit (cfg and
// blocks: the GPT's shape and MoE blocks, moe_cfg()'s and moe_blocks()' by default; placed: the
// micro-batches say where their rows sit, MicroBatch::first_row).
inline LogicalValues moe_reference(int world, int accumulation, int steps, std::int64_t* dropped,
                                   const nn::GPTConfig& cfg = moe_cfg(),
                                   const nn::MoEBlocks& blocks = moe_blocks(),
                                   bool placed = false) {
  nn::GPT<double> model(cfg, {}, {}, blocks);
  nn::LocalParameters<nn::GPT<double>> params(model, 1234);
  AdamW64 adam;
  Arena<> arena(32 << 20);
  const int micros = world * accumulation;
  *dropped = 0;
  for (int step = 0; step < steps; ++step) {
    params.zero_grads();
    const GlobalBatch b(micro_rows * micros, step, cfg.vocab_size);
    for (int m = 0; m < micros; ++m) {
      // Micro-batch m of GlobalBatch: micro-step m / world of rank m % world.
      // The engine's stream for dropout and random token selection (Engine::rng_step_of): the
      // step for micro-batches placed in the global batch, else the micro-step of the run.
      const auto stream =
          static_cast<std::uint64_t>(placed ? step : step * accumulation + m / world);
      nn::StepContext<double> ctx =
          b.micro(m / world, m % world, world, placed).context<double>(arena, true, stream);
      ctx.seed = 1234;  // the engine's (tp_options): the streams' key
      ctx.loss_scale = 1.0 / micros;
      model.forward(ctx);
      model.backward(ctx);
      *dropped += model.moe_stats().dropped;
      arena.reset();
    }
    double sq = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      for (double g : params.unit_grads(u)) sq += g * g;
    }
    const double coefficient = optim::clip_coefficient(std::sqrt(sq), clip);
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u).span();
      for (double& x : g) x *= coefficient;
      adam(u, params.unit_values(u).span(), std::span<const double>(g));
    }
  }
  return values_of(params, model.num_units());
}

}  // namespace zero::test
