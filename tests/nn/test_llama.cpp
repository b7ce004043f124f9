// Llama's building blocks (rotary embedding, grouped-query attention's RepeatKv, SwiGLU) and
// nn::LayerLlama: the rotary kernel against the rotation it stands for (positions offset
// included) and its backward as that rotation's transpose; RepeatKv's layout and sums; grouped-
// query attention equal to multi-head attention whose key and value projections repeat each
// group's rows; every layer and every unit of a tiny LayerLlama against finite differences (f64);
// f32 and bf16 close to f64; the parameter names and count; sizes that do not fit refused.
#include <cmath>
#include <complex>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/arena.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/nn/layer_llama.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/repeat_kv.hpp>
#include <zero/nn/layers/rotary_embedding.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/layers/swiglu.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/rotary.hpp>
#include <zero/testing/gradient_check.hpp>

using namespace zero;

namespace {

std::vector<double> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = u(gen);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Grouped qkv shapes of the kernel tests: 2 groups of 3 query heads of 6 channels.
constexpr std::int64_t kv = 2, grp = 3, hs = 6, B = 2, Tn = 5;
constexpr std::int64_t width = kv * (grp + 2) * hs, N = B * Tn;

struct Rotary {
  std::vector<double> cos, sin;
  explicit Rotary(std::int64_t first, double theta = 10000.0)
      : cos(static_cast<std::size_t>(Tn * hs / 2)), sin(cos.size()) {
    ops::cpu::rotary_table(cos.data(), sin.data(), first, Tn, hs, theta);
  }
};

}  // namespace

TEST_CASE("rotary_forward turns each query and key pair by its position's angle (f64)",
          "[unit][nn][llama]") {
  const double theta = 500.0;
  for (std::int64_t first : {0, 3}) {
    INFO("first position " << first);
    const Rotary r(first, theta);
    const auto x = random_values(N * width, 5);
    std::vector<double> y(x.size());
    ops::cpu::rotary_forward(y.data(), x.data(), r.cos.data(), r.sin.data(), N, Tn, kv, grp, hs);
    double worst = 0;
    for (std::int64_t row = 0; row < N; ++row) {
      const double p = static_cast<double>(first + row % Tn);
      for (std::int64_t h = 0; h < kv * (grp + 2); ++h) {
        const std::int64_t o = row * width + h * hs;
        const bool value = h % (grp + 2) == grp + 1;
        for (std::int64_t i = 0; i < hs / 2; ++i) {
          const auto k = static_cast<std::size_t>(o + i), k2 = k + hs / 2;
          if (value) {  // values pass through untouched
            CHECK(y[k] == x[k]);
            CHECK(y[k2] == x[k2]);
            continue;
          }
          // The pair as a complex number x[i] + j x[i + hs/2], turned by e^(j p theta^(-2i/hs)).
          const double angle = p * std::pow(theta, -2.0 * static_cast<double>(i) / hs);
          const std::complex<double> want =
              std::complex<double>(x[k], x[k2]) * std::polar(1.0, angle);
          worst = std::max({worst, std::fabs(y[k] - want.real()), std::fabs(y[k2] - want.imag())});
        }
      }
    }
    CHECK(worst < 1e-12);
    // The backward is the transpose: <R x, dy> = <x, R^T dy>, and it adds into dinp.
    const auto dy = random_values(x.size(), 6);
    std::vector<double> dx(x.size(), 0.0), twice(x.size(), 1.0);
    ops::cpu::rotary_backward(dx.data(), dy.data(), r.cos.data(), r.sin.data(), N, Tn, kv, grp, hs);
    CHECK(std::fabs(dot(y, dy) - dot(x, dx)) < 1e-10);
    ops::cpu::rotary_backward(twice.data(), dy.data(), r.cos.data(), r.sin.data(), N, Tn, kv, grp,
                              hs);
    double added = 0;
    for (std::size_t i = 0; i < dx.size(); ++i)
      added = std::max(added, std::fabs(twice[i] - 1.0 - dx[i]));
    CHECK(added < 1e-12);
  }
  // Position 0 turns nothing; Llama's pair (0, hs/2) at position 1 turns by 1 radian.
  const Rotary r0(0);
  CHECK(r0.cos[0] == 1.0);
  CHECK(r0.sin[hs / 2 - 1] == 0.0);
  CHECK(r0.cos[hs / 2] == std::cos(1.0));
  CHECK(r0.sin[hs / 2] == std::sin(1.0));
}

