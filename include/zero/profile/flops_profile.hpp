#pragma once
// FlopsProfile: DeepSpeed's flops profiler report for a zero engine: per unit and for the whole
// model, the parameters, the forward MACs and FLOPs (as the model's layers count them,
// nn/flops.hpp), the measured forward and backward latency (the engine's StepTimers) and the
// achieved FLOP/s, with DeepSpeed's summary lines (world size, data/model parallel sizes, batch
// per rank, params per rank, fwd MACs/FLOPs per rank, fwd/bwd/step latency, FLOPS per rank), its
// aggregated top-modules table and detailed tree, and as one JSON object. Depth 0 is the model,
// depth 1 its units. A model whose units do not report FLOPs (no unit_forward_flops, or a layer
// without forward_flops) shows "n/a" for them.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/config/observability.hpp>
#include <zero/nn/flops.hpp>
#include <zero/nn/param.hpp>
#include <zero/profile/format.hpp>
#include <zero/profile/step_timers.hpp>

namespace zero::profile {

/// One unit's line of the profile.
struct UnitProfile {
  int unit = 0;
  std::string name;                      ///< the common prefix of its parameter names
  std::int64_t params = 0;               ///< parameters it owns
  std::optional<nn::FlopCount> forward;  ///< one micro-batch's forward; empty: unknown
  double forward_s = 0;                  ///< mean forward latency per micro-step
  double backward_s = 0;                 ///< mean backward latency per micro-step
};

/// The profile of one optimizer step on one rank (see the file comment).
struct FlopsProfile {
  std::int64_t step = 0;  ///< the profiled optimizer step (1-based)
  int world_size = 1, dp_size = 1, mp_size = 1;
  std::int64_t batch_per_rank = 0;       ///< rows of one micro-batch on this rank
  std::int64_t micro_steps = 1;          ///< micro-steps of the profiled step (accumulation)
  std::int64_t params_per_rank = 0;      ///< parameters the rank computes with
  std::optional<nn::FlopCount> forward;  ///< one micro-batch's forward on this rank
  double forward_s = 0, backward_s = 0;  ///< mean latency per micro-step
  double step_s = 0;                     ///< the optimizer step
  std::vector<UnitProfile> units;

  /// fwd + bwd of every micro-step, plus the optimizer step.
  double iter_s() const {
    return static_cast<double>(micro_steps) * (forward_s + backward_s) + step_s;
  }

