// Each optimizer against a plain f64 implementation of its published update rule, written
// directly from the source below (not from update_rules.hpp), over many steps:
//   SGD, RMSprop, Adagrad: the algorithm boxes of PyTorch's torch.optim docs (2.x).
//   Adam:  Kingma & Ba, ICLR 2015, Algorithm 1 (m_hat, v_hat; eps added to sqrt(v_hat)), with
//          torch.optim.Adam's weight decay g += wd * p.
//   AdamW: Loshchilov & Hutter, ICLR 2019, Algorithm 2 with torch.optim.AdamW's scaling of the
//          decay by lr: p -= lr * wd * p, then the Adam step.
//   Lion:  Chen et al. 2023, Algorithm 2: c = b1 m + (1-b1) g; p -= lr (sign(c) + wd p);
//          m = b2 m + (1-b2) g.
//   LAMB:  You et al., ICLR 2020, Algorithm 2, per-tensor ratio ||p|| / ||u|| clamped to
//          [0.01, 10] as DeepSpeed FusedLamb; and FusedLamb's own form (DeepSpeed's
//          csrc/lamb: u from the uncorrected moments, lr * sqrt(1 - b2^t) / (1 - b1^t)).
// The fp32 implementation must stay within a tight relative bound of the f64 one; a negative
// control (a deliberately wrong reference) must fail the same bound.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <optim/adagrad.hpp>
#include <optim/adam.hpp>
#include <optim/any_optimizer.hpp>
#include <optim/lamb.hpp>
#include <optim/lion.hpp>
#include <optim/rmsprop.hpp>
#include <optim/sgd.hpp>

#include "../support/worse.hpp"
#include "optim_test_util.hpp"

namespace {

using namespace zero::optim;
using Vec = std::vector<double>;

constexpr std::size_t n = 203;
constexpr int steps = 60;
// Loss scale and clip coefficient folded into the gradient factor; both powers of two, so the
// scaled fp32 gradient unscales exactly and the reference sees the same values.
constexpr double loss_scale = 1024.0;
constexpr double clip = 0.5;

// The gradient of step t as the engine would hand it (scaled by the loss scale), and the
// unscaled, clipped value the reference uses.
std::vector<float> scaled_grad(int t) {
  auto g = optim_test::make_data(n, 1000 + t, 1.0, false);
  for (float& x : g) x *= static_cast<float>(loss_scale);
  return g;
}
Vec reference_grad(int t) {
  Vec out;
  for (float x : scaled_grad(t)) out.push_back(static_cast<double>(x) / loss_scale * clip);
  return out;
}
Vec initial_params() {
  Vec out;
  for (float x : optim_test::make_data(n, 7, 1.0, false)) out.push_back(x);
  return out;
}

// Largest |a - b| / (1 + |b|): relative for large values, absolute near zero.
double max_error(const float* a, const Vec& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    worst = zero::testing::worse(worst, std::fabs(double(a[i]) - b[i]) / (1.0 + std::fabs(b[i])));
  }
  return worst;
}

// Runs steps fused steps of opt over the shared data; returns the fp32 parameters.
template <class Opt>
std::vector<float> run_fp32(Opt& opt) {
  std::vector<float> p;
  for (double x : initial_params()) p.push_back(static_cast<float>(x));
  for (int t = 1; t <= steps; ++t) {
    const auto g = scaled_grad(t);
    auto io = FusedIo::over<float>(p, g).scale_grad(static_cast<float>(clip / loss_scale));
    opt.step(io);
  }
  return p;
}

constexpr double tolerance = 2e-5;

// ---- references --------------------------------------------------------------------------------

