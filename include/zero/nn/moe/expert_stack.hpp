#pragma once
// ExpertStack: the weights of a mixture-of-experts layer's E GPT-MLP experts, stacked along a
// leading expert dimension so that an expert-parallel group splits them like any other
// parameter (a TensorSplit of dimension 0 into ep parts: rank r holds experts
// [r E/ep, (r + 1) E/ep), and checkpoints store the whole stacks, loadable at any ep):
//   name.experts.c_fc.weight [E, H, C]    name.experts.c_fc.bias [E, H]
//   name.experts.c_proj.weight [E, C, H]  name.experts.c_proj.bias [E, C]
// Initialised from the logical tensors (seed, name, index), so the experts an ep rank holds
// equal the same experts of a single process.
// As a layer it computes nothing (forward keeps the activation, backward passes the gradient
// through): a model puts it in a unit of its own ahead of the unit whose MixtureOfExperts reads
// it (unit_uses), and marks that unit as an expert unit (nn::HasExpertUnits), so the engine
// shards the experts over the expert data-parallel group and the router and the rest over the
// data-parallel group. A MixtureOfExperts built without one owns its experts instead.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <parallel/moe/expert_parallel.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/ops/cpu/elementwise.hpp>

namespace zero::nn {

/// The stacked weights of E GPT-MLP experts, split over an expert-parallel group (see the file
/// comment).
template <class T>
class ExpertStack final : public Layer<T> {
 public:
  /// E experts of hidden size `hidden` over `channels` features, this rank's E / ep of them;
  /// c_fc's weights with stddev 0.02, c_proj's with proj_stddev (GPT's 0.02 / sqrt(2 L)).
  ExpertStack(std::string name, int experts, std::int64_t channels, std::int64_t hidden,
              double proj_stddev = 0.02, parallel::ExpertParallel ep = {})
      : name_(std::move(name)),
        E_(experts),
        C_(channels),
        H_(hidden),
        proj_stddev_(proj_stddev),
        ep_(std::move(ep)) {
    expect<ConfigError>(E_ >= 1 && C_ > 0 && H_ > 0, describe(), ": experts = ", E_,
                        ", channels = ", C_, ", hidden = ", H_, "; all must be positive");
    expect<ConfigError>(E_ % ep_.size() == 0, "moe.num_experts = ", E_,
                        " must be a multiple of moe.ep_size = ", ep_.size(), " (", describe(), ")");
  }

  std::string describe() const override { return "ExpertStack '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    const std::string x = name_ + ".experts.";
    return {spec(x + "c_fc.weight", {E_, H_, C_}, Init::normal, 0.02, true),
            spec(x + "c_fc.bias", {E_, H_}, Init::zeros, 0, false),
            spec(x + "c_proj.weight", {E_, C_, H_}, Init::normal, proj_stddev_, true),
            spec(x + "c_proj.bias", {E_, C_}, Init::zeros, 0, false)};
  }
  void bind(std::span<const ParamView<T>> views) override {
    expect<Error>(views.size() == 4, describe(), ": expected 4 parameter views, got ",
                  views.size());
    views_.assign(views.begin(), views.end());
  }
  void forward(StepContext<T>& ctx) override { (void)ctx; }
  void backward(StepContext<T>& ctx) override {
    ops::cpu::accumulate(ctx.dx.data(), ctx.dy.data(), ctx.dx.numel());
  }
  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    (void)in;
    return FlopCount{};
  }
  bool parks() const override { return true; }  // keeps nothing between forward and backward

  /// Experts in all (E), and on this rank (E / ep).
  int num_experts() const { return E_; }
  int local_experts() const { return E_ / ep_.size(); }
  /// The global index of this rank's first expert.
  int first_expert() const { return ep_.rank() * local_experts(); }
  std::int64_t channels() const { return C_; }
  std::int64_t hidden() const { return H_; }
  /// The expert-parallel group.
  const parallel::ExpertParallel& expert_parallel() const { return ep_; }
  /// Local expert l's parameter i (0 c_fc.weight [H, C], 1 c_fc.bias [H], 2 c_proj.weight
  /// [C, H], 3 c_proj.bias [C]): its value and its gradient (empty when not training).
  T* value(int l, int i) const { return at(views_.at(static_cast<std::size_t>(i)).value, l); }
  T* grad(int l, int i) const { return at(views_.at(static_cast<std::size_t>(i)).grad, l); }

 private:
  ParamSpec spec(std::string name, Shape whole, Init init, double stddev, bool decay) const {
    if (!ep_.active()) return {std::move(name), whole, init, stddev, decay, {}};
    const TensorSplit split = TensorSplit::of(whole, 0, ep_.size(), ep_.rank());
    return {std::move(name), split.part_shape(), init, stddev, decay, split};
  }
  // Local expert l's slice of a stacked tensor (null for an empty view).
  static T* at(const Tensor<T>& t, int l) {
    if (t.data() == nullptr) return nullptr;
    return t.data() + static_cast<std::int64_t>(l) * (t.numel() / t.dim(0));
  }

  std::string name_;
  int E_;
  std::int64_t C_, H_;
  double proj_stddev_;
  parallel::ExpertParallel ep_;
  std::vector<ParamView<T>> views_;
};

}  // namespace zero::nn
