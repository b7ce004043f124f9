#pragma once
// MixtureOfExperts: a layer [..., C] -> [..., C] that sends each token (row) to k of E experts
// chosen by a learned router (router.hpp) and sums the experts' outputs weighted by the
// router's combine weights; a dropped choice contributes nothing (in a residual branch the token
// then passes through the skip path alone, as in DeepSpeed). Each expert is a GPT MLP:
// c_fc (C -> H), GELU (tanh), c_proj (H -> C). The router is a bias-free linear map W_g [E, C]
// computed in the compute type. Parameters: name.gate.weight, then per expert e
// name.experts.e.c_fc.{weight,bias} and name.experts.e.c_proj.{weight,bias}.
// Forward gathers each expert's kept tokens into consecutive rows (expert by expert, in slot
// order), runs the experts on those rows only, and combines; it adds the weighted auxiliary
// losses (load balancing and router z-loss) to ctx.aux_loss, which the loss layer adds to the
// training loss, and keeps the last forward's statistics for the step line (last_stats()).
// This is the single-process layer (every expert on this rank); the expert-parallel dispatch
// over an all-to-all builds on it.

#include <any>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/nn/moe/router.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::nn {

/// What the last forward of a MixtureOfExperts routed.
struct MoEStats {
  double aux_loss = 0;        ///< load-balancing loss (unweighted)
  double z_loss = 0;          ///< router z-loss (unweighted)
  std::int64_t dropped = 0;   ///< choices past their expert's capacity
  std::int64_t choices = 0;   ///< tokens x k
  std::int64_t capacity = 0;  ///< slots per expert
};

/// A mixture of GPT-MLP experts behind a top-k router (see the file comment).
template <class T>
class MixtureOfExperts final : public Layer<T> {
 public:
  using A = compute_type_t<T>;

  /// E = router.num_experts experts of hidden size `hidden` over `channels` features; the
  /// experts' projections start as GPT's (stddev 0.02, c_proj's 0.02 / sqrt(2 L) given as
  /// proj_stddev), the router's weight with stddev gate_stddev.
  MixtureOfExperts(std::string name, std::int64_t channels, std::int64_t hidden,
                   RouterConfig router, double proj_stddev = 0.02, double gate_stddev = 0.02)
      : name_(std::move(name)),
        C_(channels),
        H_(hidden),
        cfg_(router),
        proj_stddev_(proj_stddev),
        gate_stddev_(gate_stddev) {
    cfg_.validate();
    expect<ConfigError>(C_ > 0 && H_ > 0, describe(), ": channels = ", C_, ", hidden = ", H_,
                        "; both must be positive");
  }

