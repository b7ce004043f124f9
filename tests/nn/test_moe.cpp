// The mixture-of-experts router (capacity, dropping, combine weights, auxiliary losses) against
// hand-computed cases, and the MixtureOfExperts layer's backward against finite differences.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/config/config.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/moe/moe_blocks.hpp>
#include <zero/nn/moe/moe_layer.hpp>
#include <zero/nn/moe/router.hpp>
#include <zero/testing/gradient_check.hpp>

using namespace zero;

namespace {

// Logits that make token t prefer the experts in `order[t]` (first choice, then second).
std::vector<double> logits_for(const std::vector<std::vector<int>>& order, int E) {
  std::vector<double> l;
  for (const auto& o : order) {
    std::vector<double> row(static_cast<std::size_t>(E), 0.0);
    row[static_cast<std::size_t>(o[0])] = 2.0;
    if (o.size() > 1) row[static_cast<std::size_t>(o[1])] = 1.0;
    l.insert(l.end(), row.begin(), row.end());
  }
  return l;
}

// Top-1 over 2 experts, at least 1 slot each.
nn::RouterConfig two_experts() {
  nn::RouterConfig cfg;
  cfg.num_experts = 2;
  cfg.min_capacity = 1;
  return cfg;
}
// 6 tokens over those 2 experts (capacity 3 at factor 1): expert 0 is the first choice of tokens
// 0, 1, 3 and 4.
std::vector<double> six_tokens() {
  return logits_for({{0}, {0}, {1}, {0}, {0}, {1}}, 2);
}

}  // namespace

TEST_CASE("MoE router: top-1 capacity, dropping in token order and the auxiliary losses",
          "[unit][moe]") {
  // 6 tokens over 2 experts, capacity ceil(6 / 2 * 1.0) = 3: the 4th token choosing expert 0 is
  // dropped.
  nn::RouterConfig cfg = two_experts();
  const auto logits = six_tokens();
  const auto r = nn::route(logits.data(), 6, cfg);
  CHECK(r.capacity == 3);
  CHECK(r.expert == std::vector<int>{0, 0, 1, 0, 0, 1});
  CHECK(r.slot == std::vector<std::int64_t>{0, 1, 0, 2, -1, 1});
  CHECK(r.kept == std::vector<std::int64_t>{3, 2});
  CHECK(r.dropped == 1);
  // p(first choice) = e^2 / (e^2 + 1); a dropped choice weighs 0.
  const double p = std::exp(2.0) / (std::exp(2.0) + 1.0);
  for (int t : {0, 1, 2, 3, 5}) CHECK(r.weight[static_cast<std::size_t>(t)] == Approx(p));
  CHECK(r.weight[4] == 0.0);
  // me = (4p + 2(1-p)) / 6 for expert 0, ce = 4/6; l_aux = E * sum me * ce.
  const double me0 = (4 * p + 2 * (1 - p)) / 6, me1 = 1 - me0;
  CHECK(r.aux_loss == Approx(2 * (me0 * 4.0 / 6 + me1 * 2.0 / 6)));
  const double lse = std::log(std::exp(2.0) + 1.0);
  CHECK(r.z_loss == Approx(lse * lse));
  // min_capacity raises the capacity; without drop_tokens nothing is dropped.
  cfg.min_capacity = 4;
  CHECK(nn::route(logits.data(), 6, cfg).dropped == 0);
  cfg.min_capacity = 1;
  // A huge factor means "never drop": capped at tokens * k, not converted past int64's range
  // (which gave INT64_MIN, i.e. min_capacity, and dropped most tokens).
  cfg.capacity_factor = 1e300;
  CHECK(cfg.capacity(6) == 6);
  CHECK(nn::route(logits.data(), 6, cfg).dropped == 0);
  cfg.capacity_factor = 1.0;
  cfg.drop_tokens = false;
  CHECK(nn::route(logits.data(), 6, cfg).dropped == 0);
  // Uniform probabilities give l_aux = 1 whatever the choices (here all the first expert's).
  const std::vector<double> uniform(8, 0.0);
  cfg.drop_tokens = true;
  CHECK(nn::route(uniform.data(), 4, cfg).aux_loss == Approx(1.0));
  // No tokens (an ep rank's empty micro-batch): both losses 0, not 0/0.
  const auto none = nn::route(uniform.data(), 0, cfg);
  CHECK(none.aux_loss == 0.0);
  CHECK(none.z_loss == 0.0);
}

