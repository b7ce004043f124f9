#pragma once
// Shared by the tensor-parallel engine tests: a GPT small enough for tp 4 (4 heads), the
// parameters of a rank as parts of logical tensors, their assembly into whole tensors, and an
// f64 AdamW the reference and the engines both run (elementwise, so it updates any shard).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <optim/grad_norm.hpp>
#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/param.hpp>

#include "../support/worse.hpp"
#include "engine_test_util.hpp"

namespace zero::test {

inline nn::GPTConfig tp_tiny() {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");  // V 64, C 16, T <= 16
  c.num_layers = 2;
  c.num_heads = 4;
  return c;
}

/// One parameter as a rank holds it.
struct HeldParam {
  std::string name;
  nn::ParamSpec spec;  // where its values lie in the logical tensor (ParamSpec::for_each_run)
  std::vector<double> values;
};

/// name -> the whole tensor's values.
using LogicalValues = std::map<std::string, std::vector<double>>;

/// The parameters of a rank: the values of unit u come flat in spec order.
template <class Eng>
std::vector<HeldParam> held_params(Eng& eng) {
  std::vector<HeldParam> out;
  for (int u = 0; u < eng.num_units(); ++u) {
    const auto values = eng.gather_unit_values(u);
    std::size_t offset = 0;
    for (const nn::ParamSpec& p : eng.unit_specs(u)) {
      const auto n = static_cast<std::size_t>(p.numel());
      out.push_back(
          {p.name, p,
           std::vector<double>(values.begin() + static_cast<std::ptrdiff_t>(offset),
                               values.begin() + static_cast<std::ptrdiff_t>(offset + n))});
      offset += n;
    }
  }
  return out;
}

/// Whole tensors from every rank's parts; copies of an element held by several ranks (a
/// parameter whole on every tp rank, the same experts on every expert data-parallel rank) must
/// agree exactly, else the largest disagreement is returned in copies_differ.
inline LogicalValues assemble(const std::vector<std::vector<HeldParam>>& ranks,
                              double* copies_differ = nullptr) {
  LogicalValues out;
  std::map<std::string, std::vector<bool>> filled;
  double differ = 0;
  for (const auto& rank : ranks) {
    for (const HeldParam& p : rank) {
      const auto n = static_cast<std::size_t>(p.spec.logical_shape().numel());
      std::vector<double>& whole = out.try_emplace(p.name, n, 0.0).first->second;
      std::vector<bool>& seen = filled.try_emplace(p.name, n, false).first->second;
      p.spec.for_each_run(0, static_cast<std::int64_t>(p.values.size()),
                          [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
                            for (std::int64_t k = 0; k < count; ++k) {
                              const auto at = static_cast<std::size_t>(logical + k);
                              const double v = p.values[static_cast<std::size_t>(held + k)];
                              if (seen[at]) differ = std::max(differ, std::fabs(whole[at] - v));
                              whole[at] = v;
                              seen[at] = true;
                            }
                          });
    }
  }
  if (copies_differ != nullptr) *copies_differ = differ;
  return out;
}

/// The whole tensors of a single-process model's parameters (nn::LocalParameters).
template <class Params>
LogicalValues values_of(Params& params, int num_units) {
  LogicalValues out;
  for (int u = 0; u < num_units; ++u) {
    const auto values = params.unit_values(u);
    std::size_t offset = 0;
    for (const nn::ParamSpec& p : params.unit_specs(u)) {
      out[p.name].assign(values.begin() + static_cast<std::ptrdiff_t>(offset),
                         values.begin() + static_cast<std::ptrdiff_t>(offset + p.numel()));
      offset += static_cast<std::size_t>(p.numel());
    }
  }
  return out;
}

/// Largest difference between two sets of whole tensors (infinity when the names or sizes differ).
inline double max_difference(const LogicalValues& a, const LogicalValues& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0;
  for (const auto& [name, values] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != values.size()) return INFINITY;
    for (std::size_t i = 0; i < values.size(); ++i) {
      w = zero::testing::worse(w, std::fabs(values[i] - it->second[i]));
    }
  }
  return w;
}