TEST_CASE("repeat_kv lays grouped qkv out as packed q | k | v, and sums each key's gradient",
          "[unit][nn][llama]") {
  std::vector<double> x(static_cast<std::size_t>(N * width));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>(i);
  const std::int64_t heads = kv * grp, out_width = 3 * heads * hs;
  std::vector<double> y(static_cast<std::size_t>(N * out_width));
  ops::cpu::repeat_kv_forward(y.data(), x.data(), N, kv, grp, hs);
  const auto in = [&](std::int64_t row, std::int64_t group, std::int64_t head, std::int64_t c) {
    return x[static_cast<std::size_t>(row * width + (group * (grp + 2) + head) * hs + c)];
  };
  const auto out = [&](std::int64_t row, std::int64_t part, std::int64_t head, std::int64_t c) {
    return y[static_cast<std::size_t>(row * out_width + (part * heads + head) * hs + c)];
  };
  for (std::int64_t row : {std::int64_t{0}, N - 1}) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t c : {std::int64_t{0}, hs - 1}) {
        CHECK(out(row, 0, h, c) == in(row, h / grp, h % grp, c));  // query i of group h / grp
        CHECK(out(row, 1, h, c) == in(row, h / grp, grp, c));      // the group's key
        CHECK(out(row, 2, h, c) == in(row, h / grp, grp + 1, c));  // and value
      }
    }
  }
  // Backward: queries' gradient copied, each key's and value's summed over its group, added.
  const auto dy = random_values(y.size(), 9);
  std::vector<double> dx(x.size(), 0.5);
  ops::cpu::repeat_kv_backward(dx.data(), dy.data(), N, kv, grp, hs);
  CHECK(std::fabs(dot(y, dy) - dot(x, dx) + 0.5 * [&] {
          double s = 0;
          for (double v : x) s += v;
          return s;
        }()) < 1e-12 * dot(x, x));
  const std::int64_t row = 3, c = 2, g = 1;
  double key_sum = 0.5;
  for (std::int64_t i = 0; i < grp; ++i) {
    key_sum += dy[static_cast<std::size_t>(row * out_width + (heads + g * grp + i) * hs + c)];
  }
  CHECK(dx[static_cast<std::size_t>(row * width + (g * (grp + 2) + grp) * hs + c)] == key_sum);
  // overwrite: the same values as adding into zeros.
  std::vector<double> zeros(x.size(), 0.0), written(x.size(), 7.0);
  ops::cpu::repeat_kv_backward(zeros.data(), dy.data(), N, kv, grp, hs);
  ops::cpu::repeat_kv_backward(written.data(), dy.data(), N, kv, grp, hs, true);
  CHECK(zeros == written);
}