TEST_CASE("MoE router: top-2 takes every first choice's slot before any second choice",
          "[unit][moe]") {
  // 4 tokens over 3 experts, k 2: capacity ceil(2 * 4 / 3 * 1.0) = 3.
  nn::RouterConfig cfg;
  cfg.num_experts = 3;
  cfg.k = 2;
  cfg.min_capacity = 1;
  const auto logits = logits_for({{0, 1}, {0, 2}, {1, 0}, {0, 1}}, 3);
  const auto r = nn::route(logits.data(), 4, cfg);
  CHECK(r.capacity == 3);
  // First choices: expert 0 gets tokens 0, 1, 3 (slots 0-2), expert 1 token 2. Second choices
  // come after: token 0 -> expert 1 slot 1, token 1 -> expert 2 slot 0, token 2 -> expert 0
  // (slot 3: dropped), token 3 -> expert 1 slot 2.
  CHECK(r.expert == std::vector<int>{0, 1, 0, 2, 1, 0, 0, 1});
  CHECK(r.slot == std::vector<std::int64_t>{0, 1, 1, 0, 0, -1, 2, 2});
  CHECK(r.dropped == 1);
  // Kept pairs are normalised over their sum; token 2 keeps only its first choice, weight 1.
  const double p1 = std::exp(2.0) / (std::exp(2.0) + std::exp(1.0) + 1.0);
  const double p2 = std::exp(1.0) / (std::exp(2.0) + std::exp(1.0) + 1.0);
  CHECK(r.weight[0] == Approx(p1 / (p1 + p2)));
  CHECK(r.weight[1] == Approx(p2 / (p1 + p2)));
  CHECK(r.weight[4] == Approx(1.0));
  CHECK(r.weight[5] == 0.0);
  SECTION("bad settings name the key") {
    nn::RouterConfig bad;
    bad.num_experts = 2;
    bad.k = 3;
    CHECK_THROWS_WITH(bad.validate(), Catch::Contains("moe.k = 3"));
    bad.k = 1;
    bad.capacity_factor = 0;
    CHECK_THROWS_WITH(bad.validate(), Catch::Contains("moe.capacity_factor"));
  }
}

TEST_CASE(
    "MoE router: random token selection keeps an over-full expert's tokens of the highest "
    "priority, in token order",
    "[unit][moe]") {
  // As the top-1 case above: capacity 3, expert 0 chosen by tokens 0, 1, 3 and 4. Token 1 has
  // the lowest priority of the four, so it is dropped (token order drops token 4); the kept ones
  // take expert 0's slots in token order. Expert 1 is within capacity: priorities change nothing.
  nn::RouterConfig cfg = two_experts();
  cfg.random_token_selection = true;
  const auto logits = six_tokens();
  const std::vector<double> priority{0.5, 0.1, 0.0, 0.9, 0.3, 0.2};
  const auto r = nn::route(logits.data(), 6, cfg, nn::RouterDraws{priority});
  CHECK(r.slot == std::vector<std::int64_t>{0, -1, 0, 1, 2, 1});
  CHECK(r.kept == std::vector<std::int64_t>{3, 2});
  CHECK(r.dropped == 1);
  CHECK(r.weight[1] == 0.0);
  // The losses count choices before dropping: as token order's.
  nn::RouterConfig plain = cfg;
  plain.random_token_selection = false;
  const auto ordered = nn::route(logits.data(), 6, plain);
  CHECK(r.aux_loss == ordered.aux_loss);
  CHECK(r.z_loss == ordered.z_loss);
  // Priorities that rank the tokens in order drop as token order does; equal ones too (ties go
  // to the lower token).
  const std::vector<double> in_order{6, 5, 4, 3, 2, 1}, tied(6, 0.5);
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{in_order}).slot == ordered.slot);
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{tied}).slot == ordered.slot);
  // Without drops (no capacity limit) the priorities change nothing.
  cfg.drop_tokens = false;
  plain.drop_tokens = false;
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{priority}).slot ==
        nn::route(logits.data(), 6, plain).slot);
  // A priority for each token, and top-1 only (DeepSpeed's top-2 gate has none).
  const std::vector<double> five(5);
  CHECK_THROWS_WITH(nn::route(logits.data(), 6, cfg, nn::RouterDraws{five}),
                    Catch::Contains("a priority for each of the 6 tokens, got 5"));
  cfg.num_experts = 3;
  cfg.k = 2;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("moe.use_rts") && Catch::Contains("moe.k = 2"));
  // The config key reaches the model's router.
  const Config c = Config::from_json_string(R"({"moe": {"num_experts": 4, "use_rts": true}})");
  CHECK(c.moe.use_rts);
  CHECK(nn::MoEBlocks::from_config(c.moe).router.random_token_selection);
  CHECK_FALSE(nn::MoEBlocks::from_config(Config{}.moe).router.random_token_selection);
}