Vec ref_sgd(double lr, double wd, double momentum, double dampening, bool nesterov) {
  Vec p = initial_params(), buf(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const Vec g = reference_grad(t);
    for (std::size_t i = 0; i < n; ++i) {
      double d = g[i] + wd * p[i];
      if (momentum != 0.0) {
        buf[i] = t == 1 ? d : momentum * buf[i] + (1.0 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
  return p;
}

Vec ref_rmsprop(double lr, double alpha, double eps, double wd, double momentum, bool centered) {
  Vec p = initial_params(), v(n, 0.0), ga(n, 0.0), buf(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const Vec g0 = reference_grad(t);
    for (std::size_t i = 0; i < n; ++i) {
      const double g = g0[i] + wd * p[i];
      v[i] = alpha * v[i] + (1.0 - alpha) * g * g;
      double avg;
      if (centered) {
        ga[i] = alpha * ga[i] + (1.0 - alpha) * g;
        avg = std::sqrt(v[i] - ga[i] * ga[i]) + eps;
      } else {
        avg = std::sqrt(v[i]) + eps;
      }
      if (momentum > 0.0) {
        buf[i] = momentum * buf[i] + g / avg;
        p[i] -= lr * buf[i];
      } else {
        p[i] -= lr * g / avg;
      }
    }
  }
  return p;
}

Vec ref_adagrad(double lr, double lr_decay, double wd, double init, double eps) {
  Vec p = initial_params(), sum(n, init);
  for (int t = 1; t <= steps; ++t) {
    const Vec g0 = reference_grad(t);
    const double clr = lr / (1.0 + (t - 1) * lr_decay);
    for (std::size_t i = 0; i < n; ++i) {
      const double g = g0[i] + wd * p[i];
      sum[i] += g * g;
      p[i] -= clr * g / (std::sqrt(sum[i]) + eps);
    }
  }
  return p;
}

// Adam / AdamW; bias_correction=false is the negative control.
Vec ref_adam(const AdamHyper& h, bool decoupled, bool bias_correction = true) {
  Vec p = initial_params(), m(n, 0.0), v(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const Vec g0 = reference_grad(t);
    for (std::size_t i = 0; i < n; ++i) {
      const double g = decoupled ? g0[i] : g0[i] + h.weight_decay * p[i];
      m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
      const double m_hat = bias_correction ? m[i] / (1.0 - std::pow(h.beta1, t)) : m[i];
      const double v_hat = bias_correction ? v[i] / (1.0 - std::pow(h.beta2, t)) : v[i];
      if (decoupled) p[i] -= h.lr * h.weight_decay * p[i];
      p[i] -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
    }
  }
  return p;
}

Vec ref_lion(const LionHyper& h) {
  Vec p = initial_params(), m(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const Vec g = reference_grad(t);
    for (std::size_t i = 0; i < n; ++i) {
      const double c = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
      const double s = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      p[i] -= h.lr * (s + h.weight_decay * p[i]);
      m[i] = h.beta2 * m[i] + (1.0 - h.beta2) * g[i];
    }
  }
  return p;
}

// fused: FusedLamb's form, u = m / (sqrt(v) + eps) + wd * p and the corrections in the step.
Vec ref_lamb(const LambHyper& h, const std::vector<Range>& tensors, bool trust = true,
             bool fused = false) {
  Vec p = initial_params(), m(n, 0.0), v(n, 0.0), u(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const Vec g = reference_grad(t);
    const double bias1 = 1.0 - std::pow(h.beta1, t), bias2 = 1.0 - std::pow(h.beta2, t);
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
      v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g[i] * g[i];
      const double m_hat = fused ? m[i] : m[i] / bias1;
      const double v_hat = fused ? v[i] : v[i] / bias2;
      u[i] = m_hat / (std::sqrt(v_hat) + h.eps) + h.weight_decay * p[i];
    }
    const double step_size = fused ? h.lr * std::sqrt(bias2) / bias1 : h.lr;
    for (const Range& r : tensors) {
      double pn = 0.0, un = 0.0;
      for (std::size_t i = r.offset; i < r.end(); ++i) {
        pn += p[i] * p[i];
        un += u[i] * u[i];
      }
      pn = std::sqrt(pn);
      un = std::sqrt(un);
      double ratio = (pn > 0 && un > 0) ? std::clamp(pn / un, h.min_trust, h.max_trust) : 1.0;
      if (!trust) ratio = 1.0;
      for (std::size_t i = r.offset; i < r.end(); ++i) p[i] -= step_size * ratio * u[i];
    }
  }
  return p;
}

}  // namespace

TEST_CASE("SGD matches torch.optim.SGD's rule in f64", "[unit][optim]") {
  SECTION("plain with weight decay") {
    Sgd opt(n, SgdHyper{0.05, 0.01});
    const auto p = run_fp32(opt);
    CHECK(max_error(p.data(), ref_sgd(0.05, 0.01, 0, 0, false)) < tolerance);
    CHECK(opt.state_names().empty());
  }
  SECTION("momentum with dampening") {
    Sgd opt(n, SgdHyper{0.05, 0.01}, SgdOptions{0.9, 0.1, false});
    const auto p = run_fp32(opt);
    CHECK(max_error(p.data(), ref_sgd(0.05, 0.01, 0.9, 0.1, false)) < tolerance);
    // Negative control: forgetting that the first step copies the gradient must be visible.
    CHECK(max_error(p.data(), ref_sgd(0.05, 0.01, 0.9, 0.0, false)) > 10 * tolerance);
  }
  SECTION("nesterov") {
    Sgd opt(n, SgdHyper{0.05, 0.0}, SgdOptions{0.9, 0.0, true});
    const auto p = run_fp32(opt);
    CHECK(max_error(p.data(), ref_sgd(0.05, 0.0, 0.9, 0.0, true)) < tolerance);
    CHECK(max_error(p.data(), ref_sgd(0.05, 0.0, 0.9, 0.0, false)) > 10 * tolerance);
  }
  SECTION("nesterov without momentum is rejected") {
    CHECK_THROWS_AS(Sgd(n, SgdHyper{}, SgdOptions{0.0, 0.0, true}), zero::ConfigError);
  }
}

TEST_CASE("RMSprop matches torch.optim.RMSprop's rule in f64", "[unit][optim]") {
  for (bool centered : {false, true}) {
    for (double momentum : {0.0, 0.8}) {
      DYNAMIC_SECTION("centered " << centered << " momentum " << momentum) {
        Rmsprop opt(n, RmspropHyper{1e-2, 0.9, 1e-8, 0.02}, RmspropOptions{momentum, centered});
        const auto p = run_fp32(opt);
        CHECK(max_error(p.data(), ref_rmsprop(1e-2, 0.9, 1e-8, 0.02, momentum, centered)) <
              tolerance);
        CHECK(max_error(p.data(), ref_rmsprop(1e-2, 0.9, 1e-8, 0.02, momentum, !centered)) >
              10 * tolerance);
      }
    }
  }
}

TEST_CASE("Adagrad matches torch.optim.Adagrad's rule in f64", "[unit][optim]") {
  Adagrad opt(n, AdagradHyper{0.1, 0.01, 1e-10, 0.01}, 0.1);
  const auto p = run_fp32(opt);
  CHECK(max_error(p.data(), ref_adagrad(0.1, 0.01, 0.01, 0.1, 1e-10)) < tolerance);
  CHECK(max_error(p.data(), ref_adagrad(0.1, 0.0, 0.01, 0.1, 1e-10)) > 10 * tolerance);
}

TEST_CASE("Adam and AdamW match Kingma & Ba / Loshchilov & Hutter in f64", "[unit][optim]") {
  const AdamHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1};
  SECTION("Adam (L2)") {
    Adam opt(n, h);
    const auto p = run_fp32(opt);
    CHECK(max_error(p.data(), ref_adam(h, false)) < tolerance);
    // Negative controls: decoupled decay, or no bias correction, must not pass.
    CHECK(max_error(p.data(), ref_adam(h, true)) > 10 * tolerance);
    CHECK(max_error(p.data(), ref_adam(h, false, false)) > 10 * tolerance);
  }
  SECTION("AdamW (decoupled)") {
    AdamW opt(n, h);
    const auto p = run_fp32(opt);
    CHECK(max_error(p.data(), ref_adam(h, true)) < tolerance);
    CHECK(max_error(p.data(), ref_adam(h, false)) > 10 * tolerance);
    CHECK(opt.step_count() == steps);
  }
  SECTION("AdamW's defaults are PyTorch's") {
    const AdamHyper d = AdamW::default_hyper();
    CHECK(d.lr == 1e-3);
    CHECK(d.weight_decay == 0.01);
    CHECK(Adam::default_hyper().weight_decay == 0.0);
  }
}

TEST_CASE("Lion matches Chen et al. 2023 in f64", "[unit][optim]") {
  const LionHyper h{1e-3, 0.9, 0.99, 0.5};
  Lion opt(n, h);
  const auto p = run_fp32(opt);
  CHECK(max_error(p.data(), ref_lion(h)) < tolerance);
  LionHyper swapped = h;
  std::swap(swapped.beta1, swapped.beta2);
  CHECK(max_error(p.data(), ref_lion(swapped)) > 10 * tolerance);
}

TEST_CASE("LAMB matches You et al. 2020 with per-tensor trust ratios", "[unit][optim]") {
  LambHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  const std::vector<Range> tensors{{0, 50}, {50, 3}, {53, 150}};
  Lamb opt(n, h, tensors);
  const auto p = run_fp32(opt);
  CHECK(max_error(p.data(), ref_lamb(h, tensors)) < tolerance);
  // Negative controls: one ratio for the whole shard, or no ratio at all.
  CHECK(max_error(p.data(), ref_lamb(h, {{0, n}})) > 10 * tolerance);
  CHECK(max_error(p.data(), ref_lamb(h, tensors, false)) > 10 * tolerance);
}

TEST_CASE("LAMB over two shards of one tensor list equals it whole: the parts' norms summed",
          "[unit][optim]") {
  // The tensors {0, 50}, {50, 3}, {53, 150} cut at 100, as ZeRO cuts a unit between two ranks:
  // rank 0 holds whole tensors 0 and 1 and the first 47 elements of tensor 2, rank 1 the rest of
  // tensor 2. Each part takes its whole tensor's ratio once the norms are summed (whole_norms,
  // what step() calls through StepOptions::sum_over_ranks); with its own part's it does not.
  LambHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  const std::vector<Range> tensors{{0, 50}, {50, 3}, {53, 150}};
  constexpr std::size_t cut = 100;
  const auto run = [&](bool summed) {
    Lamb first(cut, single_group(cut, h), {{0, 50}, {50, 3}, {53, 47}}, {0, 1, 2}, 3);
    Lamb second(n - cut, single_group(n - cut, h), {{0, n - cut}}, {2}, 3);
    std::vector<float> p;
    for (double x : initial_params()) p.push_back(static_cast<float>(x));
    for (int t = 1; t <= steps; ++t) {
      auto g = scaled_grad(t);
      const auto io = [&](std::size_t begin, std::size_t count) {
        return FusedIo::over<float>(std::span<float>(p).subspan(begin, count),
                                    std::span<const float>(g).subspan(begin, count))
            .scale_grad(static_cast<float>(clip / loss_scale));
      };
      const FusedIo io0 = io(0, cut), io1 = io(cut, n - cut);
      first.begin_step(io0);
      second.begin_step(io1);
      LambNorms n0 = first.local_norms(io0), n1 = second.local_norms(io1);
      if (summed) {
        // Each rank's packed sums, as sum_over_ranks sees them; the all-reduce adds the other's.
        std::vector<double> packed0, packed1;
        first.whole_norms(n0, [&](std::span<double> v) { packed0.assign(v.begin(), v.end()); });
        second.whole_norms(n1, [&](std::span<double> v) { packed1.assign(v.begin(), v.end()); });
        REQUIRE(packed0.size() == 6);
        n0 = first.whole_norms(n0, [&](std::span<double> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] += packed1[i];
        });
        n1 = second.whole_norms(n1, [&](std::span<double> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] += packed0[i];
        });
      }
      first.finish_step(io0, n0);
      second.finish_step(io1, n1);
    }
    return p;
  };
  const auto summed = run(true);
  CHECK(max_error(summed.data(), ref_lamb(h, tensors)) < tolerance);
  // Negative control: each part's ratio from its own norms.
  CHECK(max_error(run(false).data(), ref_lamb(h, tensors)) > 10 * tolerance);
  // A whole-tensor index past the count, or a list of the wrong length, is refused.
  CHECK_THROWS_WITH(Lamb(10, single_group(10, h), {{0, 10}}, {3}, 3),
                    Catch::Contains("whole-tensor index 3 of 3"));
  CHECK_THROWS_WITH(Lamb(10, single_group(10, h), {{0, 5}, {5, 5}}, {0}, 3),
                    Catch::Contains("1 whole-tensor indices for 2 tensors"));
}

