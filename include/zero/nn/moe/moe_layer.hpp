#pragma once
// MixtureOfExperts: a layer [..., C] -> [..., C] that sends each token (row) to k of E experts
// chosen by a learned router (router.hpp) and sums the experts' outputs weighted by the
// router's combine weights; a dropped choice contributes nothing (in a residual branch the token
// then passes through the skip path alone, as in DeepSpeed). Each expert is a GPT MLP:
// c_fc (C -> H), GELU (tanh), c_proj (H -> C). The router is a bias-free linear map W_g [E, C]
// computed in the compute type. Parameters: name.gate.weight, then the experts' stacked weights
// (expert_stack.hpp: name.experts.c_fc.{weight,bias}, name.experts.c_proj.{weight,bias}), which
// the layer owns, or which an ExpertStack in an earlier unit holds (a model with expert units).
// Forward gathers each expert's kept tokens into consecutive rows (expert by expert, in slot
// order), runs the experts on those rows only, and combines; it adds the weighted auxiliary
// losses (load balancing and router z-loss) to ctx.aux_loss, which the loss layer adds to the
// training loss, and keeps the last forward's statistics for the step line (last_stats()).
// The random draws DeepSpeed's gate options ask for (random token selection's priorities, Gumbel
// noise, jitter on the router's input) come from counter-based streams at the tokens' places in
// the step's global batch (DrawPlace), so a recomputed forward and every rank draw alike.
// With an expert-parallel group (ep > 1) each rank routes its own tokens (capacity from its own
// token count, as DeepSpeed), and the rows travel to the rank holding their expert and back
// through all_to_all_v (parallel/moe/token_exchange.hpp): forward dispatches and combines the
// rows, backward sends the output gradients to the experts and the input gradients back.
// With a tensor-parallel group (the experts' ExpertStack split over tp: expert tensor
// parallelism) every tp rank routes the same tokens alike and exchanges them with the ep ranks
// of its own tp rank; each runs its H/tp hidden units of the experts, c_proj's partial sums are
// all-reduced over tp before its bias is added (reduce_from_tp), and in backward the experts'
// input gradient is all-reduced over tp (copy_to_tp's adjoint) before it travels back. Under
// Megatron's sequence parallelism (each tp rank a block of the rows) the layer all-gathers the
// rows over tp first, routes and runs them all as without it, and keeps its own block of the
// output; in backward it all-gathers the output gradient and keeps its own rows' part of the
// input gradient (every tp rank computed the whole of it alike), so routing, capacity and the
// draws are those of the whole micro-batch.
// With whole experts over tp instead (ExpertTensorParallel::experts, Megatron's
// expert_tensor_parallel_size = 1) every tp rank still routes all rows alike, but sends only
// the choices of its own tp rank's experts (on each ep rank) through the exchange; its combined
// output is then a partial sum over tp, which is all-reduced (in the compute type, rounded once),
// or under sequence parallelism reduce-scattered to the rank's rows. In backward the combine
// weights' gradients (each choice's on the one tp rank that ran it) are all-reduced before the
// router's backward, and the experts' part of the input gradient is reduced as the output was.

#include <algorithm>
#include <any>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <parallel/moe/expert_parallel.hpp>
#include <parallel/moe/token_exchange.hpp>
#include <parallel/tensor_parallel/regions.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/layers/layer.hpp>
#include <zero/nn/moe/expert_stack.hpp>
#include <zero/nn/moe/router.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/linear.hpp>

namespace zero::nn {

/// What a MixtureOfExperts routed in a forward, or summed over several (operator+=).
struct MoEStats {
  double aux_loss = 0;        ///< load-balancing loss (unweighted)
  double z_loss = 0;          ///< router z-loss (unweighted)
  std::int64_t dropped = 0;   ///< choices past their expert's capacity
  std::int64_t choices = 0;   ///< tokens x k
  std::int64_t capacity = 0;  ///< slots per expert (a sum keeps the largest)

  /// Adds o's losses and counts; the capacity is the larger of the two.
  MoEStats& operator+=(const MoEStats& o) {
    aux_loss += o.aux_loss;
    z_loss += o.z_loss;
    dropped += o.dropped;
    choices += o.choices;
    capacity = std::max(capacity, o.capacity);
    return *this;
  }
};

/// A mixture of GPT-MLP experts behind a top-k router (see the file comment).
template <class T>
class MixtureOfExperts final : public Layer<T> {
 public:
  using A = compute_type_t<T>;

