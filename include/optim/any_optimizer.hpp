#pragma once
// AnyOptimizer: one of zero's flat-shard optimizers chosen at run time from a DeepSpeed
// "optimizer" block ({"type": "AdamW", "params": {"lr": ..., "betas": [..], ...}}), over one
// shard with a no-weight-decay mask (biases and norm weights). DeepSpeed's conventions:
//   "Adam" is decoupled (AdamW) unless params.adam_w_mode is false (DeepSpeed's FusedAdam);
//   "LAMB" is FusedLamb's update (bias corrections in the step size) and clamps the trust
//   ratio to [min_coeff, max_coeff];
//   a key left out takes the default of DeepSpeed's optimizer of that type (Lion: lr 1e-3,
//   betas 0.9/0.999, as FusedLion);
//   every other key of params must belong to the chosen type (a typo is an error, not ignored).

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <optim/adagrad.hpp>
#include <optim/adam.hpp>
#include <optim/lamb.hpp>
#include <optim/lion.hpp>
#include <optim/param_groups.hpp>
#include <optim/rmsprop.hpp>
#include <optim/sgd.hpp>
#include <zero/config/config.hpp>

namespace zero::optim {

/// Any of the flat-shard optimizers, picked from a config block.
class AnyOptimizer {
 public:
  using Variant = std::variant<Sgd, Adam, AdamW, Lion, Lamb, Rmsprop, Adagrad>;

  /// Builds spec's optimizer over numel elements. no_decay_mask (numel bytes, or empty) marks
  /// the elements that get no weight decay; tensors lists the parameter ranges (LAMB's trust
  /// ratio is per tensor) and whole, when given, the whole tensor of whole_count split over
  /// ranks each range is a part of (Lamb's constructor). ConfigError names
  /// "optimizer.params.<key>" for a bad value.
  static AnyOptimizer from_config(const NamedParams& spec, std::size_t numel,
                                  std::span<const std::uint8_t> no_decay_mask,
                                  std::vector<Range> tensors = {},
                                  std::vector<std::size_t> whole = {},
                                  std::size_t whole_count = 0) {
    const Reader r(spec);
    const double lr = r.number("lr", 1e-3);
    const double wd = r.number("weight_decay", 0.0);
    auto groups = [&]<class H>(H decay) {
      H no_decay = decay;
      no_decay.weight_decay = 0.0;
      if (no_decay_mask.empty()) return single_group(numel, decay);
      expect<ConfigError>(no_decay_mask.size() == numel, "AnyOptimizer: mask has ",
                          no_decay_mask.size(), " bytes for a shard of ", numel, " elements");
      return groups_from_mask(no_decay_mask, decay, no_decay);
    };
    const std::string& type = spec.type;
    if (type == "Adam" || type == "AdamW") {
      AdamHyper h;
      h.lr = lr;
      h.weight_decay = wd;
      r.betas(h.beta1, h.beta2);
      h.eps = r.number("eps", 1e-8);
      const bool decoupled = type == "AdamW" || r.flag("adam_w_mode", true);
      r.only({"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "torch_adam",
              "amsgrad"});
      r.flag("torch_adam", false);  // which implementation; the update is the same
      expect<ConfigError>(r.flag("bias_correction", true),
                          "optimizer.params.bias_correction: false is not supported");
      expect<ConfigError>(!r.flag("amsgrad", false),
                          "optimizer.params.amsgrad: true is not supported");
      if (decoupled) return AnyOptimizer(AdamW(numel, groups(h)));
      return AnyOptimizer(Adam(numel, groups(h)));
    }
    if (type == "SGD") {
      SgdHyper h;
      h.lr = lr;
      h.weight_decay = wd;
      SgdOptions o;
      o.momentum = r.number("momentum", 0.0);
      o.dampening = r.number("dampening", 0.0);
      o.nesterov = r.flag("nesterov", false);
      r.only({"lr", "weight_decay", "momentum", "dampening", "nesterov"});
      return AnyOptimizer(Sgd(numel, groups(h), o));
    }
    if (type == "Lion") {
      LionHyper h;
      h.lr = r.number("lr", 1e-3);  // FusedLion's and DeepSpeedCPULion's defaults
      h.weight_decay = wd;
      r.betas(h.beta1, h.beta2);
      r.only({"lr", "betas", "weight_decay"});
      return AnyOptimizer(Lion(numel, groups(h)));
    }
    if (type == "LAMB") {
      LambHyper h;
      h.lr = lr;
      h.weight_decay = r.number("weight_decay", 0.0);
      r.betas(h.beta1, h.beta2);
      h.eps = r.number("eps", 1e-8);
      h.max_trust = r.number("max_coeff", 10.0);
      h.min_trust = r.number("min_coeff", 0.01);
      h.corrections_in_step_size = true;  // FusedLamb's update, which the config names
      r.only({"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "bias_correction",
              "max_grad_norm"});
      // Accepted so DeepSpeed's FusedLamb configs load, but only at what zero does anyway.
      expect<ConfigError>(r.flag("bias_correction", true),
                          "optimizer.params.bias_correction: false is not supported");
      expect<ConfigError>(r.number("max_grad_norm", 0.0) == 0.0,
                          "optimizer.params.max_grad_norm: FusedLamb's own clipping is not "
                          "supported; set gradient_clipping (the engine clips before any "
                          "optimizer)");
      return AnyOptimizer(
          Lamb(numel, groups(h), std::move(tensors), std::move(whole), whole_count));
    }
    if (type == "RMSprop") {
      RmspropHyper h;
      h.lr = r.number("lr", 1e-2);
      h.weight_decay = wd;
      h.alpha = r.number("alpha", 0.99);
      h.eps = r.number("eps", 1e-8);
      RmspropOptions o;
      o.momentum = r.number("momentum", 0.0);
      o.centered = r.flag("centered", false);
      r.only({"lr", "alpha", "eps", "weight_decay", "momentum", "centered"});
      return AnyOptimizer(Rmsprop(numel, groups(h), o));
    }
    if (type == "Adagrad") {
      AdagradHyper h;
      h.lr = r.number("lr", 1e-2);
      h.weight_decay = wd;
      h.lr_decay = r.number("lr_decay", 0.0);
      h.eps = r.number("eps", 1e-10);
      const double initial = r.number("initial_accumulator_value", 0.0);
      r.only({"lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"});
      return AnyOptimizer(Adagrad(numel, groups(h), initial));
    }
    raise<ConfigError>("optimizer.type: '", type, "' has no flat-shard optimizer");
  }