  std::string describe() const override { return "MixtureOfExperts '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    std::vector<ParamSpec> p{
        {name_ + ".gate.weight", {cfg_.num_experts, C_}, Init::normal, gate_stddev_, true}};
    for (int e = 0; e < cfg_.num_experts; ++e) {
      const std::string x = name_ + ".experts." + std::to_string(e) + ".";
      p.push_back({x + "c_fc.weight", {H_, C_}, Init::normal, 0.02, true});
      p.push_back({x + "c_fc.bias", {H_}, Init::zeros, 0, false});
      p.push_back({x + "c_proj.weight", {C_, H_}, Init::normal, proj_stddev_, true});
      p.push_back({x + "c_proj.bias", {C_}, Init::zeros, 0, false});
    }
    return p;
  }
  void bind(std::span<const ParamView<T>> views) override {
    views_.assign(views.begin(), views.end());
  }

  void forward(StepContext<T>& ctx) override {
    using ops::cpu::load;
    const std::int64_t N = rows_of(ctx.x, C_, describe());
    const int E = cfg_.num_experts;
    input_ = ctx.x;
    // Router logits in the compute type.
    Tensor<A> logits = zeros<A>(ctx, {N, E});
    const T* wg = gate().value.data();
    for (std::int64_t t = 0; t < N; ++t) {
      for (int e = 0; e < E; ++e) {
        A dot = 0;
        for (std::int64_t c = 0; c < C_; ++c) {
          dot += load(input_.data()[t * C_ + c]) * load(wg[e * C_ + c]);
        }
        logits.data()[t * E + e] = dot;
      }
    }
    routing_ = route(logits.data(), N, cfg_);
    // Each expert's kept tokens as consecutive rows.
    first_row_.assign(static_cast<std::size_t>(E) + 1, 0);
    for (int e = 0; e < E; ++e) first_row_[e + 1] = first_row_[e] + routing_.kept[e];
    const std::int64_t R = expert_rows();
    rows_in_ = ctx.arena->template allocate<T>({R, C_});
    fc_ = ctx.arena->template allocate<T>({R, H_});
    act_ = ctx.arena->template allocate<T>({R, H_});
    rows_out_ = ctx.arena->template allocate<T>({R, C_});
    for_each_kept([&](std::int64_t t, int, std::int64_t row) {
      std::copy(input_.data() + t * C_, input_.data() + (t + 1) * C_, rows_in_.data() + row * C_);
    });
    for (int e = 0; e < E; ++e) {
      const std::int64_t first = first_row_[e], n = routing_.kept[e];
      if (n == 0) continue;
      ops::cpu::linear_forward<T>(fc_.data() + first * H_, rows_in_.data() + first * C_,
                                  param(e, 0).value.data(), param(e, 1).value.data(), n, C_, H_);
      ops::cpu::gelu_forward<T>(act_.data() + first * H_, fc_.data() + first * H_, n * H_);
      ops::cpu::linear_forward<T>(rows_out_.data() + first * C_, act_.data() + first * H_,
                                  param(e, 2).value.data(), param(e, 3).value.data(), n, H_, C_);
    }
    // Combine: y_t = sum_j w_j * expert_j(x_t), summed in the compute type, rounded once.
    Tensor<A> acc = zeros<A>(ctx, {N, C_});
    for_each_kept([&](std::int64_t t, int j, std::int64_t row) {
      const A w = routing_.weight[routing_.at(t, j)];
      for (std::int64_t c = 0; c < C_; ++c) {
        acc.data()[t * C_ + c] += w * load(rows_out_.data()[row * C_ + c]);
      }
    });
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    for (std::int64_t i = 0; i < N * C_; ++i) y.data()[i] = ops::cpu::store<T>(acc.data()[i]);
    ctx.aux_loss += static_cast<A>(cfg_.aux_loss_coef) * routing_.aux_loss +
                    static_cast<A>(cfg_.z_loss_coef) * routing_.z_loss;
    stats_ = {static_cast<double>(routing_.aux_loss), static_cast<double>(routing_.z_loss),
              routing_.dropped, N * cfg_.k, routing_.capacity};
    ctx.x = y;
  }

  void backward(StepContext<T>& ctx) override {
    using ops::cpu::load;
    const std::int64_t N = routing_.tokens;
    const int E = cfg_.num_experts;
    const std::int64_t R = expert_rows();
    const T* dy = ctx.dy.data();
    // The experts' output gradient and each choice's combine-weight gradient.
    Tensor<T> drows_out = zeros<T>(ctx, {R, C_});
    Tensor<A> dweight = zeros<A>(ctx, {N, cfg_.k});
    for_each_kept([&](std::int64_t t, int j, std::int64_t row) {
      const A w = routing_.weight[routing_.at(t, j)];
      A dw = 0;
      for (std::int64_t c = 0; c < C_; ++c) {
        const A g = load(dy[t * C_ + c]);
        drows_out.data()[row * C_ + c] = ops::cpu::store<T>(w * g);
        dw += g * load(rows_out_.data()[row * C_ + c]);
      }
      dweight.data()[routing_.at(t, j)] = dw;
    });
    // Through the experts.
    Tensor<T> dact = zeros<T>(ctx, {R, H_});
    Tensor<T> dfc = zeros<T>(ctx, {R, H_});
    Tensor<T> drows_in = zeros<T>(ctx, {R, C_});
    for (int e = 0; e < E; ++e) {
      const std::int64_t first = first_row_[e], n = routing_.kept[e];
      if (n == 0) continue;
      nn::linear_backward<T>(ctx, dact.data() + first * H_, param(e, 2).grad.data(),
                             param(e, 3).grad.data(), drows_out.data() + first * C_,
                             act_.data() + first * H_, param(e, 2).value.data(), n, H_, C_);
      ops::cpu::gelu_backward<T>(dfc.data() + first * H_, fc_.data() + first * H_,
                                 dact.data() + first * H_, n * H_);
      nn::linear_backward<T>(ctx, drows_in.data() + first * C_, param(e, 0).grad.data(),
                             param(e, 1).grad.data(), dfc.data() + first * H_,
                             rows_in_.data() + first * C_, param(e, 0).value.data(), n, C_, H_);
    }
    // The router: the logits' gradient, then W_g's and the input's (summed in the compute type,
    // each element rounded once).
    Tensor<A> dlogits = zeros<A>(ctx, {N, E});
    router_backward(dlogits.data(), routing_, dweight.data(), cfg_, static_cast<A>(ctx.loss_scale));
    const T* wg = gate().value.data();
    Tensor<A> dwg = zeros<A>(ctx, {E, C_});
    Tensor<A> dx = zeros<A>(ctx, {N, C_});
    for_each_kept([&](std::int64_t t, int, std::int64_t row) {
      for (std::int64_t c = 0; c < C_; ++c) {
        dx.data()[t * C_ + c] += load(drows_in.data()[row * C_ + c]);
      }
    });
    for (std::int64_t t = 0; t < N; ++t) {
      for (int e = 0; e < E; ++e) {
        const A d = dlogits.data()[t * E + e];
        for (std::int64_t c = 0; c < C_; ++c) {
          dx.data()[t * C_ + c] += d * load(wg[e * C_ + c]);
          dwg.data()[e * C_ + c] += d * load(input_.data()[t * C_ + c]);
        }
      }
    }
    add_into(ctx.dx.data(), dx);
    if (gate().grad.data() != nullptr) add_into(gate().grad.data(), dwg);
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    // The router for every token, and the experts for k of them (at full capacity).
    const std::int64_t N = in.input.numel() / C_;
    FlopCount f = matmul_flops(N, C_, cfg_.num_experts);
    f += matmul_flops(N * cfg_.k, C_, H_);
    f += matmul_flops(N * cfg_.k, H_, C_);
    return f;
  }

  bool parks() const override { return true; }
  std::any park() override {
    return park_members(input_, routing_, first_row_, rows_in_, fc_, act_, rows_out_);
  }
  void resume(std::any saved) override {
    resume_members(saved, input_, routing_, first_row_, rows_in_, fc_, act_, rows_out_);
  }

  /// What the last forward routed.
  const MoEStats& last_stats() const { return stats_; }
  /// The router settings.
  const RouterConfig& router() const { return cfg_; }

 private:
  const ParamView<T>& gate() const { return views_.at(0); }
  // Expert e's parameter i: 0 c_fc.weight, 1 c_fc.bias, 2 c_proj.weight, 3 c_proj.bias.
  const ParamView<T>& param(int e, int i) const {
    return views_.at(1 + static_cast<std::size_t>(e) * 4 + static_cast<std::size_t>(i));
  }
  // Rows of the experts' buffers (at least one, so a batch that kept nothing still has views).
  std::int64_t expert_rows() const { return std::max<std::int64_t>(first_row_.back(), 1); }
  // Calls fn(t, j, row) for every kept choice j of token t; row is its row in the experts'
  // buffers.
  template <class Fn>
  void for_each_kept(Fn&& fn) const {
    for (std::int64_t t = 0; t < routing_.tokens; ++t) {
      for (int j = 0; j < routing_.k; ++j) {
        const std::size_t i = routing_.at(t, j);
        if (routing_.slot[i] < 0) continue;
        fn(t, j, first_row_[static_cast<std::size_t>(routing_.expert[i])] + routing_.slot[i]);
      }
    }
  }
  // A zeroed arena view (released with the unit's activations).
  template <class U>
  static Tensor<U> zeros(StepContext<T>& ctx, Shape s) {
    Tensor<U> t = ctx.arena->template allocate<U>(s);
    for (U& v : t) v = U(0);
    return t;
  }
  // to[i] += from[i], rounded once to T.
  static void add_into(T* to, const Tensor<A>& from) {
    for (std::int64_t i = 0; i < from.numel(); ++i) {
      to[i] = ops::cpu::store<T>(ops::cpu::load(to[i]) + from.data()[i]);
    }
  }

  std::string name_;
  std::int64_t C_, H_;
  RouterConfig cfg_;
  double proj_stddev_, gate_stddev_;
  std::vector<ParamView<T>> views_;
  MoEStats stats_;
  // What forward keeps for backward.
  Tensor<T> input_;
  Routing<A> routing_;
  std::vector<std::int64_t> first_row_;  // [E + 1] each expert's first row
  Tensor<T> rows_in_, fc_, act_, rows_out_;
};

}  // namespace zero::nn