  /// E = router.num_experts experts of hidden size `hidden` over `channels` features, owned by
  /// the layer (this rank's E / ep of them); the experts' projections start as GPT's (stddev
  /// 0.02, c_proj's 0.02 / sqrt(2 L) given as proj_stddev), the router's weight with stddev
  /// gate_stddev.
  MixtureOfExperts(std::string name, std::int64_t channels, std::int64_t hidden,
                   RouterConfig router, double proj_stddev = 0.02, double gate_stddev = 0.02,
                   parallel::ExpertParallel ep = {})
      : MixtureOfExperts(name, router, gate_stddev,
                         std::make_unique<ExpertStack<T>>(name, router.num_experts, channels,
                                                          hidden, proj_stddev, std::move(ep))) {}
  /// The router of experts that `experts` (a layer of an earlier unit, which must outlive this
  /// one) holds; the layer's only parameter is then the router's weight.
  MixtureOfExperts(std::string name, RouterConfig router, const ExpertStack<T>& experts,
                   double gate_stddev = 0.02)
      : MixtureOfExperts(std::move(name), router, gate_stddev, nullptr, &experts) {}

  std::string describe() const override { return "MixtureOfExperts '" + name_ + "'"; }
  std::vector<ParamSpec> params() const override {
    std::vector<ParamSpec> p{
        {name_ + ".gate.weight", {cfg_.num_experts, C_}, Init::normal, gate_stddev_, true}};
    if (owned_) {
      for (ParamSpec& e : owned_->params()) p.push_back(std::move(e));
    }
    return p;
  }
  void bind(std::span<const ParamView<T>> views) override {
    expect<Error>(!views.empty(), describe(), ": no parameter views");
    gate_ = views[0];
    if (owned_) owned_->bind(views.subspan(1));
  }

