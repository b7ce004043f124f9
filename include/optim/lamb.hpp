#pragma once
// LAMB over a flat fp32 shard with per-tensor trust ratios.
// You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
// ICLR 2020, Algorithm 2 (bias-corrected Adam direction plus decoupled weight decay, scaled per
// layer by ||p|| / ||u||), with DeepSpeed FusedLamb's clamp of the ratio to [min_trust, max_trust]
// and ratio 1 when either norm is zero. LambHyper::corrections_in_step_size takes FusedLamb's
// form instead (what a DeepSpeed config builds): u from the uncorrected moments, and the bias
// corrections in the step size, lr * sqrt(1 - beta2^t) / (1 - beta1^t), outside the ratio.
//
// Three passes, because the ratio of a tensor needs the norm of its whole update before any
// element may change: (1) moments: m, v from the unscaled, clipped gradient; (2) norms: the sums
// of p^2 and u^2 per tensor, in double over fixed blocks combined in a fixed order, so they are
// identical for any thread count; (3) apply: p -= lr * ratio * u and the low-precision copy.
// The direction u is recomputed in pass 3 by the same operations as in pass 2 instead of being
// stored, which saves a shard-sized buffer. A tensor split across ranks (ZeRO's shards, a
// tensor-parallel weight) needs its partial sums summed over them between passes 2 and 3: give
// the optimizer which whole tensor each of its tensors is a part of (`whole`) and
// StepOptions::sum_over_ranks, and step() sums them through it (whole_norms); or call
// begin_step, local_norms, reduce, finish_step.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <optim/adam_hyper.hpp>
#include <optim/cpu/fused_driver.hpp>
#include <optim/flat_optimizer.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

/// Per-group hyper-parameters of LAMB (the paper's eps and decay; DeepSpeed's ratio clamp).
struct LambHyper {
  double lr = 1e-3;            ///< learning rate
  double beta1 = 0.9;          ///< first-moment decay
  double beta2 = 0.999;        ///< second-moment decay
  double eps = 1e-6;           ///< added to sqrt(v_hat)
  double weight_decay = 0.01;  ///< decoupled, inside the trust-ratio-scaled update
  double min_trust = 0.01;     ///< lower clamp of the trust ratio
  double max_trust = 10.0;     ///< upper clamp of the trust ratio
  /// DeepSpeed FusedLamb's form: u = m / (sqrt(v) + eps) + wd * p from the uncorrected
  /// moments, and p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * ratio * u; false: the paper's.
  bool corrections_in_step_size = false;
};

/// Throws ConfigError naming the bad LAMB hyper-parameter of group index group (beta 1 would
/// divide by a zero bias correction, and a min_coeff above max_coeff is no clamp).
inline void validate(const LambHyper& h, std::size_t group, const char* who) {
  // lr, betas, eps and weight_decay have Adam's ranges.
  validate(AdamHyper{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay}, group, who);
  expect<ConfigError>(h.min_trust >= 0.0 && h.min_trust <= h.max_trust, who, ": group ", group,
                      ": the trust ratio's clamp [min_coeff, max_coeff] = [", h.min_trust, ", ",
                      h.max_trust, "] must have 0 <= min_coeff <= max_coeff");
}

/// Sums of squares per tensor: of the parameters and of the update direction.
struct LambNorms {
  std::vector<double> param_sq;   ///< sum of p^2 per tensor
  std::vector<double> update_sq;  ///< sum of u^2 per tensor
};

/// LAMB over a flat shard; states exp_avg, exp_avg_sq; tensors give the trust-ratio boundaries.
class Lamb : public FlatOptimizer<LambHyper> {
 public:
  /// whole[t] for a tensor of the shard that is no part of a whole tensor (padding).
  static constexpr std::size_t no_whole = static_cast<std::size_t>(-1);