  /// Wraps a concrete optimizer.
  explicit AnyOptimizer(Variant optimizer) : optimizer_(std::move(optimizer)) {}

  /// One fused pass (unscale and clip through io.grad_scale, update, optional write-back).
  void step(const FusedIo& io, const StepOptions& run = {}) {
    std::visit([&](auto& o) { o.step(io, run); }, optimizer_);
  }
  /// Sets every group's learning rate (the schedule's value for the next step).
  void set_lr(double lr) {
    std::visit([&](auto& o) { o.set_lr(lr); }, optimizer_);
  }
  /// Sets every group's (beta1, beta2) where the optimizer has betas (FlatOptimizer::set_betas);
  /// false for one without them.
  bool set_betas(double beta1, double beta2) {
    return std::visit([&](auto& o) { return o.set_betas(beta1, beta2); }, optimizer_);
  }
  /// The first group's (beta1, beta2), for an optimizer with betas.
  std::optional<std::pair<double, double>> betas() const {
    return std::visit(
        [](const auto& o) -> std::optional<std::pair<double, double>> {
          if constexpr (requires { o.groups()[0].hyper.beta2; }) {
            if (!o.groups().empty())
              return std::pair{o.groups()[0].hyper.beta1, o.groups()[0].hyper.beta2};
          }
          return std::nullopt;
        },
        optimizer_);
  }
  /// The learning rate of the first group.
  double lr() const {
    return std::visit(
        [](const auto& o) { return o.groups().empty() ? 0.0 : o.groups()[0].hyper.lr; },
        optimizer_);
  }
  /// Elements in the shard.
  std::size_t numel() const {
    return std::visit([](const auto& o) { return o.numel(); }, optimizer_);
  }
  /// Names of the state buffers ("exp_avg", "exp_avg_sq", ...).
  const std::vector<std::string>& state_names() const {
    return std::visit(
        [](const auto& o) -> const std::vector<std::string>& { return o.state_names(); },
        optimizer_);
  }
  /// The state buffer called name.
  std::span<float> state(std::string_view name) {
    return std::visit([&](auto& o) { return o.state(name); }, optimizer_);
  }
  /// Steps taken so far.
  std::int64_t step_count() const {
    return std::visit([](const auto& o) { return o.step_count(); }, optimizer_);
  }
  /// Gives up the states' memory (see FlatOptimizer::release_state_storage).
  void release_state_storage() {
    std::visit([](auto& o) { o.release_state_storage(); }, optimizer_);
  }
  /// Points released states at the owner's memory (see FlatOptimizer::bind_state).
  void bind_state(std::span<const std::span<float>> states) {
    std::visit([&](auto& o) { o.bind_state(states); }, optimizer_);
  }
  /// Bytes of state held in memory.
  std::size_t state_bytes() const {
    return std::visit([](const auto& o) { return o.state_bytes(); }, optimizer_);
  }
  /// Sets the step counter (after the state buffers were restored in place).
  void set_step_count(std::int64_t step) {
    std::visit([&](auto& o) { o.set_step_count(step); }, optimizer_);
  }
  /// The type name ("AdamW", "SGD", ...).
  const char* type_name() const {
    constexpr const char* names[] = {"SGD", "Adam", "AdamW", "Lion", "LAMB", "RMSprop", "Adagrad"};
    return names[optimizer_.index()];
  }
  /// A copy of the step counter and every state buffer.
  StateDict state_dict() const {
    return std::visit([](const auto& o) { return o.state_dict(); }, optimizer_);
  }
  /// Restores what state_dict saved.
  void load_state_dict(const StateDict& in) {
    std::visit([&](auto& o) { o.load_state_dict(in); }, optimizer_);
  }
  /// The concrete optimizer.
  const Variant& variant() const { return optimizer_; }