  /// DeepSpeed's text report (summary; aggregated table to module_depth with top_modules per
  /// depth; the detailed per-unit tree when detailed).
  std::string report(const config::FlopsProfilerConfig& cfg) const {
    std::string out;
    out += "-------------------------- zero Flops Profiler --------------------------\n";
    out += "Profile Summary at step " + std::to_string(step) + ":\n";
    out +=
        "Notations:\ndata parallel size (dp_size), model parallel size (mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations (MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),\nfwd latency (forward propagation latency), bwd latency (backward "
        "propagation latency),\nstep (weights update latency), iter latency (sum of fwd, bwd "
        "and step latency)\n\n";
    const auto flops = [&](auto f) { return forward ? f(*forward) : std::string("n/a"); };
    const double fwd_flops = forward ? static_cast<double>(forward->flops) : 0.0;
    out += summary_line("world size", std::to_string(world_size));
    out += summary_line("data parallel size", std::to_string(dp_size));
    out += summary_line("model parallel size", std::to_string(mp_size));
    out += summary_line("batch size per rank", std::to_string(batch_per_rank));
    out += summary_line("params per rank", with_prefix(static_cast<double>(params_per_rank)));
    out += summary_line("params of model = params per rank * mp_size",
                        with_prefix(static_cast<double>(params_per_rank * mp_size)));
    out += summary_line("fwd MACs per rank", flops([](const nn::FlopCount& f) {
                          return with_prefix(static_cast<double>(f.macs), "MACs");
                        }));
    out += summary_line("fwd flops per rank", flops([](const nn::FlopCount& f) {
                          return with_prefix(static_cast<double>(f.flops));
                        }));
    out += summary_line("fwd flops of model = fwd flops per rank * mp_size",
                        flops([&](const nn::FlopCount& f) {
                          return with_prefix(static_cast<double>(f.flops * mp_size));
                        }));
    out += summary_line("fwd latency", latency(forward_s));
    out += summary_line("fwd FLOPS per rank = fwd flops per rank / fwd latency",
                        forward ? rate(fwd_flops, forward_s) : "n/a");
    out += summary_line("bwd latency", latency(backward_s));
    out += summary_line("bwd FLOPS per rank = 2 * fwd flops per rank / bwd latency",
                        forward ? rate(2 * fwd_flops, backward_s) : "n/a");
    out += summary_line("fwd+bwd FLOPS per rank = 3 * fwd flops per rank / (fwd+bwd latency)",
                        forward ? rate(3 * fwd_flops, forward_s + backward_s) : "n/a", 70);
    out += summary_line("step latency", latency(step_s));
    out += summary_line("iter latency", latency(iter_s()));
    out += summary_line(
        "samples/second",
        iter_s() > 0 ? fixed(static_cast<double>(batch_per_rank * micro_steps * dp_size) / iter_s())
                     : "n/a");
    out +=
        "\n----------------------------- Aggregated Profile per rank "
        "-----------------------------\n";
    out += "Top " + std::to_string(cfg.top_modules) +
           " modules in terms of params, MACs or fwd latency at different model depths:\n";
    out += "depth 0:\n";
    out += "    params      - {'model': '" + with_prefix(static_cast<double>(params_per_rank)) +
           "'}\n";
    out += "    MACs        - {'model': '" + flops([](const nn::FlopCount& f) {
             return with_prefix(static_cast<double>(f.macs), "MACs");
           }) +
           "'}\n";
    out += "    fwd latency - {'model': '" + latency(forward_s) + "'}\n";
    if (cfg.module_depth < 0 || cfg.module_depth >= 1) {
      out += "depth 1:\n";
      out +=
          "    params      - " +
          top(
              cfg.top_modules, [](const UnitProfile& u) { return static_cast<double>(u.params); },
              [](const UnitProfile& u) { return with_prefix(static_cast<double>(u.params)); });
      out += "    MACs        - " +
             top(
                 cfg.top_modules,
                 [](const UnitProfile& u) {
                   return u.forward ? static_cast<double>(u.forward->macs) : -1.0;
                 },
                 [](const UnitProfile& u) {
                   return u.forward ? with_prefix(static_cast<double>(u.forward->macs), "MACs")
                                    : std::string("n/a");
                 });
      out += "    fwd latency - " + top(
                                        cfg.top_modules,
                                        [](const UnitProfile& u) { return u.forward_s; },
                                        [](const UnitProfile& u) { return latency(u.forward_s); });
    }
    if (cfg.detailed) {
      out +=
          "\n------------------------------ Detailed Profile per rank "
          "------------------------------\n";
      out +=
          "Each module profile is listed after its name in the following order:\n"
          "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
          "percentage of total fwd latency, fwd FLOPS, bwd latency\n\n";
      out += "model(" + detail(params_per_rank, forward, forward_s, backward_s) + ")\n";
      for (const UnitProfile& u : units) {
        out += "  (" + std::to_string(u.unit) + "): " + u.name + "(" +
               detail(u.params, u.forward, u.forward_s, u.backward_s) + ")\n";
      }
    }
    out += "------------------------------------------------------------------------------\n";
    return out;
  }

  /// The profile as one JSON object (FLOP counts null where unknown).
  nlohmann::json to_json() const {
    auto counts = [](const std::optional<nn::FlopCount>& f) {
      return f ? nlohmann::json{{"macs", f->macs}, {"flops", f->flops}} : nlohmann::json(nullptr);
    };
    auto per_s = [](const std::optional<nn::FlopCount>& f, double factor, double s) {
      return f && s > 0 ? nlohmann::json(factor * static_cast<double>(f->flops) / s)
                        : nlohmann::json(nullptr);
    };
    nlohmann::json j = {{"step", step},
                        {"world_size", world_size},
                        {"dp_size", dp_size},
                        {"mp_size", mp_size},
                        {"batch_per_rank", batch_per_rank},
                        {"micro_steps", micro_steps},
                        {"params_per_rank", params_per_rank},
                        {"fwd", counts(forward)},
                        {"fwd_latency_s", forward_s},
                        {"bwd_latency_s", backward_s},
                        {"step_latency_s", step_s},
                        {"iter_latency_s", iter_s()},
                        {"fwd_flops_per_s", per_s(forward, 1, forward_s)},
                        {"bwd_flops_per_s", per_s(forward, 2, backward_s)},
                        {"fwd_bwd_flops_per_s", per_s(forward, 3, forward_s + backward_s)}};
    j["units"] = nlohmann::json::array();
    for (const UnitProfile& u : units) {
      j["units"].push_back({{"unit", u.unit},
                            {"name", u.name},
                            {"params", u.params},
                            {"fwd", counts(u.forward)},
                            {"fwd_latency_s", u.forward_s},
                            {"bwd_latency_s", u.backward_s},
                            {"fwd_flops_per_s", per_s(u.forward, 1, u.forward_s)}});
    }
    return j;
  }