  void forward(StepContext<T>& ctx) override {
    expect_host_kernels(ctx, describe());
    using ops::cpu::load;
    const int E = cfg_.num_experts;
    BumpArena& arena = *ctx.arena;
    input_ = sequence_parallel() ? gather_rows(ctx, ctx.x) : ctx.x;
    const std::int64_t N = rows_of(input_, C_, describe());
    draws_ = DrawPlace{ctx.seed, ctx.step, ctx.dropout_first(N), ctx.training};
    {  // Router logits in the compute type (scratch: route() keeps what backward needs).
      const auto mark = arena.mark();
      Tensor<A> logits = arena.template allocate<A>({N, E});
      const T* wg = gate_.value.data();
      const Jitter jitter = jitter_of(N);
      for (std::int64_t t = 0; t < N; ++t) {
        for (int e = 0; e < E; ++e) {
          A dot = 0;
          for (std::int64_t c = 0; c < C_; ++c) {
            dot += jitter(t, c, load(input_.data()[t * C_ + c])) * load(wg[e * C_ + c]);
          }
          logits.data()[t * E + e] = dot;
        }
      }
      const std::vector<double> priority = uniforms("rts", N, cfg_.random_token_selection);
      const std::vector<double> gumbel = gumbels(N * E, cfg_.samples_choices(ctx.training));
      routing_ = route(logits.data(), N, cfg_, RouterDraws{priority, gumbel, ctx.training});
      arena.release(mark);
    }
    // Each expert's kept tokens as consecutive rows; the local experts' rows are this rank's
    // own, or those the expert-parallel ranks send.
    // (with whole experts over tp, only the experts of this tp rank: exchange_index)
    const int X = experts().exchanged_experts();
    std::vector<std::int64_t> kept(static_cast<std::size_t>(X), 0);
    for (int e = 0; e < E; ++e) {
      const int x = experts().exchange_index(e);
      if (x >= 0) kept[static_cast<std::size_t>(x)] = routing_.kept[static_cast<std::size_t>(e)];
    }
    first_row_.assign(static_cast<std::size_t>(X) + 1, 0);
    for (int x = 0; x < X; ++x) first_row_[x + 1] = first_row_[x] + kept[x];
    exchange_ = ep().active() ? parallel::exchange_counts(ep().comm(), kept, C_) : local_exchange();
    const std::int64_t R = rows_routed(), Re = expert_rows();
    expert_in_ = arena.template allocate<T>({Re, C_});
    fc_ = arena.template allocate<T>({Re, H_});
    act_ = arena.template allocate<T>({Re, H_});
    rows_out_ = arena.template allocate<T>({R, C_});
    auto gather_rows = [&](Tensor<T> rows) {
      for_each_kept([&](std::int64_t t, int, std::int64_t row) {
        std::copy(input_.data() + t * C_, input_.data() + (t + 1) * C_, rows.data() + row * C_);
      });
    };
    if (ep().active()) {  // this rank's rows and the experts' outputs are only in flight
      const auto mark = arena.mark();
      Tensor<T> rows = arena.template allocate<T>({R, C_});
      gather_rows(rows);
      dispatch(ctx, rows, expert_in_);
      Tensor<T> expert_out = arena.template allocate<T>({Re, C_});
      run_experts(expert_out);
      combine(ctx, expert_out, rows_out_);
      arena.release(mark);
    } else {
      gather_rows(expert_in_);
      run_experts(rows_out_);
    }
    // Combine: y_t = sum_j w_j * expert_j(x_t), summed in the compute type, rounded once (with
    // whole experts over tp, this tp rank's choices: summed over tp first, to this rank's rows
    // under sequence parallelism).
    const bool partial = whole_experts();
    Tensor<T> y =
        arena.template allocate<T>(partial && sequence_parallel() ? ctx.x.shape() : input_.shape());
    {
      const auto mark = arena.mark();
      Tensor<A> acc = zeros<A>(ctx, {N, C_});
      for_each_kept([&](std::int64_t t, int j, std::int64_t row) {
        const A w = routing_.weight[routing_.at(t, j)];
        for (std::int64_t c = 0; c < C_; ++c) {
          acc.data()[t * C_ + c] += w * load(rows_out_.data()[row * C_ + c]);
        }
      });
      const A* sum = partial ? sum_over_tp(ctx, acc) : acc.data();
      for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] = ops::cpu::store<T>(sum[i]);
      arena.release(mark);
    }
    ctx.aux_loss += static_cast<A>(cfg_.aux_loss_coef) * routing_.aux_loss +
                    static_cast<A>(cfg_.z_loss_coef) * routing_.z_loss;
    stats_ = routed();
    ctx.x = sequence_parallel() && !partial ? own_rows(ctx, y, ctx.x.shape()) : y;
  }