TEST_CASE(
    "LAMB from a DeepSpeed config is FusedLamb's update: the bias corrections in the step size",
    "[unit][optim]") {
  LambHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  h.eps = 1e-8;
  h.corrections_in_step_size = true;
  const std::vector<Range> tensors{{0, 50}, {50, 3}, {53, 150}};
  Lamb opt(n, h, tensors);
  const auto p = run_fp32(opt);
  CHECK(max_error(p.data(), ref_lamb(h, tensors, true, true)) < tolerance);
  // Negative control: the paper's form, which a config built before (early steps ~3x larger).
  CHECK(max_error(p.data(), ref_lamb(h, tensors)) > 10 * tolerance);
  // The config's "LAMB" (FusedLamb's eps 1e-8 and weight decay as given).
  zero::NamedParams spec;
  spec.type = "LAMB";
  spec.params["lr"] = {1e-2};
  spec.params["weight_decay"] = {0.01};
  AnyOptimizer configured = AnyOptimizer::from_config(spec, n, {});
  const auto q = run_fp32(configured);
  CHECK(max_error(q.data(), ref_lamb(h, {{0, n}}, true, true)) < tolerance);
}

TEST_CASE("Lion from a DeepSpeed config takes FusedLion's defaults", "[unit][optim]") {
  zero::NamedParams spec;
  spec.type = "Lion";
  const AnyOptimizer lion = AnyOptimizer::from_config(spec, 4, {});
  CHECK(lion.lr() == 1e-3);
  CHECK(lion.betas() == std::pair<double, double>{0.9, 0.999});  // was 0.99, the paper's
}