 private:
  // Reads params of a NamedParams block and remembers which keys were read.
  class Reader {
   public:
    explicit Reader(const NamedParams& spec) : spec_(spec) {
      for (const auto& key : spec.auto_params) {
        raise<ConfigError>("optimizer.params.", key,
                           ": \"auto\" must be resolved by the program before building the "
                           "optimizer");
      }
    }
    double number(const std::string& key, double fallback) const {
      const auto it = spec_.params.find(key);
      if (it == spec_.params.end()) return fallback;
      expect<ConfigError>(it->second.size() == 1 && !spec_.lists.contains(key), "optimizer.params.",
                          key, ": expected one number, got a list of ", it->second.size());
      return it->second.front();
    }
    // A boolean parameter: true or false (the parser stores them as 1 and 0), so a 2 or a 0.5
    // is refused rather than read as true.
    bool flag(const std::string& key, bool fallback) const {
      const double v = number(key, fallback ? 1.0 : 0.0);
      expect<ConfigError>(v == 0.0 || v == 1.0, "optimizer.params.", key,
                          ": expected true or false, got ", v);
      return v == 1.0;
    }
    // DeepSpeed's default betas, 0.9 and 0.999, for every type that has them.
    void betas(double& beta1, double& beta2) const {
      beta1 = 0.9;
      beta2 = 0.999;
      const auto it = spec_.params.find("betas");
      if (it == spec_.params.end()) return;
      expect<ConfigError>(it->second.size() == 2,
                          "optimizer.params.betas: expected [beta1, beta2], got ",
                          it->second.size(), " numbers");
      beta1 = it->second[0];
      beta2 = it->second[1];
    }
    void only(std::initializer_list<const char*> known) const {
      const std::set<std::string> allowed(known.begin(), known.end());
      for (const auto& [key, value] : spec_.params) {
        expect<ConfigError>(allowed.count(key) == 1, "optimizer.params.", key,
                            ": not a parameter of ", spec_.type);
      }
    }

   private:
    const NamedParams& spec_;
  };

  Variant optimizer_;
};

}  // namespace zero::optim