  void backward(StepContext<T>& ctx) override {
    using ops::cpu::load;
    window_ += routed();  // once per micro-batch, however often its forward ran
    const std::int64_t N = routing_.tokens;
    const int E = cfg_.num_experts;
    const std::int64_t R = rows_routed(), Re = expert_rows();
    const T* dy = sequence_parallel() ? gather_rows(ctx, ctx.dy).data() : ctx.dy.data();
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
    if (whole_experts()) {  // each choice's on the tp rank holding its expert, zeros elsewhere
      tp().comm().all_reduce(std::span<A>(dweight.data(), static_cast<std::size_t>(N * cfg_.k)),
                             parallel::ReduceOp::sum);
    }
    // Through the experts (on the ranks holding them).
    Tensor<T> dexpert_out = drows_out;
    if (ep().active()) {
      dexpert_out = ctx.arena->template allocate<T>({Re, C_});
      dispatch(ctx, drows_out, dexpert_out);
    }
    Tensor<T> dact = zeros<T>(ctx, {Re, H_});
    Tensor<T> dfc = zeros<T>(ctx, {Re, H_});
    Tensor<T> dexpert_in = zeros<T>(ctx, {Re, C_});
    for (int l = 0; l < experts().local_experts(); ++l) {
      const std::int64_t first = exchange_.expert_first[static_cast<std::size_t>(l)];
      const std::int64_t n = exchange_.expert_rows(l);
      if (n == 0) continue;
      nn::linear_backward<T>(ctx, dact.data() + first * H_, experts().grad(l, 2),
                             experts().grad(l, 3), dexpert_out.data() + first * C_,
                             act_.data() + first * H_, experts().value(l, 2), n, H_, C_);
      ops::cpu::gelu_backward<T>(dfc.data() + first * H_, fc_.data() + first * H_,
                                 dact.data() + first * H_, n * H_);
      nn::linear_backward<T>(ctx, dexpert_in.data() + first * C_, experts().grad(l, 0),
                             experts().grad(l, 1), dfc.data() + first * H_,
                             expert_in_.data() + first * C_, experts().value(l, 0), n, C_, H_);
    }
    if (split_hidden()) {  // each tp rank's hidden units gave a part: copy_to_tp's adjoint,
      // an all-reduce (in place)
      parallel::region_forward(parallel::Region::reduce_from_tp, tp(), dexpert_in.data(),
                               dexpert_in.data(), exchange_.rows_received(), C_);
    }
    Tensor<T> drows_in = dexpert_in;
    if (ep().active()) {
      drows_in = ctx.arena->template allocate<T>({R, C_});
      combine(ctx, dexpert_in, drows_in);
    }
    // The router: the logits' gradient, then W_g's and the input's (summed in the compute type,
    // each element rounded once).
    Tensor<A> dlogits = zeros<A>(ctx, {N, E});
    router_backward(dlogits.data(), routing_, dweight.data(), cfg_, static_cast<A>(ctx.loss_scale));
    const T* wg = gate_.value.data();
    Tensor<A> dwg = zeros<A>(ctx, {E, C_});
    Tensor<A> dx = zeros<A>(ctx, {N, C_});
    for_each_kept([&](std::int64_t t, int, std::int64_t row) {
      for (std::int64_t c = 0; c < C_; ++c) {
        dx.data()[t * C_ + c] += load(drows_in.data()[row * C_ + c]);
      }
    });
    // With whole experts over tp that is this tp rank's choices' part: summed over tp (its own
    // rows' sums, in place, under sequence parallelism: the only rows kept below).
    if (whole_experts()) {
      const A* sum = sum_over_tp(ctx, dx);
      if (sequence_parallel()) {
        const std::int64_t n = N / tp().size() * C_;
        std::copy(sum, sum + n, dx.data() + tp().rank() * n);
      }
    }
    // Under jitter the logits saw x times its draws: dx takes the same factors, W_g's gradient
    // the jittered input.
    const Jitter jitter = jitter_of(N);
    for (std::int64_t t = 0; t < N; ++t) {
      for (int e = 0; e < E; ++e) {
        const A d = dlogits.data()[t * E + e];
        for (std::int64_t c = 0; c < C_; ++c) {
          dx.data()[t * C_ + c] += jitter(t, c, d * load(wg[e * C_ + c]));
          dwg.data()[e * C_ + c] += d * jitter(t, c, load(input_.data()[t * C_ + c]));
        }
      }
    }
    // Under sequence parallelism every tp rank computed the whole gradient alike: its own rows'.
    const std::int64_t own = sequence_parallel() ? N / tp().size() : N;
    add_into(ctx.dx.data(), dx.data() + (sequence_parallel() ? tp().rank() * own * C_ : 0),
             own * C_);
    if (gate_.grad.data() != nullptr) add_into(gate_.grad.data(), dwg.data(), dwg.numel());
  }

  std::optional<FlopCount> forward_flops(const FlopInput& in) const override {
    // The router for every token, and the experts for k of them (at full capacity): this rank's
    // hidden units of them, or with whole experts over tp, its tp rank's 1/tp of the choices;
    // under sequence parallelism every tp rank's tokens (gathered).
    const std::int64_t N = in.input.numel() / C_ * (sequence_parallel() ? tp().size() : 1);
    const std::int64_t choices = N * cfg_.k / (whole_experts() ? tp().size() : 1);
    FlopCount f = matmul_flops(N, C_, cfg_.num_experts);
    f += matmul_flops(choices, C_, H_);
    f += matmul_flops(choices, H_, C_);
    return f;
  }

  bool parks() const override { return true; }
  std::any park() override {
    return park_members(input_, draws_, routing_, first_row_, exchange_, expert_in_, fc_, act_,
                        rows_out_);
  }
  void resume(std::any saved) override {
    resume_members(saved, input_, draws_, routing_, first_row_, exchange_, expert_in_, fc_, act_,
                   rows_out_);
  }