namespace {

// Loss, and every parameter gradient, of x -> Linear(qkv) -> RepeatKv -> attention -> Linear ->
// loss over rows of Tn positions; weights from values (whole tensors by name).
struct AttentionRun {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

AttentionRun run_attention(std::int64_t heads, std::int64_t kv_heads,
                           const std::vector<double>& qkv_weight,
                           const std::vector<double>& out_weight, const std::vector<float>& x,
                           const std::vector<std::int32_t>& labels, std::int64_t features) {
  nn::SequentialModel<double> m;
  auto& u = m.add_unit();
  u.add<nn::FromInput<double>>("x");
  u.add<nn::Linear<double>>("qkv", features,
                            ops::cpu::grouped_qkv_width(kv_heads, heads / kv_heads, hs), false);
  u.add<nn::RepeatKv<double>>(heads, kv_heads, hs);
  u.add<nn::CausalSelfAttention<double>>(heads);
  u.add<nn::Linear<double>>("out", heads * hs, 3, false);
  u.add<nn::SoftmaxCrossEntropy<double>>(3, "labels");
  nn::LocalParameters<nn::SequentialModel<double>> p(m, 1);
  auto values = p.unit_values(0);
  std::copy(qkv_weight.begin(), qkv_weight.end(), values.begin());
  std::copy(out_weight.begin(), out_weight.end(), values.begin() + qkv_weight.size());
  Arena<> arena(8 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.batch = B;
  ctx.seq_len = Tn;
  ctx.inputs.set("x", Tensor<const float>(x.data(), Shape{N, features}))
      .set("labels", Tensor<const std::int32_t>(labels.data(), Shape{N}));
  AttentionRun r;
  r.loss = m.forward(ctx);
  m.backward(ctx);
  const auto g = p.unit_grads(0);
  r.grads.emplace_back(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(qkv_weight.size()));
  r.grads.emplace_back(g.begin() + static_cast<std::ptrdiff_t>(qkv_weight.size()), g.end());
  return r;
}

}  // namespace

TEST_CASE(
    "grouped-query attention equals multi-head attention whose key and value projections repeat "
    "each group's rows",
    "[unit][nn][llama]") {
  const std::int64_t features = 4, heads = kv * grp;
  std::vector<float> x;
  for (double v : random_values(N * features, 3)) x.push_back(static_cast<float>(v));
  std::vector<std::int32_t> labels;
  for (std::int64_t i = 0; i < N; ++i) labels.push_back(static_cast<std::int32_t>(i % 3));
  // Grouped: per group, grp query heads' rows, the key's, the value's (hs rows each).
  const auto grouped = random_values(kv * (grp + 2) * hs * features, 4);
  const auto out = random_values(3 * heads * hs, 5);
  // The same projection for heads key/value heads (group 1): each head's query, then its
  // group's key and value repeated.
  const auto rows_of = [&](std::int64_t group, std::int64_t head) {
    const auto at = grouped.begin() + (group * (grp + 2) + head) * hs * features;
    return std::vector<double>(at, at + hs * features);
  };
  std::vector<double> repeated;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t part : {h % grp, grp, grp + 1}) {
      const auto r = rows_of(h / grp, part);
      repeated.insert(repeated.end(), r.begin(), r.end());
    }
  }
  const AttentionRun gqa = run_attention(heads, kv, grouped, out, x, labels, features);
  const AttentionRun mha = run_attention(heads, heads, repeated, out, x, labels, features);
  CHECK(std::fabs(gqa.loss - mha.loss) < 1e-12);
  double worst = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    worst = std::max(worst, std::fabs(gqa.grads[1][i] - mha.grads[1][i]));
  }
  // A shared key's or value's gradient is the sum of its copies'.
  const std::int64_t block = hs * features;
  for (std::int64_t g = 0; g < kv; ++g) {
    for (std::int64_t part : {grp, grp + 1}) {
      for (std::int64_t k = 0; k < block; ++k) {
        double sum = 0;
        for (std::int64_t i = 0; i < grp; ++i) {
          const std::int64_t h = g * grp + i, slot = part == grp ? 1 : 2;
          sum += mha.grads[0][static_cast<std::size_t>((h * 3 + slot) * block + k)];
        }
        worst = std::max(
            worst,
            std::fabs(gqa.grads[0][static_cast<std::size_t>((g * (grp + 2) + part) * block + k)] -
                      sum));
      }
    }
    for (std::int64_t i = 0; i < grp; ++i) {
      const std::int64_t h = g * grp + i;
      for (std::int64_t k = 0; k < block; ++k) {
        worst = std::max(
            worst,
            std::fabs(gqa.grads[0][static_cast<std::size_t>((g * (grp + 2) + i) * block + k)] -
                      mha.grads[0][static_cast<std::size_t>(h * 3 * block + k)]));
      }
    }
  }
  CHECK(worst < 1e-12);
}