TEST_CASE("a step refused for a bad hyper-parameter leaves the step count as it was",
          "[unit][optim]") {
  // The count went up before the check, so the next step's bias corrections were one off.
  std::vector<float> p(8, 1.0f), g(8, 0.5f);
  const auto io = FusedIo::over<float>(p, g);
  const auto refused = [&](auto opt) {
    opt.step(io);
    opt.set_lr(-1.0);  // a schedule gone wrong
    CHECK_THROWS_WITH(opt.step(io), Catch::Contains("lr must be >= 0"));
    return opt.step_count();
  };
  CHECK(refused(AdamW(8)) == 1);
  CHECK(refused(Sgd(8, SgdHyper{0.1, 0.0})) == 1);
  CHECK(refused(Lion(8)) == 1);
  CHECK(refused(Adagrad(8)) == 1);
  CHECK(refused(Rmsprop(8)) == 1);
  Lamb lamb(8);
  lamb.step(io);
  lamb.set_lr(-1.0);
  CHECK_THROWS_WITH(lamb.step(io), Catch::Contains("lr must be >= 0"));
  CHECK(lamb.step_count() == 1);
}

TEST_CASE("LAMB rejects a tensor that straddles two groups", "[unit][optim]") {
  std::vector<ParamGroup<LambHyper>> groups{{{0, 10}, {}}, {{10, 10}, {}}};
  CHECK_THROWS_AS(Lamb(20, groups, {{0, 5}, {5, 10}, {15, 5}}), zero::ConfigError);
  CHECK_NOTHROW(Lamb(20, groups, {{0, 5}, {5, 5}, {10, 10}}));
}

