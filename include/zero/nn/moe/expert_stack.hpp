#pragma once
// ExpertStack: the weights of a mixture-of-experts layer's E GPT-MLP experts, stacked along a
// leading expert dimension so that an expert-parallel group splits them like any other
// parameter (a TensorSplit of dimension 0 into ep parts: rank r holds experts
// [r E/ep, (r + 1) E/ep), and checkpoints store the whole stacks, loadable at any ep):
//   name.experts.c_fc.weight [E, H, C]    name.experts.c_fc.bias [E, H]
//   name.experts.c_proj.weight [E, C, H]  name.experts.c_proj.bias [E, C]
// With a tensor-parallel group (expert tensor parallelism, Megatron's expert_tensor_parallel_size
// equal to tp) each expert is split as a GPT MLP is: c_fc column-parallel (its hidden units
// split, weight and bias on dimension 1 of the stack), c_proj row-parallel (its weight on
// dimension 2; the bias whole on every tp rank), so a rank holds H/tp hidden units of each of its
// experts (ParamSpec::split, of ParamSpec::expert_split's experts). With whole experts over tp
// (ExpertTensorParallel::experts, Megatron's expert_tensor_parallel_size = 1) the tp ranks split
// each ep rank's experts again instead, on dimension 0 of every stacked tensor: tp rank t of ep
// rank r holds the E/(ep tp) experts from r E/ep + t E/(ep tp), whole.
// Initialised from the logical tensors (seed, name, index), so the experts an ep rank holds
// equal the same experts of a single process, and a tp rank's part their slice.
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
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/core/error.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/nn/moe/expert_tensor_parallel.hpp>
#include <zero/ops/cpu/elementwise.hpp>

namespace zero::nn {

/// The stacked weights of E GPT-MLP experts, split over an expert-parallel group (see the file
/// comment).
template <class T>
class ExpertStack final : public Layer<T> {
 public:
  /// E experts of hidden size `hidden` over `channels` features, this rank's E / ep of them,
  /// each split over tp (hidden / tp of its hidden units), or with split = experts, E / (ep tp)
  /// whole experts; c_fc's weights with stddev 0.02, c_proj's with proj_stddev (GPT's
  /// 0.02 / sqrt(2 L)).
  ExpertStack(std::string name, int experts, std::int64_t channels, std::int64_t hidden,
              double proj_stddev = 0.02, parallel::ExpertParallel ep = {},
              parallel::TensorParallel tp = {},
              ExpertTensorParallel split = ExpertTensorParallel::hidden)
      : name_(std::move(name)),
        E_(experts),
        C_(channels),
        H_(hidden),
        proj_stddev_(proj_stddev),
        ep_(std::move(ep)),
        tp_(std::move(tp)),
        whole_(split == ExpertTensorParallel::experts && tp_.active()) {
    expect<ConfigError>(E_ >= 1 && C_ > 0 && H_ > 0, describe(), ": experts = ", E_,
                        ", channels = ", C_, ", hidden = ", H_, "; all must be positive");
    expect<ConfigError>(E_ % ep_.size() == 0, "moe.num_experts = ", E_,
                        " must be a multiple of moe.ep_size = ", ep_.size(), " (", describe(), ")");
    if (whole_) {
      expect<ConfigError>(
          E_ % (ep_.size() * tp_.size()) == 0, "moe.num_experts = ", E_,
          " must be a multiple of moe.ep_size x tensor_parallel.tp_size = ", ep_.size(), " x ",
          tp_.size(), " for whole experts over tp (moe.expert_tensor_parallel_size = 1; ",
          describe(), ")");
    } else {
      expect<ConfigError>(H_ % tp_.size() == 0, describe(), ": the experts' ", H_,
                          " hidden units do not split over tensor-parallel size ", tp_.size());
    }
  }

