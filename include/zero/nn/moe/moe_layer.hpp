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
    const int E = cfg_.num_experts, k = cfg_.k;
    input_ = ctx.x;
    // Router logits in the compute type.
    std::vector<A> logits(static_cast<std::size_t>(N * E));
    const T* wg = gate().value.data();
    for (std::int64_t t = 0; t < N; ++t) {
      for (int e = 0; e < E; ++e) {
        A dot = 0;
        for (std::int64_t c = 0; c < C_; ++c)
          dot += load(input_.data()[t * C_ + c]) * load(wg[e * C_ + c]);
        logits[static_cast<std::size_t>(t * E + e)] = dot;
      }
    }
    routing_ = route(logits.data(), N, cfg_);
    // Each expert's kept tokens as consecutive rows.
    first_row_.assign(static_cast<std::size_t>(E) + 1, 0);
    for (int e = 0; e < E; ++e) first_row_[e + 1] = first_row_[e] + routing_.kept[e];
    const std::int64_t R = first_row_[static_cast<std::size_t>(E)];
    rows_in_ = ctx.arena->template allocate<T>({std::max<std::int64_t>(R, 1), C_});
    fc_ = ctx.arena->template allocate<T>({std::max<std::int64_t>(R, 1), H_});
    act_ = ctx.arena->template allocate<T>({std::max<std::int64_t>(R, 1), H_});
    rows_out_ = ctx.arena->template allocate<T>({std::max<std::int64_t>(R, 1), C_});
    for (std::int64_t t = 0; t < N; ++t) {
      for (int j = 0; j < k; ++j) {
        const std::int64_t row = row_of(t, j);
        if (row < 0) continue;
        std::copy(input_.data() + t * C_, input_.data() + (t + 1) * C_, rows_in_.data() + row * C_);
      }
    }
    for (int e = 0; e < E; ++e) {
      const std::int64_t first = first_row_[e], n = routing_.kept[e];
      if (n == 0) continue;
      ops::cpu::linear_forward<T>(fc_.data() + first * H_, rows_in_.data() + first * C_,
                                  param(e, 0).value.data(), param(e, 1).value.data(), n, C_, H_);
      ops::cpu::gelu_forward<T>(act_.data() + first * H_, fc_.data() + first * H_, n * H_);
      ops::cpu::linear_forward<T>(rows_out_.data() + first * C_, act_.data() + first * H_,
                                  param(e, 2).value.data(), param(e, 3).value.data(), n, H_, C_);
    }
    // Combine: y_t = sum_j w_j * expert_j(x_t), rounded once.
    Tensor<T> y = ctx.arena->template allocate<T>(ctx.x.shape());
    std::vector<A> acc(static_cast<std::size_t>(C_));
    for (std::int64_t t = 0; t < N; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int j = 0; j < k; ++j) {
        const std::int64_t row = row_of(t, j);
        if (row < 0) continue;
        const A w = routing_.weight[routing_.at(t, j)];
        for (std::int64_t c = 0; c < C_; ++c) acc[c] += w * load(rows_out_.data()[row * C_ + c]);
      }
      for (std::int64_t c = 0; c < C_; ++c) y.data()[t * C_ + c] = ops::cpu::store<T>(acc[c]);
    }
    ctx.aux_loss += static_cast<A>(cfg_.aux_loss_coef) * routing_.aux_loss +
                    static_cast<A>(cfg_.z_loss_coef) * routing_.z_loss;
    stats_ = {static_cast<double>(routing_.aux_loss), static_cast<double>(routing_.z_loss),
              routing_.dropped, N * k, routing_.capacity};
    ctx.x = y;
  }

  void backward(StepContext<T>& ctx) override {
    using ops::cpu::load;
    const std::int64_t N = routing_.tokens;
    const int E = cfg_.num_experts, k = cfg_.k;
    const std::int64_t R = first_row_[static_cast<std::size_t>(E)];
    const T* dy = ctx.dy.data();
    // The experts' output gradient and each choice's combine-weight gradient.
    Tensor<T> drows_out = zeros(ctx, {std::max<std::int64_t>(R, 1), C_});
    std::vector<A> dweight(static_cast<std::size_t>(N * k), A(0));
    for (std::int64_t t = 0; t < N; ++t) {
      for (int j = 0; j < k; ++j) {
        const std::int64_t row = row_of(t, j);
        if (row < 0) continue;
        const A w = routing_.weight[routing_.at(t, j)];
        A dw = 0;
        for (std::int64_t c = 0; c < C_; ++c) {
          const A g = load(dy[t * C_ + c]);
          drows_out.data()[row * C_ + c] = ops::cpu::store<T>(w * g);
          dw += g * load(rows_out_.data()[row * C_ + c]);
        }
        dweight[routing_.at(t, j)] = dw;
      }
    }
    // Through the experts.
    Tensor<T> dact = zeros(ctx, {std::max<std::int64_t>(R, 1), H_});
    Tensor<T> dfc = zeros(ctx, {std::max<std::int64_t>(R, 1), H_});
    Tensor<T> drows_in = zeros(ctx, {std::max<std::int64_t>(R, 1), C_});
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
    // The router: logits' gradient, then W_g's and the input's.
    std::vector<A> dlogits(static_cast<std::size_t>(N * E), A(0));
    router_backward(dlogits.data(), routing_, dweight.data(), cfg_, static_cast<A>(ctx.loss_scale));
    const T* wg = gate().value.data();
    T* dwg = gate().grad.data();
    std::vector<A> dwg_acc(static_cast<std::size_t>(E * C_), A(0));
    std::vector<A> dx(static_cast<std::size_t>(C_));
    for (std::int64_t t = 0; t < N; ++t) {
      std::fill(dx.begin(), dx.end(), A(0));
      for (int j = 0; j < k; ++j) {
        const std::int64_t row = row_of(t, j);
        if (row < 0) continue;
        for (std::int64_t c = 0; c < C_; ++c) dx[c] += load(drows_in.data()[row * C_ + c]);
      }
      for (int e = 0; e < E; ++e) {
        const A d = dlogits[static_cast<std::size_t>(t * E + e)];
        for (std::int64_t c = 0; c < C_; ++c) {
          dx[c] += d * load(wg[e * C_ + c]);
          dwg_acc[static_cast<std::size_t>(e * C_ + c)] += d * load(input_.data()[t * C_ + c]);
        }
      }
      T* out = ctx.dx.data() + t * C_;
      for (std::int64_t c = 0; c < C_; ++c) out[c] = ops::cpu::store<T>(load(out[c]) + dx[c]);
    }
    if (dwg != nullptr) {
      for (std::int64_t i = 0; i < E * C_; ++i) {
        dwg[i] = ops::cpu::store<T>(load(dwg[i]) + dwg_acc[static_cast<std::size_t>(i)]);
      }
    }
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
  // Token t's choice j's row among the experts' rows, -1 when dropped.
  std::int64_t row_of(std::int64_t t, int j) const {
    const std::int64_t slot = routing_.slot[routing_.at(t, j)];
    return slot < 0
               ? -1
               : first_row_[static_cast<std::size_t>(routing_.expert[routing_.at(t, j)])] + slot;
  }
  static Tensor<T> zeros(StepContext<T>& ctx, Shape s) {
    Tensor<T> t = ctx.arena->template allocate<T>(s);
    for (T& v : t) v = T(0);
    return t;
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