TEST_CASE("Parameter groups: no weight decay on a masked range, gaps untouched", "[unit][optim]") {
  // Elements [0, 100) decay, [100, 150) do not (biases), [150, 155) belong to no group,
  // [155, 203) decay with another lr.
  AdamHyper decay{1e-2, 0.9, 0.999, 1e-8, 0.1};
  AdamHyper no_decay = decay;
  no_decay.weight_decay = 0.0;
  AdamHyper other = decay;
  other.lr = 3e-3;
  std::vector<ParamGroup<AdamHyper>> groups{
      {{0, 100}, decay}, {{100, 50}, no_decay}, {{155, 48}, other}};
  AdamW opt(n, groups);
  const auto p = run_fp32(opt);
  const Vec with = ref_adam(decay, true), without = ref_adam(no_decay, true),
            slow = ref_adam(other, true), start = initial_params();
  double err = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double expected = i < 100 ? with[i] : i < 150 ? without[i] : i < 155 ? start[i] : slow[i];
    err = zero::testing::worse(err, std::fabs(p[i] - expected) / (1.0 + std::fabs(expected)));
  }
  CHECK(err < tolerance);
  for (std::size_t i = 150; i < 155; ++i) CHECK(p[i] == static_cast<float>(start[i]));
  // The state of untouched elements stays zero.
  CHECK(opt.state("exp_avg")[152] == 0.0f);
}