  /// One group over the whole shard, with tensor boundaries (empty: the whole shard is one).
  explicit Lamb(std::size_t numel, const LambHyper& hyper = {}, std::vector<Range> tensors = {})
      : Lamb(numel, single_group(numel, hyper), std::move(tensors)) {}
  /// Several groups; every tensor must lie inside one group (empty: one tensor per group).
  /// whole, when given, says which of whole_count tensors split over ranks each tensor is a part
  /// of (no_whole: none, the shard's alone), one entry a tensor; tensors left empty take no
  /// whole (their group ranges are padding or the shard's alone). A step given
  /// StepOptions::sum_over_ranks sums the norms of the parts of a whole tensor over the ranks.
  Lamb(std::size_t numel, std::vector<ParamGroup<LambHyper>> groups, std::vector<Range> tensors,
       std::vector<std::size_t> whole = {}, std::size_t whole_count = 0)
      : FlatOptimizer<LambHyper>("LAMB", numel, std::move(groups), {"exp_avg", "exp_avg_sq"}),
        tensors_(std::move(tensors)),
        whole_(std::move(whole)),
        whole_count_(whole_count) {
    expect<ConfigError>(whole_.empty() || whole_.size() == tensors_.size(), "LAMB: ", whole_.size(),
                        " whole-tensor indices for ", tensors_.size(), " tensors");
    if (tensors_.empty()) {
      for (const auto& g : groups_) tensors_.push_back(g.range);
    }
    whole_.resize(tensors_.size(), no_whole);
    for (const std::size_t w : whole_) {
      expect<ConfigError>(w == no_whole || w < whole_count_, "LAMB: whole-tensor index ", w, " of ",
                          whole_count_);
    }
    validate_groups();
    validate_ranges(tensors_, numel_, "LAMB tensors");
    for (const Range& t : tensors_) {
      std::size_t owner = groups_.size();
      for (std::size_t k = 0; k < groups_.size(); ++k) {
        const Range& g = groups_[k].range;
        if (t.offset >= g.offset && t.end() <= g.end()) owner = k;
      }
      expect<ConfigError>(owner < groups_.size() || t.count == 0, "LAMB: tensor [", t.offset, ", ",
                          t.end(), ") does not lie inside one parameter group");
      group_of_.push_back(owner < groups_.size() ? owner : 0);
    }
  }

  /// The tensor boundaries the trust ratios are computed over.
  const std::vector<Range>& tensors() const { return tensors_; }

  /// Pass 1: advances the step and updates the moments from the gradient.
  void begin_step(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, true, "LAMB");
    expect_host(run);
    begin_counted_step();  // a schedule (OneCycle's betas) may have changed them
    std::vector<LambMomentsRule> rules;
    for (const auto& g : groups_) {
      const LambHyper& h = g.hyper;
      rules.push_back({static_cast<float>(h.beta1), static_cast<float>(1.0 - h.beta1),
                       static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2)});
    }
    const auto r = ranges();
    const auto s = state_pointers();
    run_fused<LambMomentsRule>(rules, r, io, s, static_cast<std::uint32_t>(step_), run);
  }

  /// Pass 2: this shard's sums of p^2 and u^2 per tensor (to be summed over ranks when a
  /// tensor is split); deterministic for any thread count.
  LambNorms local_norms(const FusedIo& io, const StepOptions& run = {}) {
    validate(io, numel_, false, "LAMB");
    expect_host(run);
    struct Block {
      std::size_t tensor, begin, end;
    };
    std::vector<Block> blocks;
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      for (std::size_t b = tensors_[t].offset; b < tensors_[t].end(); b += norm_block_elems) {
        blocks.push_back({t, b, std::min(tensors_[t].end(), b + norm_block_elems)});
      }
    }
    std::vector<double> partial_p(blocks.size()), partial_u(blocks.size());
    const auto states = state_pointers();
    const float* m = states[0];
    const float* v = states[1];
    const auto count = static_cast<std::int64_t>(blocks.size());
    [[maybe_unused]] const int threads = detail::thread_count(run.threads);