  /// What the last forward routed.
  const MoEStats& last_stats() const { return stats_; }
  /// What the micro-batches whose backward ran since reset_window_stats() routed, summed: each
  /// counted once, whichever order a pipeline runs them in and however often a checkpointed
  /// unit recomputed its forward (a forward without backward, an evaluation, counts nothing).
  const MoEStats& window_stats() const { return window_; }
  /// Starts window_stats() over (at an accumulation window's start).
  void reset_window_stats() { window_ = {}; }
  /// The router settings.
  const RouterConfig& router() const { return cfg_; }
  /// The experts' weights (owned, or the ExpertStack given).
  const ExpertStack<T>& experts() const { return *experts_; }
  /// Rows this rank's experts ran in the last forward (its own tokens' when ep = 1).
  std::int64_t last_expert_rows() const { return exchange_.rows_received(); }
  /// Rows this rank routed in the last forward (kept choices of its tokens).
  std::int64_t last_routed_rows() const { return exchange_.rows_sent; }

 private:
  MixtureOfExperts(std::string name, RouterConfig router, double gate_stddev,
                   std::unique_ptr<ExpertStack<T>> owned, const ExpertStack<T>* experts = nullptr)
      : name_(std::move(name)),
        cfg_(router),
        gate_stddev_(gate_stddev),
        owned_(std::move(owned)),
        experts_(owned_ ? owned_.get() : experts) {
    cfg_.validate();
    expect<Error>(experts_ != nullptr, describe(), ": no experts");
    expect<ConfigError>(experts_->num_experts() == cfg_.num_experts, describe(),
                        ": the router has ", cfg_.num_experts, " experts but the expert stack ",
                        experts_->num_experts());
    C_ = experts_->channels();
    H_ = experts_->local_hidden();
  }
  const parallel::ExpertParallel& ep() const { return experts_->expert_parallel(); }
  const parallel::TensorParallel& tp() const { return experts_->tensor_parallel(); }
  // Where the forward's random draws come from (random token selection, Gumbel noise, jitter):
  // streams keyed by the run's seed, the micro-step's dropout step (ctx.step) and the layer's
  // name, at the tokens' indices in the step's global batch (StepContext::dropout_first),
  // so a token draws alike on any rank, and kept for the backward (and a parked pass).
  struct DrawPlace {
    std::uint64_t seed = 0, step = 0, first_token = 0;
    bool training = true;
  };
  // n uniform draws in [0, 1) (CounterRng::uniform) of stream `what` in the micro-step's key,
  // per_token of them a token's (the first at index first_token * per_token); empty when not
  // asked for.
  std::vector<double> uniforms(std::string_view what, std::int64_t n, bool asked,
                               std::int64_t per_token = 1) const {
    if (!asked) return {};
    const CounterRng rng(CounterRng::key_for(draws_.seed ^ CounterRng::mix(draws_.step),
                                             "moe." + std::string(what) + "." + name_));
    const std::uint64_t first = draws_.first_token * static_cast<std::uint64_t>(per_token);
    std::vector<double> u(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      u[static_cast<std::size_t>(i)] = rng.uniform(first + static_cast<std::uint64_t>(i));
    }
    return u;
  }
  // Standard Gumbel noise for the n = N E logits: -log(-log(u)), u in (0, 1).
  std::vector<double> gumbels(std::int64_t n, bool asked) const {
    std::vector<double> g = uniforms("gumbel", n, asked, cfg_.num_experts);
    for (double& v : g) v = -std::log(-std::log(v + 0x1p-54));
    return g;
  }
  // DeepSpeed's multiplicative jitter (noisy_gate_policy Jitter, training only): the router
  // sees x times a uniform draw in [1 - 1e-2, 1 + 1e-2] per element; jitter(t, c, v) is v times
  // element (t, c)'s factor, or v without jitter.
  struct Jitter {
    std::vector<double> u = {};  // [N * C] uniform draws, empty: none
    std::int64_t C = 0;
    A operator()(std::int64_t t, std::int64_t c, A v) const {
      if (u.empty()) return v;
      constexpr double epsilon = 1e-2;
      const double factor = 1.0 - epsilon + 2.0 * epsilon * u[static_cast<std::size_t>(t * C + c)];
      return v * static_cast<A>(factor);
    }
  };
  Jitter jitter_of(std::int64_t N) const {
    const bool asked = cfg_.noise == GateNoise::jitter && draws_.training;
    return Jitter{uniforms("jitter", N * C_, asked, C_), C_};
  }
  // Rows of a buffer of n rows (at least one, so a batch that kept nothing still has views).
  static std::int64_t at_least_one(std::int64_t n) { return std::max<std::int64_t>(n, 1); }
  // What routing_ (the kept forward's choices) routed.
  MoEStats routed() const {
    return {static_cast<double>(routing_.aux_loss), static_cast<double>(routing_.z_loss),
            routing_.dropped, routing_.tokens * cfg_.k, routing_.capacity};
  }
  // Rows this rank routed, and rows its experts run.
  std::int64_t rows_routed() const { return at_least_one(first_row_.back()); }
  std::int64_t expert_rows() const { return at_least_one(exchange_.rows_received()); }
  // The exchange without an expert-parallel group: every row stays, expert e's rows are its own.
  parallel::ExpertRows local_exchange() const {
    parallel::ExpertRows x;
    x.local = experts().exchanged_experts();
    x.sent.resize(static_cast<std::size_t>(x.local));
    for (int e = 0; e < x.local; ++e) x.sent[e] = first_row_[e + 1] - first_row_[e];
    x.received = x.sent;
    x.expert_first = first_row_;
    x.rows_sent = first_row_.back();
    return x;
  }
  // Runs each local expert's MLP on its rows of expert_in_ into out [R_e, C] (fc_, act_ kept).
  // Split over tp, c_proj's products are partial sums over the hidden units: all-reduced over
  // the group, then the bias added (RowParallelLinear's order, so every tp rank has the same
  // rows).
  void run_experts(Tensor<T> out) {
    const bool split = split_hidden();
    for (int l = 0; l < experts().local_experts(); ++l) {
      const std::int64_t first = exchange_.expert_first[static_cast<std::size_t>(l)];
      const std::int64_t n = exchange_.expert_rows(l);
      if (n == 0) continue;
      ops::cpu::linear_forward<T>(fc_.data() + first * H_, expert_in_.data() + first * C_,
                                  experts().value(l, 0), experts().value(l, 1), n, C_, H_);
      ops::cpu::gelu_forward<T>(act_.data() + first * H_, fc_.data() + first * H_, n * H_);
      ops::cpu::linear_forward<T>(out.data() + first * C_, act_.data() + first * H_,
                                  experts().value(l, 2), split ? nullptr : experts().value(l, 3), n,
                                  H_, C_);
    }
    if (!split) return;
    const std::int64_t rows = exchange_.rows_received();
    parallel::region_forward(parallel::Region::reduce_from_tp, tp(), out.data(), out.data(), rows,
                             C_);
    for (int l = 0; l < experts().local_experts(); ++l) {  // each row plus its expert's bias
      T* rows = out.data() + exchange_.expert_first[static_cast<std::size_t>(l)] * C_;
      ops::cpu::add_periodic_rows(rows, rows, experts().value(l, 3), exchange_.expert_rows(l), 1,
                                  C_);
    }
  }
  // Sends rows [R, C] to the experts' ranks (expert_rows [R_e, C]), and back.
  void dispatch(StepContext<T>& ctx, Tensor<T> rows, Tensor<T> expert_rows) {
    const auto mark = ctx.arena->mark();
    Tensor<T> scratch = ctx.arena->template allocate<T>({expert_rows.dim(0), C_});
    parallel::dispatch(ep().comm(), exchange_, rows.data(), expert_rows.data(), scratch.data(), C_);
    ctx.arena->release(mark);
  }
  void combine(StepContext<T>& ctx, Tensor<T> expert_rows, Tensor<T> rows) {
    const auto mark = ctx.arena->mark();
    Tensor<T> scratch = ctx.arena->template allocate<T>({expert_rows.dim(0), C_});
    parallel::combine(ep().comm(), exchange_, expert_rows.data(), rows.data(), scratch.data(), C_);
    ctx.arena->release(mark);
  }
  // Calls fn(t, j, row) for every kept choice j of token t whose expert this rank's exchange
  // covers (every one, but for whole experts over tp); row is its row in the experts' buffers.
  template <class Fn>
  void for_each_kept(Fn&& fn) const {
    for (std::int64_t t = 0; t < routing_.tokens; ++t) {
      for (int j = 0; j < routing_.k; ++j) {
        const std::size_t i = routing_.at(t, j);
        if (routing_.slot[i] < 0) continue;
        const int x = experts().exchange_index(routing_.expert[i]);
        if (x < 0) continue;  // another tp rank's expert (whole experts over tp)
        fn(t, j, first_row_[static_cast<std::size_t>(x)] + routing_.slot[i]);
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
  // to[i] += from[i] for i < n, rounded once to T.
  static void add_into(T* to, const A* from, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      to[i] = ops::cpu::store<T>(ops::cpu::load(to[i]) + from[i]);
    }
  }
  // Megatron's sequence parallelism: the rows arrive split over tp (each rank a contiguous
  // block), and the layer runs on all of them on every tp rank, as without it.
  bool sequence_parallel() const { return tp().sequence_parallel(); }
  // The experts' hidden units split over tp (expert tensor parallelism), or whole experts split
  // over the tp ranks (ExpertTensorParallel::experts); neither without a tensor-parallel group.
  bool split_hidden() const { return tp().active() && !experts().whole_experts_over_tp(); }
  bool whole_experts() const { return experts().whole_experts_over_tp(); }
  // The sum over tp of every tp rank's partial [N, C] in the compute type: all-reduced in place,
  // or under sequence parallelism reduce-scattered to this rank's block of rows (arena).
  const A* sum_over_tp(StepContext<T>& ctx, Tensor<A> part) const {
    const auto n = static_cast<std::size_t>(part.numel());
    if (!sequence_parallel()) {
      tp().comm().all_reduce(std::span<A>(part.data(), n), parallel::ReduceOp::sum);
      return part.data();
    }
    const std::size_t own = n / static_cast<std::size_t>(tp().size());
    Tensor<A> mine = ctx.arena->template allocate<A>({static_cast<std::int64_t>(own)});
    tp().comm()
        .reduce_scatter_async(std::span<const A>(part.data(), n), std::span<A>(mine.data(), own),
                              parallel::ReduceOp::sum)
        .wait();
    return mine.data();
  }
  // Every tp rank's rows of x [n, C] gathered in order: [tp n, C] (arena, kept with the unit).
  Tensor<T> gather_rows(StepContext<T>& ctx, const Tensor<T>& x) const {
    const std::int64_t n = rows_of(x, C_, describe());
    Tensor<T> all = ctx.arena->template allocate<T>({n * tp().size(), C_});
    parallel::region_forward(parallel::Region::gather_from_sp, tp(), x.data(), all.data(), n, C_);
    return all;
  }
  // This tp rank's block of the rows of y [tp n, C], shaped like the layer's input.
  Tensor<T> own_rows(StepContext<T>& ctx, const Tensor<T>& y, const Shape& shape) const {
    Tensor<T> out = ctx.arena->template allocate<T>(shape);
    const T* first = y.data() + tp().rank() * out.numel();
    std::copy(first, first + out.numel(), out.data());
    return out;
  }

  std::string name_;
  RouterConfig cfg_;
  double gate_stddev_;
  std::unique_ptr<ExpertStack<T>> owned_;  // the experts, when the layer holds them
  const ExpertStack<T>* experts_;          // owned_, or another unit's stack
  std::int64_t C_ = 0, H_ = 0;
  ParamView<T> gate_;
  MoEStats stats_;   // the last forward's
  MoEStats window_;  // summed over backwards since reset_window_stats()
  // What forward keeps for backward.
  Tensor<T> input_;
  DrawPlace draws_;  // where its random draws came from
  Routing<A> routing_;
  std::vector<std::int64_t> first_row_;  // [X + 1] the exchanged experts' first rows
  parallel::ExpertRows exchange_;        // which rows the local experts ran
  Tensor<T> expert_in_, fc_, act_;       // the local experts' input rows and activations
  Tensor<T> rows_out_;                   // the experts' outputs of this rank's rows
};

}  // namespace zero::nn