TEST_CASE("Groups from a no-decay mask", "[unit][optim]") {
  std::vector<std::uint8_t> mask{0, 0, 1, 1, 1, 0, 1};
  const auto on = ranges_from_mask(mask, true);
  REQUIRE(on.size() == 2);
  CHECK(on[0] == Range{2, 3});
  CHECK(on[1] == Range{6, 1});
  AdamHyper d, nd;
  d.weight_decay = 0.1;
  const auto groups = groups_from_mask<AdamHyper>(mask, d, nd);
  REQUIRE(groups.size() == 4);
  CHECK(groups[0].range == Range{0, 2});
  CHECK(groups[0].hyper.weight_decay == 0.1);
  CHECK(groups[1].range == Range{2, 3});
  CHECK(groups[1].hyper.weight_decay == 0.0);
  CHECK_THROWS_AS(AdamW(5, groups), zero::ConfigError);  // ranges beyond the shard
  std::vector<ParamGroup<AdamHyper>> overlapping{{{0, 4}, d}, {{3, 2}, d}};
  CHECK_THROWS_AS(AdamW(5, overlapping), zero::ConfigError);
}

TEST_CASE("Optimizer state saves and restores mid-run", "[unit][optim]") {
  const AdamHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1};
  AdamW straight(n, h), first(n, h);
  std::vector<float> p1, p2;
  for (double x : initial_params()) p1.push_back(static_cast<float>(x));
  p2 = p1;
  for (int t = 1; t <= 10; ++t) {
    const auto g = scaled_grad(t);
    straight.step(FusedIo::over<float>(p1, g));
    if (t <= 5) first.step(FusedIo::over<float>(p2, g));
  }
  AdamW resumed(n, h);
  resumed.load_state_dict(first.state_dict());
  CHECK(resumed.step_count() == 5);
  for (int t = 6; t <= 10; ++t) {
    const auto g = scaled_grad(t);
    resumed.step(FusedIo::over<float>(p2, g));
  }
  CHECK(optim_test::count_bit_differences(p1.data(), p2.data(), n) == 0);
  CHECK(optim_test::count_bit_differences(straight.state("exp_avg_sq").data(),
                                          resumed.state("exp_avg_sq").data(), n) == 0);
  // A state of the wrong size is a CheckpointError naming the buffer.
  AdamW other(n + 1, h);
  CHECK_THROWS_WITH(other.load_state_dict(first.state_dict()),
                    Catch::Contains("exp_avg") && Catch::Contains("expected 204"));
}

// What the engine does on a device and NVMe offload does on the host: the states move out to
// memory the owner keeps (release_state_storage, bind_state) and the steps give the same bits.
// Plain SGD has no state, and must still release and bind (an empty list of buffers).
template <class Opt>
void check_bound_states_step_alike(Opt straight, Opt bound_opt) {
  std::vector<float> p1, p2;
  for (double x : initial_params()) p1.push_back(static_cast<float>(x));
  p2 = p1;
  std::vector<std::vector<float>> kept;
  for (const auto& name : bound_opt.state_names()) {
    const auto s = bound_opt.state(name);
    kept.emplace_back(s.begin(), s.end());
  }
  bound_opt.release_state_storage();
  CHECK(bound_opt.state_bytes() == 0);
  std::vector<std::span<float>> spans(kept.begin(), kept.end());
  bound_opt.bind_state(std::span<const std::span<float>>(spans));
  for (int t = 1; t <= 4; ++t) {
    const auto g = scaled_grad(t);
    straight.step(FusedIo::over<float>(p1, g));
    bound_opt.step(FusedIo::over<float>(p2, g));
  }
  CHECK(optim_test::count_bit_differences(p1.data(), p2.data(), n) == 0);
  for (std::size_t k = 0; k < kept.size(); ++k) {
    const auto want = straight.state(straight.state_names()[k]);
    CHECK(optim_test::count_bit_differences(want.data(), kept[k].data(), n) == 0);
  }
}