TEST_CASE("the rotary embedding, RepeatKv and SwiGLU backwards equal finite differences (f64)",
          "[unit][nn][llama]") {
  const std::int64_t features = 4, heads = kv * grp;
  std::vector<float> x;
  for (double v : random_values(N * features, 13)) x.push_back(static_cast<float>(v));
  std::vector<std::int32_t> labels;
  for (std::int64_t i = 0; i < N; ++i) labels.push_back(static_cast<std::int32_t>((i * 2) % 3));
  nn::Inputs inputs;
  inputs.set("x", Tensor<const float>(x.data(), Shape{N, features}))
      .set("labels", Tensor<const std::int32_t>(labels.data(), Shape{N}));
  const auto micro = engine::MicroBatch::of(inputs, B, Tn);
  for (std::int64_t shard : {0, 1}) {
    nn::SequentialModel<double> m;
    auto& in = m.add_unit();
    in.add<nn::FromInput<double>>("x");
    in.add<nn::Linear<double>>("qkv", features, width, false, 0.8);
    auto& mid = m.add_unit();
    mid.add<nn::RotaryEmbedding<double>>(heads, kv, hs, 100.0).set_sequence_shard(shard, 2);
    mid.add<nn::RepeatKv<double>>(heads, kv, hs);
    mid.add<nn::CausalSelfAttention<double>>(heads);
    mid.add<nn::Linear<double>>("gate_up", heads * hs, 8, false, 0.5);
    mid.add<nn::SwiGLU<double>>();
    mid.add<nn::Linear<double>>("head", 4, 3);
    mid.add<nn::SoftmaxCrossEntropy<double>>(3, "labels");
    for (int unit : {0, 1}) {
      const auto r = testing::check_unit_gradients(m, unit, micro);
      INFO("sequence shard " << shard << ": " << r.summary());
      CHECK(r.passed());
      CHECK(r.checked > 0);
    }
  }
}

namespace {

std::vector<std::int32_t> token_row(std::int64_t n, std::int64_t vocab, int a, int b) {
  std::vector<std::int32_t> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(static_cast<std::int32_t>((i * a + b) % vocab));
  return v;
}

// Loss and every gradient of one forward and backward of LayerLlama<T> (widened to double).
template <class T>
std::vector<double> llama_run(const nn::LlamaConfig& cfg) {
  nn::LayerLlama<T> model(cfg);
  nn::LocalParameters<nn::LayerLlama<T>> params(model, 5);
  const auto tokens = token_row(B * Tn, cfg.vocab_size, 7, 3);
  const auto targets = token_row(B * Tn, cfg.vocab_size, 5, 1);
  Arena<> arena(16 << 20);
  nn::StepContext<T> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = B;
  ctx.seq_len = Tn;
  std::vector<double> out{convert<double>(model.forward(ctx))};
  model.backward(ctx);
  for (int u = 0; u < model.num_units(); ++u) {
    for (const auto& g : params.unit_grads(u)) out.push_back(convert<double>(g));
  }
  return out;
}

}  // namespace

TEST_CASE("LayerLlama: every unit equals finite differences, and f32 and bf16 follow f64",
          "[unit][nn][llama]") {
  const nn::LlamaConfig cfg = nn::LlamaConfig::preset("tiny");
  nn::LayerLlama<double> model(cfg);
  REQUIRE(model.num_units() == cfg.num_layers + 2);
  const auto tokens = token_row(B * Tn, cfg.vocab_size, 7, 3);
  const auto targets = token_row(B * Tn, cfg.vocab_size, 5, 1);
  nn::Inputs in;
  in.set("tokens", Tensor<const std::int32_t>(tokens.data(), Shape{B, Tn}))
      .set("targets", Tensor<const std::int32_t>(targets.data(), Shape{B, Tn}));
  testing::GradientCheckOptions o;
  o.max_elements = 24;
  for (int unit = 0; unit < model.num_units(); ++unit) {
    const auto r = testing::check_unit_gradients(model, unit, engine::MicroBatch::of(in, B, Tn), o);
    INFO("unit " << unit << ": " << r.summary());
    CHECK(r.passed());
    CHECK(r.checked > 0);
  }
  const auto want = llama_run<double>(cfg), f32 = llama_run<float>(cfg), b16 = llama_run<bf16>(cfg);
  REQUIRE(f32.size() == want.size());
  REQUIRE(b16.size() == want.size());
  CHECK(want[0] > 3.0);  // about log(V) at initialisation
  double e32 = 0, e16 = 0, largest = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    largest = std::max(largest, std::fabs(want[i]));
    e32 = std::max(e32, std::fabs(f32[i] - want[i]));
    e16 = std::max(e16, std::fabs(b16[i] - want[i]));
  }
  CHECK(e32 < 1e-5 * largest);
  CHECK(e16 < 2e-2 * largest);
  CHECK(e16 > 0.0);  // bf16 rounds
}