/// f64 AdamW (bias-corrected, decoupled decay on every element), its moments kept per unit.
struct AdamW64 {
  double lr = 0.01, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  std::map<int, std::vector<double>> m, v;
  std::map<int, int> steps;

  void operator()(int u, std::span<double> p, std::span<const double> g) {
    auto& mu = m[u];
    auto& nu = v[u];
    mu.resize(p.size(), 0.0);
    nu.resize(p.size(), 0.0);
    const int t = ++steps[u];
    const double c1 = 1 - std::pow(beta1, t), c2 = 1 - std::pow(beta2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      mu[i] = beta1 * mu[i] + (1 - beta1) * g[i];
      nu[i] = beta2 * nu[i] + (1 - beta2) * g[i] * g[i];
      p[i] -= lr * (mu[i] / c1 / (std::sqrt(nu[i] / c2) + eps) + weight_decay * p[i]);
    }
  }
};

/// Largest difference between this rank's parts and the same parts of whole tensors (a rank
/// checks itself, no assembly needed: MPI tests).
inline double max_part_difference(const std::vector<HeldParam>& held, const LogicalValues& want) {
  double w = 0;
  for (const HeldParam& p : held) {
    const auto it = want.find(p.name);
    if (it == want.end()) return INFINITY;
    p.spec.for_each_run(0, static_cast<std::int64_t>(p.values.size()),
                        [&](std::int64_t logical, std::int64_t at, std::int64_t count) {
                          for (std::int64_t k = 0; k < count; ++k) {
                            w = zero::testing::worse(
                                w, std::fabs(p.values[static_cast<std::size_t>(at + k)] -
                                             it->second[static_cast<std::size_t>(logical + k)]));
                          }
                        });
  }
  return w;
}

inline constexpr double clip = 0.05;  // small enough to clip every step of the tiny model

// One process on the global batch: `steps` AdamW steps with clipping; the whole tensors.
template <class T>
LogicalValues reference(const nn::GPTConfig& cfg, std::int64_t global_rows, int steps) {
  AdamW64 adam;
  std::vector<std::vector<nn::ParamSpec>> specs;
  const auto units = reference_run<T>(
      global_rows, steps, clip,
      [&](int u, std::span<T> p, std::span<T> g, const std::vector<nn::ParamSpec>& unit_specs,
          double coefficient) {
        for (T& x : g) x = static_cast<T>(x * coefficient);
        adam(u, p, std::span<const T>(g));
        if (specs.size() <= static_cast<std::size_t>(u)) specs.resize(u + 1);
        specs[u] = unit_specs;
      },
      cfg);
  LogicalValues out;
  for (std::size_t u = 0; u < units.size(); ++u) {
    std::size_t offset = 0;
    for (const nn::ParamSpec& p : specs[u]) {
      out[p.name].assign(units[u].begin() + offset, units[u].begin() + offset + p.numel());
      offset += static_cast<std::size_t>(p.numel());
    }
  }
  return out;
}

// The engine options of the f64 tensor-parallel runs (clipping active, every unit sharded).
inline engine::EngineOptions tp_options(int accumulation) {
  engine::EngineOptions options;
  options.gradient_accumulation_steps = accumulation;
  options.activation_bytes = 32 << 20;
  options.gradient_clipping = clip;
  options.persistence_threshold = 0;
  options.seed = 1234;
  return options;
}

// Trains `steps` boundaries of `accumulation` micro-steps on this rank of a (tp, dp) grid; placed:
// the micro-batches say where their rows sit (GlobalBatch::micro).
template <class Eng>
void train(Eng& eng, int dp_rank, int dp, int accumulation, int steps, std::int64_t vocab,
           int first_step = 0, bool placed = false) {
  const std::int64_t global_rows = micro_rows * accumulation * dp;
  for (int step = first_step; step < first_step + steps; ++step) {
    const GlobalBatch b(global_rows, step, vocab);
    for (int m = 0; m < accumulation; ++m) {
      eng.forward(b.micro(m, dp_rank, dp, placed));
      eng.backward();
      eng.step();
    }
  }
}

}  // namespace zero::test