TEST_CASE(
    "MoE router: DeepSpeed's eval capacity factor, RSample's and top-2's sampled choices by "
    "the logits plus Gumbel noise, with the clean probabilities",
    "[unit][moe]") {
  nn::RouterConfig cfg = two_experts();
  cfg.eval_capacity_factor = 2.0;
  const auto logits = six_tokens();
  CHECK(nn::route(logits.data(), 6, cfg).capacity == 3);
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{{}, {}, false}).capacity == 6);
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{{}, {}, false}).dropped == 0);
  // RSample: token 0's noise lifts expert 1 past expert 0 (logits 0 + 3 > 2 + 0), token 1's not
  // (0 + 1 < 2 + 0.5); the weight is the clean probability of the expert picked.
  cfg.noise = nn::GateNoise::rsample;
  std::vector<double> gumbel(12, 0.0);
  gumbel[1] = 3.0;
  gumbel[2] = 0.5;
  gumbel[3] = 1.0;
  const auto r = nn::route(logits.data(), 6, cfg, nn::RouterDraws{{}, gumbel});
  CHECK(r.expert == std::vector<int>{1, 0, 1, 0, 0, 1});
  const double p = std::exp(2.0) / (std::exp(2.0) + 1.0);
  CHECK(r.prob[0] == Approx(1 - p));
  CHECK(r.weight[0] == Approx(1 - p));
  CHECK(r.prob[1] == Approx(p));
  // ce counts the sampled choices: expert 0 chosen by 3 of 6.
  CHECK(r.first_choice_share[0] == Approx(0.5));
  // Outside training RSample draws nothing: the choices by probability.
  CHECK(nn::route(logits.data(), 6, cfg, nn::RouterDraws{{}, {}, false}).expert ==
        std::vector<int>{0, 0, 1, 0, 0, 1});
  const std::vector<double> short_noise(11);
  CHECK_THROWS_WITH(nn::route(logits.data(), 6, cfg, nn::RouterDraws{{}, short_noise}),
                    Catch::Contains("Gumbel noise for each of the 6 x 2 logits, got 11"));
  // Top-2's second choice among the others by the noisy logits (training or not, as DeepSpeed):
  // token 0 prefers 0, then 1 (logit 1 against 0), but noise 2 on expert 2 picks it.
  nn::RouterConfig two;
  two.num_experts = 3;
  two.k = 2;
  two.min_capacity = 1;
  two.second_expert_sampling = true;
  const auto three = logits_for({{0, 1}, {0, 1}}, 3);
  const std::vector<double> noise{5.0, 0.0, 2.0, 0.0, 0.0, 0.5};  // token 0's expert 0 lifted
  for (bool training : {true, false}) {
    const auto r2 = nn::route(three.data(), 2, two, nn::RouterDraws{{}, noise, training});
    CHECK(r2.expert == std::vector<int>{0, 2, 0, 1});  // the first choice is never sampled
    const double z = std::exp(2.0) + std::exp(1.0) + 1.0;
    CHECK(r2.prob[1] == Approx(1.0 / z));
  }
  // Settings that do not apply are refused, naming the key.
  nn::RouterConfig bad = two;
  bad.noise = nn::GateNoise::rsample;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("moe.noisy_gate_policy RSample"));
  bad = cfg;
  bad.second_expert_sampling = true;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("moe.top2_2nd_expert_sampling"));
  // The config keys reach the model's router.
  const Config c = Config::from_json_string(
      R"({"moe": {"num_experts": 4, "k": 2, "eval_capacity_factor": 2, "noisy_gate_policy":
          "Jitter", "top2_2nd_expert_sampling": true}})");
  const nn::RouterConfig from = nn::MoEBlocks::from_config(c.moe).router;
  CHECK(from.eval_capacity_factor == 2.0);
  CHECK(from.noise == nn::GateNoise::jitter);
  CHECK(from.second_expert_sampling);
  CHECK(
      nn::MoEBlocks::from_config(
          Config::from_json_string(R"({"moe": {"num_experts": 4, "noisy_gate_policy": "RSample"}})")
              .moe)
          .router.noise == nn::GateNoise::rsample);
  CHECK(
      nn::MoEBlocks::from_config(
          Config::from_json_string(R"({"moe": {"num_experts": 4, "noisy_gate_policy": null}})").moe)
          .router.noise == nn::GateNoise::none);
}