TEST_CASE("States released to the owner's memory step as the optimizer's own", "[unit][optim]") {
  check_bound_states_step_alike(Sgd(n, SgdHyper{0.1, 0.01}), Sgd(n, SgdHyper{0.1, 0.01}));
  check_bound_states_step_alike(Sgd(n, SgdHyper{0.1, 0.01}, SgdOptions{0.9, 0.0, true}),
                                Sgd(n, SgdHyper{0.1, 0.01}, SgdOptions{0.9, 0.0, true}));
  const AdamHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1};
  check_bound_states_step_alike(AdamW(n, h), AdamW(n, h));
  // bind_state before release_state_storage is refused, stateless or not.
  Sgd plain(n, SgdHyper{0.1, 0.01});
  CHECK_THROWS_WITH(plain.bind_state({}), Catch::Contains("release_state_storage first"));
}

TEST_CASE("FusedIo validation names the problem", "[unit][optim]") {
  AdamW opt(10);
  std::vector<float> p(9), g(9);
  CHECK_THROWS_WITH(opt.step(FusedIo::over<float>(p, g)), Catch::Contains("10"));
  std::vector<float> g2(8);
  CHECK_THROWS_AS(FusedIo::over<float>(p, g2), zero::ShapeError);
}

TEST_CASE("LAMB from a config refuses FusedLamb's own clipping and turning bias correction off",
          "[unit][optim]") {
  zero::NamedParams spec;
  spec.type = "LAMB";
  spec.params["lr"] = {0.01};
  spec.params["max_grad_norm"] = {0.0};  // FusedLamb's default: accepted, nothing to do
  spec.params["bias_correction"] = {1.0};
  const AnyOptimizer ok = AnyOptimizer::from_config(spec, 4, {});
  CHECK(ok.numel() == 4);
  spec.params["max_grad_norm"] = {1.0};  // was accepted and ignored: the run went unclipped
  CHECK_THROWS_WITH(AnyOptimizer::from_config(spec, 4, {}),
                    Catch::Contains("max_grad_norm") && Catch::Contains("gradient_clipping"));
  spec.params["max_grad_norm"] = {0.0};
  spec.params["bias_correction"] = {0.0};
  CHECK_THROWS_WITH(AnyOptimizer::from_config(spec, 4, {}),
                    Catch::Contains("bias_correction: false is not supported"));
}

TEST_CASE("boolean optimizer parameters take only true or false", "[unit][optim]") {
  // The parser stores true/false as 1/0; a 2 or 0.5 read as "not 0" turned adam_w_mode, nesterov
  // or centered on without a word.
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"Adam", "adam_w_mode"},     {"Adam", "torch_adam"},      {"Adam", "amsgrad"},
      {"Adam", "bias_correction"}, {"LAMB", "bias_correction"}, {"SGD", "nesterov"},
      {"RMSprop", "centered"}};
  for (const auto& [type, key] : flags) {
    INFO(type << " " << key);
    zero::NamedParams spec;
    spec.type = type;
    spec.params["lr"] = {0.01};
    spec.params["momentum"] = {0.9};
    if (type != "SGD" && type != "RMSprop") spec.params.erase("momentum");
    spec.params[key] = {0.5};
    CHECK_THROWS_WITH(
        AnyOptimizer::from_config(spec, 4, {}),
        Catch::Contains("optimizer.params." + key) && Catch::Contains("expected true or false"));
  }
  zero::NamedParams adam;
  adam.type = "Adam";
  adam.params["adam_w_mode"] = {0.0};
  adam.params["torch_adam"] = {1.0};
  CHECK(std::holds_alternative<Adam>(AnyOptimizer::from_config(adam, 4, {}).variant()));
  adam.params["adam_w_mode"] = {1.0};
  CHECK(std::holds_alternative<AdamW>(AnyOptimizer::from_config(adam, 4, {}).variant()));
}