  std::string describe() const override { return "ExpertStack '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    const std::string x = name_ + ".experts.";
    return {spec(x + "c_fc.weight", {E_, H_, C_}, Init::normal, 0.02, true, 1),
            spec(x + "c_fc.bias", {E_, H_}, Init::zeros, 0, false, 1),
            spec(x + "c_proj.weight", {E_, C_, H_}, Init::normal, proj_stddev_, true, 2),
            spec(x + "c_proj.bias", {E_, C_}, Init::zeros, 0, false, -1)};
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

  /// Experts in all (E), and on this rank (E / ep; E / (ep tp) for whole experts over tp).
  int num_experts() const { return E_; }
  int local_experts() const { return E_ / ep_.size() / (whole_ ? tp_.size() : 1); }
  /// The global index of this rank's first expert.
  int first_expert() const {
    return ep_.rank() * (E_ / ep_.size()) + (whole_ ? tp_.rank() * local_experts() : 0);
  }
  std::int64_t channels() const { return C_; }
  std::int64_t hidden() const { return H_; }
  /// The hidden units of each expert this rank holds (H / tp; H for whole experts).
  std::int64_t local_hidden() const { return whole_ ? H_ : H_ / tp_.size(); }
  /// True when the tp ranks hold different whole experts (ExpertTensorParallel::experts, tp > 1).
  bool whole_experts_over_tp() const { return whole_; }
  /// The experts this rank's expert-parallel exchange covers, E (E / tp with whole experts over
  /// tp: those of its tp rank on every ep rank, which its ep group holds), ...
  int exchanged_experts() const { return whole_ ? E_ / tp_.size() : E_; }
  /// ... and expert e's index among them, in ep-rank order (each ep rank's local experts in
  /// turn, as the exchange expects), or -1 when another tp rank's experts hold it.
  int exchange_index(int e) const {
    if (!whole_) return e;
    const int per_ep = E_ / ep_.size(), local = local_experts();
    const int within = e % per_ep;
    if (within / local != tp_.rank()) return -1;
    return e / per_ep * local + within % local;
  }
  /// The expert-parallel group.
  const parallel::ExpertParallel& expert_parallel() const { return ep_; }
  /// The tensor-parallel group each expert is split over, or with whole experts over tp, that
  /// splits the experts (size 1: whole experts on every rank).
  const parallel::TensorParallel& tensor_parallel() const { return tp_; }
  /// Local expert l's parameter i (0 c_fc.weight [H', C], 1 c_fc.bias [H'], 2 c_proj.weight
  /// [C, H'], 3 c_proj.bias [C], H' = local_hidden()): its value and its gradient (empty when
  /// not training).
  T* value(int l, int i) const { return at(views_.at(static_cast<std::size_t>(i)).value, l); }
  T* grad(int l, int i) const { return at(views_.at(static_cast<std::size_t>(i)).grad, l); }

 private:
  // The spec of a stacked tensor of logical shape whole: this rank's experts (split over ep on
  // dimension 0), their tp part split on dimension tp_dim (none: whole on every tp rank), or
  // with whole experts over tp, this tp rank's experts of them (dimension 0 again).
  ParamSpec spec(std::string name, Shape whole, Init init, double stddev, bool decay,
                 int tp_dim) const {
    ParamSpec p{std::move(name), whole, init, stddev, decay};
    if (ep_.active()) {
      p.expert_split = TensorSplit::of(whole, 0, ep_.size(), ep_.rank());
      p.shape = p.expert_split.part_shape();
    }
    if (whole_) tp_dim = 0;
    if (tp_.active() && tp_dim >= 0) {
      p.split = TensorSplit::of(p.shape, tp_dim, tp_.size(), tp_.rank());
      p.shape = p.split.part_shape();
    }
    return p;
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
  parallel::TensorParallel tp_;
  bool whole_;  // whole experts over tp (ExpertTensorParallel::experts with tp > 1)
  std::vector<ParamView<T>> views_;
};

}  // namespace zero::nn