namespace {

constexpr std::int64_t rows = 12, features = 4, channels = 6, hidden = 8, classes = 3;

struct Data {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
  Data() {
    std::mt19937_64 gen(11);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (std::int64_t i = 0; i < rows * features; ++i) x.push_back(static_cast<float>(u(gen)));
    for (std::int64_t i = 0; i < rows; ++i)
      labels.push_back(static_cast<std::int32_t>(i % classes));
  }
  engine::MicroBatch batch() const {
    nn::Inputs in;
    in.set("x", Tensor<const float>(x.data(), Shape{rows, features}))
        .set("labels", Tensor<const std::int32_t>(labels.data(), Shape{rows}));
    return engine::MicroBatch::of(in, rows);
  }
};

// unit 0: x -> Linear(features, channels); unit 1: a residual MoE branch; unit 2: the head.
// `layer`, when given, gets the MoE layer (it stays where it is when the model moves).
nn::SequentialModel<double> moe_model(const nn::RouterConfig& router,
                                      nn::MixtureOfExperts<double>** layer = nullptr) {
  nn::SequentialModel<double> m;
  auto& in = m.add_unit();
  in.add<nn::FromInput<double>>("x");
  in.add<nn::Linear<double>>("pre", features, channels);
  auto& branch = m.add_unit().add<nn::Residual<double>>("moe_block");
  auto& moe = branch.add<nn::MixtureOfExperts<double>>("moe", channels, hidden, router, 0.3, 0.5);
  if (layer != nullptr) *layer = &moe;
  auto& head = m.add_unit();
  head.add<nn::Linear<double>>("head", channels, classes);
  head.add<nn::SoftmaxCrossEntropy<double>>(classes, "labels");
  return m;
}

}  // namespace

TEST_CASE(
    "MixtureOfExperts: backward equals finite differences of the loss with its auxiliary losses "
    "(top-1 and top-2, tokens dropped, z-loss on, and with random token selection, jitter, RSample "
    "and top-2's sampled second choice)",
    "[unit][moe]") {
  struct Variant {
    int k;
    bool rts = false;
    nn::GateNoise noise = nn::GateNoise::none;
    bool second_sampled = false;
  };
  for (const Variant v :
       {Variant{1}, Variant{2}, Variant{1, true}, Variant{1, false, nn::GateNoise::jitter},
        Variant{1, false, nn::GateNoise::rsample},
        Variant{2, false, nn::GateNoise::jitter, true}}) {
    const int k = v.k;
    nn::RouterConfig router;
    router.num_experts = 4;
    router.k = k;
    router.random_token_selection = v.rts;
    router.noise = v.noise;
    router.second_expert_sampling = v.second_sampled;
    router.capacity_factor = 0.75;  // some choices are dropped
    router.min_capacity = 1;
    router.aux_loss_coef = 0.1;
    router.z_loss_coef = 0.05;
    nn::MixtureOfExperts<double>* moe = nullptr;
    auto m = moe_model(router, &moe);
    const Data d;
    testing::GradientCheckOptions o;
    o.seed = 5;
    const auto r = testing::check_unit_gradients(m, 1, d.batch(), o);
    INFO("k " << k << (v.rts ? " random token selection" : "") << " noise "
              << static_cast<int>(v.noise) << (v.second_sampled ? " second sampled" : "") << ": "
              << r.summary());
    CHECK(r.passed());
    // The routing did drop, so the check covered it.
    CHECK(moe->last_stats().dropped > 0);
    CHECK(moe->last_stats().choices == rows * k);
  }
}