TEST_CASE("LayerLlama: Hugging Face's names, its parameter count, one grouped qkv projection",
          "[unit][nn][llama]") {
  const nn::LlamaConfig cfg = nn::LlamaConfig::preset("tiny");
  nn::LayerLlama<float> model(cfg);
  std::vector<std::string> names;
  std::int64_t count = 0;
  for (int u = 0; u < model.num_units(); ++u) {
    for (const nn::ParamSpec& p : model.unit_params(u)) {
      names.push_back(p.name);
      count += p.numel();
    }
  }
  CHECK(count == cfg.num_parameters());
  const std::vector<std::string> want{"model.embed_tokens.weight",
                                      "model.layers.0.input_layernorm.weight",
                                      "model.layers.0.self_attn.qkv_proj.weight",
                                      "model.layers.0.self_attn.o_proj.weight",
                                      "model.layers.0.post_attention_layernorm.weight",
                                      "model.layers.0.mlp.gate_up_proj.weight",
                                      "model.layers.0.mlp.down_proj.weight"};
  REQUIRE(names.size() == 2 + 6 * static_cast<std::size_t>(cfg.num_layers) + 1);
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(names[i] == want[i]);
  CHECK(names[names.size() - 2] == "model.norm.weight");
  CHECK(names.back() == "lm_head.weight");
  const auto qkv = model.unit_params(1)[1];
  CHECK(qkv.shape == Shape{(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size(), cfg.channels});
  // The published sizes.
  CHECK(nn::LlamaConfig::preset("llama2-7b").num_parameters() == 6738415616);
  CHECK(nn::LlamaConfig::preset("llama3-8b").num_parameters() == 8030261248);
}

TEST_CASE("Llama's layers refuse sizes that do not fit, naming them", "[unit][nn][llama]") {
  CHECK_THROWS_WITH(nn::RotaryEmbedding<double>(6, 4, 8),
                    Catch::Contains("heads (6) must be a multiple of kv_heads (4)"));
  CHECK_THROWS_WITH(nn::RotaryEmbedding<double>(4, 2, 7),
                    Catch::Contains("head_size 7 must be even"));
  CHECK_THROWS_WITH(nn::RepeatKv<double>(4, 0, 8), Catch::Contains("kv_heads = 0"));
  nn::LlamaConfig c = nn::LlamaConfig::preset("tiny");
  c.num_kv_heads = 3;
  CHECK_THROWS_WITH(nn::LayerLlama<double>(c),
                    Catch::Contains("num_heads (4) must be a multiple of num_kv_heads (3)"));
  c = nn::LlamaConfig::preset("tiny");
  c.channels = 36;  // head size 9
  CHECK_THROWS_WITH(nn::LayerLlama<double>(c), Catch::Contains("must be even"));
  CHECK_THROWS_WITH(nn::LlamaConfig::preset("llama9"), Catch::Contains("unknown preset 'llama9'"));
  // A SwiGLU input of an odd width, and qkv rows of the wrong width.
  nn::SwiGLU<double> swiglu;
  nn::RotaryEmbedding<double> rotary(4, 2, 8);
  std::vector<double> row(7, 0.0);
  Arena<> arena(1 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.batch = 1;
  ctx.seq_len = 1;
  ctx.x = Tensor<double>(row.data(), Shape{1, 7});
  CHECK_THROWS_WITH(swiglu.forward(ctx), Catch::Contains("an even number of features"));
  ctx.x = Tensor<double>(row.data(), Shape{1, 7});
  CHECK_THROWS_WITH(rotary.forward(ctx), Catch::Contains("expected 64 features"));
}