#if defined(ZERO_WITH_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
    for (std::int64_t k = 0; k < count; ++k) {
      const Block& b = blocks[static_cast<std::size_t>(k)];
      const LambDirection dir = direction(groups_[group_of_[b.tensor]].hyper);
      double sp = 0.0, su = 0.0;
      for (std::size_t i = b.begin; i < b.end; ++i) {
        const float u = dir.operator()<ScalarOps>(io.param[i], m[i], v[i]);
        sp += static_cast<double>(io.param[i]) * io.param[i];
        su += static_cast<double>(u) * u;
      }
      partial_p[static_cast<std::size_t>(k)] = sp;
      partial_u[static_cast<std::size_t>(k)] = su;
    }
    LambNorms out{std::vector<double>(tensors_.size(), 0.0),
                  std::vector<double>(tensors_.size(), 0.0)};
    for (std::size_t k = 0; k < blocks.size(); ++k) {
      out.param_sq[blocks[k].tensor] += partial_p[k];
      out.update_sq[blocks[k].tensor] += partial_u[k];
    }
    return out;
  }

  /// The trust ratio of tensor t from its global sums of squares.
  double trust_ratio(std::size_t t, double param_sq, double update_sq) const {
    const LambHyper& h = groups_[group_of_[t]].hyper;
    const double pn = std::sqrt(param_sq), un = std::sqrt(update_sq);
    if (!(pn > 0.0) || !(un > 0.0)) return 1.0;
    return std::clamp(pn / un, h.min_trust, h.max_trust);
  }

  /// Pass 3: p -= lr * ratio * u per tensor, with the low-precision copy.
  void finish_step(const FusedIo& io, const LambNorms& global, const StepOptions& run = {}) {
    validate(io, numel_, false, "LAMB");
    expect<Error>(
        global.param_sq.size() == tensors_.size() && global.update_sq.size() == tensors_.size(),
        "LAMB::finish_step: norms for ", global.param_sq.size(), " tensors, expected ",
        tensors_.size());
    std::vector<LambApplyRule> rules;
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      const LambHyper& h = groups_[group_of_[t]].hyper;
      const double ratio = trust_ratio(t, global.param_sq[t], global.update_sq[t]);
      rules.push_back({direction(h), static_cast<float>(-h.lr * step_size_factor(h) * ratio)});
    }
    const auto s = state_pointers();
    run_fused<LambApplyRule>(rules, tensors_, io, s, static_cast<std::uint32_t>(step_), run);
  }

  /// The sums of the whole tensors from this shard's (local_norms): the parts' sums are
  /// gathered by whole tensor into 2 * whole_count values (the constructor's; every p^2 sum, then
  /// every u^2 sum), sum_over_ranks sums those over the ranks, and each part takes its whole
  /// tensor's; a tensor that is no part of one keeps its own.
  LambNorms whole_norms(const LambNorms& local,
                        const std::function<void(std::span<double>)>& sum_over_ranks) const {
    expect<Error>(
        local.param_sq.size() == tensors_.size() && local.update_sq.size() == tensors_.size(),
        "LAMB::whole_norms: norms for ", local.param_sq.size(), " tensors, expected ",
        tensors_.size());
    std::vector<double> sums(2 * whole_count_, 0.0);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (whole_[t] == no_whole) continue;
      sums[whole_[t]] += local.param_sq[t];
      sums[whole_count_ + whole_[t]] += local.update_sq[t];
    }
    sum_over_ranks(std::span<double>(sums));
    LambNorms out = local;
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (whole_[t] == no_whole) continue;
      out.param_sq[t] = sums[whole_[t]];
      out.update_sq[t] = sums[whole_count_ + whole_[t]];
    }
    return out;
  }

  /// All three passes; with StepOptions::sum_over_ranks, the norms of whole tensors split over
  /// ranks between the second and the third (whole_norms).
  void step(const FusedIo& io, const StepOptions& run = {}) {
    begin_step(io, run);
    LambNorms norms = local_norms(io, run);
    if (run.sum_over_ranks) norms = whole_norms(norms, run.sum_over_ranks);
    finish_step(io, norms, run);
  }

 private:
  static constexpr std::size_t norm_block_elems = 4096;

  // The norm pass reads the parameters and moments on the host, so the shard must be there.
  static void expect_host(const StepOptions& run) {
    expect<ConfigError>(run.executor == nullptr,
                        "LAMB: its trust-ratio norms are summed on the host, so it has no pass "
                        "on an executor (",
                        run.executor == nullptr ? "" : run.executor->where(),
                        "): use another optimizer there, or keep LAMB's states in host memory "
                        "(Offload<CPU>)");
  }

  // The bias corrections of this step, 1 - beta^t.
  double bias1(const LambHyper& h) const {
    return 1.0 - std::pow(h.beta1, static_cast<double>(step_));
  }
  double bias2(const LambHyper& h) const {
    return 1.0 - std::pow(h.beta2, static_cast<double>(step_));
  }
  // The direction u: the paper's corrects the moments inside it, FusedLamb's does not.
  LambDirection direction(const LambHyper& h) const {
    if (h.corrections_in_step_size) {
      return {1.0f, 1.0f, static_cast<float>(h.eps), static_cast<float>(h.weight_decay)};
    }
    return {static_cast<float>(1.0 / bias1(h)), static_cast<float>(1.0 / std::sqrt(bias2(h))),
            static_cast<float>(h.eps), static_cast<float>(h.weight_decay)};
  }
  // What multiplies lr: FusedLamb's bias corrections, or 1 when u carries them.
  double step_size_factor(const LambHyper& h) const {
    return h.corrections_in_step_size ? std::sqrt(bias2(h)) / bias1(h) : 1.0;
  }

  std::vector<Range> tensors_;
  std::vector<std::size_t> whole_;  ///< per tensor: the whole tensor it is a part of
  std::size_t whole_count_ = 0;
  std::vector<std::size_t> group_of_;
};

}  // namespace zero::optim