TEST_CASE("MixtureOfExperts: one expert is the GPT MLP it holds, bit for bit", "[unit][moe]") {
  // One expert, no capacity limit: every token's weight is softmax over one logit = 1.
  nn::RouterConfig router;
  router.drop_tokens = false;
  router.aux_loss_coef = 0.0;
  nn::SequentialModel<double> moe;
  moe.add_unit().add<nn::FromInput<double>>("x");
  moe.unit(0).add<nn::Linear<double>>("pre", features, channels);
  moe.add_unit().add<nn::MixtureOfExperts<double>>("moe", channels, hidden, router);
  nn::SequentialModel<double> mlp;  // the same parameter names: the same initial values
  mlp.add_unit().add<nn::FromInput<double>>("x");
  mlp.unit(0).add<nn::Linear<double>>("pre", features, channels);
  auto& unit = mlp.add_unit();
  unit.add<nn::Linear<double>>("moe.experts.c_fc", channels, hidden, true, 0.02);
  unit.add<nn::GELU<double>>();
  unit.add<nn::Linear<double>>("moe.experts.c_proj", hidden, channels, true, 0.02);
  auto run = [](nn::SequentialModel<double>& m) {
    nn::LocalParameters<nn::SequentialModel<double>> p(m, 9);
    Arena<> arena(1 << 20);
    const Data d;
    nn::StepContext<double> ctx = d.batch().context<double>(arena, true, 0);
    for (int u = 0; u < m.num_units(); ++u) m.forward_unit(u, ctx);
    return std::vector<double>(ctx.x.begin(), ctx.x.end());
  };
  CHECK(run(moe) == run(mlp));
}

TEST_CASE(
    "MixtureOfExperts under activation checkpointing: the recomputed forward adds its auxiliary "
    "losses once and gives the same gradients",
    "[unit][moe]") {
  nn::RouterConfig router;
  router.num_experts = 3;
  router.k = 2;
  router.aux_loss_coef = 0.1;
  router.z_loss_coef = 0.05;
  auto run = [&](bool checkpoint) {
    auto m = moe_model(router);
    m.unit(1).set_checkpoint(checkpoint);
    nn::LocalParameters<nn::SequentialModel<double>> p(m, 4);
    Arena<> arena(1 << 20);
    const Data d;
    nn::StepContext<double> ctx = d.batch().context<double>(arena, true, 0);
    for (int u = 0; u < 3; ++u) m.forward_unit(u, ctx);
    const double after_forward = ctx.aux_loss;
    for (int u = 2; u >= 0; --u) m.backward_unit(u, ctx);
    const auto g = p.unit_grads(1);
    return std::tuple(after_forward, static_cast<double>(ctx.aux_loss),
                      std::vector<double>(g.begin(), g.end()));
  };
  const auto [forward_kept, backward_kept, grads_kept] = run(false);
  const auto [forward_rerun, backward_rerun, grads_rerun] = run(true);
  CHECK(forward_kept > 0);
  CHECK(forward_rerun == forward_kept);
  CHECK(backward_kept == forward_kept);
  CHECK(backward_rerun == forward_kept);  // was twice that: the rerun added its share again
  CHECK(grads_rerun == grads_kept);
}