 private:
  static std::string rate(double flops, double seconds) {
    return seconds > 0 ? with_prefix(flops / seconds, "FLOPS") : "n/a";
  }
  static std::string fixed(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return buf;
  }
  static std::string percent(double part, double whole) {
    return whole > 0 ? fixed(100.0 * part / whole) + "%" : "n/a";
  }
  template <class Key, class Show>
  std::string top(std::int64_t n, Key key, Show show) const {
    std::vector<const UnitProfile*> order;
    for (const UnitProfile& u : units) order.push_back(&u);
    std::stable_sort(order.begin(), order.end(),
                     [&](const UnitProfile* a, const UnitProfile* b) { return key(*a) > key(*b); });
    std::string out = "{";
    for (std::size_t i = 0; i < order.size() && static_cast<std::int64_t>(i) < n; ++i) {
      out += (i ? ", '" : "'") + order[i]->name + "': '" + show(*order[i]) + "'";
    }
    return out + "}\n";
  }
  std::string detail(std::int64_t params, const std::optional<nn::FlopCount>& f, double fwd_s,
                     double bwd_s) const {
    std::string s = with_prefix(static_cast<double>(params)) + ", " +
                    percent(static_cast<double>(params), static_cast<double>(params_per_rank));
    if (f && forward) {
      s += ", " + with_prefix(static_cast<double>(f->macs), "MACs") + ", " +
           percent(static_cast<double>(f->macs), static_cast<double>(forward->macs));
    } else {
      s += ", n/a MACs, n/a";
    }
    s += ", " + latency(fwd_s) + ", " + percent(fwd_s, forward_s) + ", " +
         (f ? rate(static_cast<double>(f->flops), fwd_s) : std::string("n/a FLOPS")) + ", " +
         latency(bwd_s);
    return s;
  }
};

/// The longest common prefix of a unit's parameter names cut back to a '.' ("transformer.h.3",
/// "transformer.ln_f" for ln_f.weight and ln_f.bias), or "unit <u>" when there is none.
inline std::string unit_name(const std::vector<nn::ParamSpec>& specs, int u) {
  std::string prefix = specs.empty() ? std::string() : specs.front().name;
  for (const nn::ParamSpec& s : specs) {
    std::size_t n = 0;
    while (n < prefix.size() && n < s.name.size() && prefix[n] == s.name[n]) ++n;
    prefix.resize(n);
  }
  const std::size_t dot = prefix.rfind('.');
  return dot == std::string::npos || dot == 0 ? "unit " + std::to_string(u) : prefix.substr(0, dot);
}

/// Builds the profile of the step the engine's timers covered (enable and reset them before
/// the step, read after it): parameters from the engine's units, FLOPs from model's
/// unit_forward_flops where it has one (its last forward), latencies from engine.timers().
/// sample_ranks: the engine's ranks that read different samples (EngineGroups::sample_ranks:
/// Ulysses' sp ranks share theirs), the dp_size of samples/second; 0: every rank of its group.
template <class Engine, class Model>
FlopsProfile collect_flops_profile(const Engine& engine, const Model& model, std::int64_t step,
                                   std::int64_t batch_per_rank, int mp_size = 1,
                                   int sample_ranks = 0) {
  const StepTimers& t = engine.timers();
  FlopsProfile p;
  p.step = step;
  p.dp_size = sample_ranks > 0 ? sample_ranks : engine.world_size();
  p.mp_size = mp_size;
  p.world_size = engine.world_size() * mp_size;
  p.batch_per_rank = batch_per_rank;
  p.micro_steps = std::max<std::int64_t>(1, t.micro_steps());
  const auto per_micro = [&](double s) { return s / static_cast<double>(p.micro_steps); };
  p.forward_s = per_micro(t.seconds(Phase::forward));
  p.backward_s = per_micro(t.seconds(Phase::backward));
  p.step_s = t.seconds(Phase::step);
  bool all_known = true;
  nn::FlopCount total;
  for (int u = 0; u < engine.num_units(); ++u) {
    UnitProfile up;
    up.unit = u;
    up.name = unit_name(engine.unit_specs(u), u);
    for (const nn::ParamSpec& s : engine.unit_specs(u)) up.params += s.numel();
    if constexpr (requires { model.unit_forward_flops(u); }) {
      up.forward = model.unit_forward_flops(u);
    }
    if (up.forward) {
      total += *up.forward;
    } else {
      all_known = false;
    }
    up.forward_s = per_micro(t.unit_forward_s(u));
    up.backward_s = per_micro(t.unit_backward_s(u));
    p.params_per_rank += up.params;
    p.units.push_back(std::move(up));
  }
  if (all_known) p.forward = total;
  return p;
}

}  // namespace zero::profile