TEST_CASE("every optimizer refuses hyper-parameters PyTorch refuses, naming them",
          "[unit][optim]") {
  // Only Adam checked its values: LAMB with a beta of 1 divided by a zero bias correction and
  // wrote NaN into every parameter, a min_coeff above max_coeff was std::clamp's undefined
  // behaviour, and a negative lr on Lion or RMSprop trained uphill without a word.
  const auto refuses = [](const std::string& type, const char* key, double value,
                          const char* named) {
    zero::NamedParams spec;
    spec.type = type;
    spec.params["lr"] = {0.01};
    spec.params[key] = {value};
    INFO(type << " " << key << " = " << value);
    CHECK_THROWS_AS(AnyOptimizer::from_config(spec, 4, {}), zero::ConfigError);
    CHECK_THROWS_WITH(AnyOptimizer::from_config(spec, 4, {}),
                      Catch::Contains(type) && Catch::Contains(named));
  };
  refuses("LAMB", "lr", -1e-3, "lr must be >= 0");
  refuses("LAMB", "eps", -1e-8, "eps must be >= 0");
  refuses("LAMB", "weight_decay", -0.1, "weight_decay must be >= 0");
  refuses("LAMB", "max_coeff", 0.005, "min_coeff <= max_coeff");  // min_coeff 0.01
  refuses("LAMB", "min_coeff", -1.0, "min_coeff <= max_coeff");
  refuses("Lion", "lr", -0.01, "lr must be >= 0");
  refuses("Lion", "weight_decay", -0.1, "weight_decay must be >= 0");
  refuses("RMSprop", "lr", -0.01, "lr must be >= 0");
  refuses("RMSprop", "eps", -1e-8, "eps must be >= 0");
  refuses("RMSprop", "weight_decay", -0.1, "weight_decay must be >= 0");
  refuses("RMSprop", "alpha", 1.0, "alpha must be in [0, 1)");
  refuses("Adagrad", "lr", -0.01, "lr must be >= 0");
  refuses("Adagrad", "eps", -1e-10, "eps must be >= 0");
  refuses("Adagrad", "weight_decay", -0.1, "weight_decay must be >= 0");
  refuses("SGD", "lr", -0.01, "lr must be >= 0");
  refuses("SGD", "weight_decay", -0.1, "weight_decay must be >= 0");
  // LAMB's betas.
  for (const std::vector<double>& betas :
       {std::vector<double>{0.9, 1.0}, {1.0, 0.999}, {0.9, 1.5}, {-0.1, 0.999}}) {
    zero::NamedParams spec;
    spec.type = "LAMB";
    spec.params["betas"] = betas;
    INFO("betas " << betas[0] << ", " << betas[1]);
    CHECK_THROWS_WITH(AnyOptimizer::from_config(spec, 4, {}),
                      Catch::Contains("LAMB") && Catch::Contains("must be in [0, 1)"));
  }
  // A value a schedule sets after construction is refused at the next step, before any update.
  Lamb lamb(4);
  lamb.groups()[0].hyper.beta2 = 1.0;
  std::vector<float> p(4, 1.0f), g(4, 0.5f);
  CHECK_THROWS_WITH(lamb.step(FusedIo::over<float>(p, g)), Catch::Contains("beta2"));
  CHECK(p == std::vector<float>(4, 1.0f));
  // Negative control: the defaults and valid edges build and step to finite values.
  for (const char* type : {"LAMB", "Lion", "RMSprop", "Adagrad", "SGD"}) {
    zero::NamedParams spec;
    spec.type = type;
    spec.params["lr"] = {0.0};
    spec.params["weight_decay"] = {0.0};
    AnyOptimizer opt = AnyOptimizer::from_config(spec, 4, {});
    std::vector<float> q(4, 1.0f), h(4, 0.5f);
    CHECK_NOTHROW(opt.step(FusedIo::over<float>(q, h)));
    for (float v : q) CHECK(std::isfinite(v));
  }
}