TEST_CASE("MixtureOfExperts: parks what its forward kept", "[unit][moe]") {
  nn::RouterConfig router;
  router.num_experts = 3;
  router.k = 2;
  auto m = moe_model(router);
  CHECK(m.parks_unit(1));
  nn::LocalParameters<nn::SequentialModel<double>> p(m, 3);
  // Two micro-batches: forward A, park, forward B, backward B, resume A, backward A equals
  // forward A, backward A alone.
  Data a;
  Data b;
  for (float& v : b.x) v = -v;
  auto grads_of_a = [&](bool interleave) {
    p.zero_grads();
    Arena<> arena_a(1 << 20), arena_b(1 << 20);
    nn::StepContext<double> ca = a.batch().context<double>(arena_a, true, 0);
    for (int u = 0; u < 3; ++u) m.forward_unit(u, ca);
    if (interleave) {
      std::vector<std::any> parked;
      for (int u = 0; u < 3; ++u) parked.push_back(m.park_unit(u));
      nn::StepContext<double> cb = b.batch().context<double>(arena_b, true, 1);
      for (int u = 0; u < 3; ++u) m.forward_unit(u, cb);
      for (int u = 2; u >= 0; --u) m.backward_unit(u, cb);
      p.zero_grads();
      for (int u = 0; u < 3; ++u) m.resume_unit(u, std::move(parked[static_cast<std::size_t>(u)]));
    }
    for (int u = 2; u >= 0; --u) m.backward_unit(u, ca);
    const auto g = p.unit_grads(1);
    return std::vector<double>(g.begin(), g.end());
  };
  CHECK(grads_of_a(true) == grads_of_a(false));
}

TEST_CASE(
    "MixtureOfExperts with random token selection: each micro-step drops other tokens, a "
    "recomputed forward the same ones",
    "[unit][moe]") {
  nn::RouterConfig router;
  router.num_experts = 3;
  router.capacity_factor = 0.5;  // 2 slots an expert for 12 tokens: most choices dropped
  router.min_capacity = 1;
  const Data d;
  // The loss and the dropped choices of a forward at `step` (the micro-step's stream).
  const auto forward = [&](const nn::RouterConfig& r, std::uint64_t step, bool checkpoint) {
    nn::MixtureOfExperts<double>* moe = nullptr;
    auto m = moe_model(r, &moe);
    m.unit(1).set_checkpoint(checkpoint);
    nn::LocalParameters<nn::SequentialModel<double>> p(m, 4);
    Arena<> arena(1 << 20);
    nn::StepContext<double> ctx = d.batch().context<double>(arena, true, step);
    for (int u = 0; u < 3; ++u) m.forward_unit(u, ctx);
    const double loss = ctx.loss;
    const std::int64_t dropped = moe->last_stats().dropped;
    for (int u = 2; u >= 0; --u) m.backward_unit(u, ctx);
    const auto g = p.unit_grads(1);
    return std::tuple(loss, dropped, std::vector<double>(g.begin(), g.end()));
  };
  const auto [plain0, plain_dropped, plain_grads] = forward(router, 0, false);
  CHECK(plain_dropped > 0);
  CHECK(std::get<0>(forward(router, 1, false)) == plain0);  // token order: the same every step
  router.random_token_selection = true;
  const auto [rts0, rts_dropped, rts_grads] = forward(router, 0, false);
  CHECK(rts_dropped == plain_dropped);  // as many dropped, other ones
  CHECK(rts0 != plain0);
  const auto [rts1, rts1_dropped, rts1_grads] = forward(router, 1, false);
  CHECK(rts1_dropped == plain_dropped);
  CHECK(rts1 != rts0);  // each micro-step draws its own
  // Activation checkpointing recomputes the forward in backward: the same tokens dropped.
  const auto [rerun0, rerun_dropped, rerun_grads] = forward(router, 0, true);
  CHECK(rerun0 == rts0);
  CHECK(rerun_grads == rts_grads);
  // Jitter and RSample too: other draws each micro-step, the same ones recomputed.
  for (const auto noise : {nn::GateNoise::jitter, nn::GateNoise::rsample}) {
    router.noise = noise;
    const auto [noisy0, noisy_dropped, noisy_grads] = forward(router, 0, false);
    CHECK(noisy0 != rts0);
    CHECK(std::get<0>(forward(router, 1, false)) != noisy0);
    const auto [noisy_rerun, noisy_rerun_dropped, noisy_rerun_grads] = forward(router, 0, true);
    CHECK(noisy_rerun == noisy0);
    CHECK(noisy_rerun_grads == noisy_grads);
  }
}
