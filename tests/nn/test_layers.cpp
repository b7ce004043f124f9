// The layer library (include/zero/nn/layers) and the public gradient checker: every layer's
// backward against central finite differences in f64 (parameters and the gradient at the
// unit's input), the checker catching deliberately wrong backwards (negative controls), the
// same model in f32/bf16 close to f64, and input errors that name the tensor.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/buffer.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/hand_written_gpt.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/dropout.hpp>
#include <zero/nn/layers/flatten.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/layer_norm.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/linear_cross_entropy.hpp>
#include <zero/nn/layers/mse_loss.hpp>
#include <zero/nn/layers/position_embedding.hpp>
#include <zero/nn/layers/reshape.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/rms_norm.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/layers/tied_linear.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/transformer_block.hpp>
#include <zero/ops/cpu/activation.hpp>
#include <zero/testing/gradient_check.hpp>

using namespace zero;
using nn::SequentialModel;

namespace {

constexpr std::int64_t rows = 5, features = 4, hidden = 6, classes = 3;

// features [rows, features] f32, labels [rows] i32, target [rows, classes] f64, ids [rows, 2].
struct Data {
  std::vector<float> x;
  std::vector<std::int32_t> labels, ids;
  std::vector<double> target;
  Data() {
    std::mt19937_64 gen(7);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (std::int64_t i = 0; i < rows * features; ++i) x.push_back(static_cast<float>(u(gen)));
    for (std::int64_t i = 0; i < rows * classes; ++i) target.push_back(u(gen));
    for (std::int64_t i = 0; i < rows; ++i)
      labels.push_back(static_cast<std::int32_t>(i % classes));
    for (std::int64_t i = 0; i < rows * 2; ++i)
      ids.push_back(static_cast<std::int32_t>((i * 5) % 7));
  }
  engine::MicroBatch batch() const {
    nn::Inputs in;
    in.set("x", Tensor<const float>(x.data(), Shape{rows, features}))
        .set("labels", Tensor<const std::int32_t>(labels.data(), Shape{rows}))
        .set("target", Tensor<const double>(target.data(), Shape{rows, classes}))
        .set("ids", Tensor<const std::int32_t>(ids.data(), Shape{rows, 2}));
    return engine::MicroBatch::of(in, rows);
  }
};

// A context of batch rows of seq_len positions over arena, with no inputs yet.
nn::StepContext<double> context_of(Arena<>& arena, std::int64_t batch = rows,
                                   std::int64_t seq_len = 1) {
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.batch = batch;
  ctx.seq_len = seq_len;
  return ctx;
}

// unit 0: x -> Linear(features, hidden); unit 1: the layers under test (hidden -> hidden);
// unit 2: Linear(hidden, classes) -> loss (cross-entropy, or MSE when mse).
template <class T>
SequentialModel<T> sandwich(const std::function<void(nn::Sequential<T>&)>& middle,
                            bool mse = false) {
  SequentialModel<T> m;
  auto& in = m.add_unit();
  in.template add<nn::FromInput<T>>("x");
  in.template add<nn::Linear<T>>("pre", features, hidden);
  middle(m.add_unit());
  auto& head = m.add_unit();
  head.template add<nn::Linear<T>>("head", hidden, classes);
  if (mse) {
    head.template add<nn::MSELoss<T>>("target");
  } else {
    head.template add<nn::SoftmaxCrossEntropy<T>>(classes, "labels");
  }
  return m;
}

testing::GradientCheckReport check(SequentialModel<double>& m, int unit) {
  const Data d;
  return testing::check_unit_gradients(m, unit, d.batch());
}

// y = a * x with a parameter a [hidden]; the flags plant the classic backward bugs.
class Scale final : public nn::Layer<double> {
 public:
  bool wrong_param_grad = false, forget_input_grad = false;
  std::string describe() const override { return "Scale"; }
  std::vector<nn::ParamSpec> params() const override {
    return {{"scale.a", {hidden}, nn::Init::normal, 0.5, false}};
  }
  void bind(std::span<const nn::ParamView<double>> v) override { a_ = v[0]; }
  void forward(nn::StepContext<double>& ctx) override {
    in_ = ctx.x;
    Tensor<double> y = ctx.arena->allocate<double>(ctx.x.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i) y.at(i) = a_.value.at(i % hidden) * in_.at(i);
    ctx.x = y;
  }
  void backward(nn::StepContext<double>& ctx) override {
    for (std::int64_t i = 0; i < in_.numel(); ++i) {
      a_.grad.at(i % hidden) += (wrong_param_grad ? 1.1 : 1.0) * in_.at(i) * ctx.dy.at(i);
      if (!forget_input_grad) ctx.dx.at(i) += a_.value.at(i % hidden) * ctx.dy.at(i);
    }
  }

 private:
  nn::ParamView<double> a_;
  Tensor<double> in_;
};

}  // namespace

TEST_CASE("every layer's backward equals finite differences (f64)", "[unit][nn][layers]") {
  using T = double;
  const std::vector<std::pair<std::string, std::function<void(nn::Sequential<T>&)>>> cases{
      {"Linear", [](auto& s) { s.template add<nn::Linear<T>>("mid", hidden, hidden); }},
      {"Linear without bias",
       [](auto& s) { s.template add<nn::Linear<T>>("mid", hidden, hidden, false); }},
      {"ReLU", [](auto& s) { s.template add<nn::ReLU<T>>(); }},
      {"GELU", [](auto& s) { s.template add<nn::GELU<T>>(); }},
      {"SiLU", [](auto& s) { s.template add<nn::SiLU<T>>(); }},
      {"LayerNorm", [](auto& s) { s.template add<nn::LayerNorm<T>>("ln", hidden); }},
      {"Dropout", [](auto& s) { s.template add<nn::Dropout<T>>(0.3, "mid"); }},
      {"Linear-GELU-LayerNorm-Linear", [](auto& s) {
         s.template add<nn::Linear<T>>("fc1", hidden, 2 * hidden);
         s.template add<nn::GELU<T>>();
         s.template add<nn::LayerNorm<T>>("ln", 2 * hidden);
         s.template add<nn::Linear<T>>("fc2", 2 * hidden, hidden);
       }}};
  for (const auto& [name, middle] : cases) {
    for (bool mse : {false, true}) {
      auto m = sandwich<T>(middle, mse);
      for (int unit : {0, 1, 2}) {
        const auto r = check(m, unit);
        INFO(name << (mse ? " (MSE)" : " (cross-entropy)") << ": " << r.summary());
        CHECK(r.passed());
        CHECK(r.checked > 0);
      }
    }
  }
}

TEST_CASE("TokenEmbedding's backward equals finite differences (f64)", "[unit][nn][layers]") {
  SequentialModel<double> m;
  m.add_unit().add<nn::TokenEmbedding<double>>("emb", 7, hidden, "ids", 0.5);
  auto& head = m.add_unit();
  head.add<nn::Linear<double>>("head", hidden, classes);
  head.add<nn::SoftmaxCrossEntropy<double>>(classes, "labels");
  // [rows, 2] ids give [rows, 2, hidden]; the head's labels are per row of [rows * 2] logits.
  std::vector<std::int32_t> labels(rows * 2);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  const Data d;
  engine::MicroBatch b = d.batch();
  b.inputs.set("labels", Tensor<const std::int32_t>(labels.data(), Shape{rows * 2}));
  for (int unit : {0, 1}) {
    const auto r = testing::check_unit_gradients(m, unit, b);
    INFO(r.summary());
    CHECK(r.passed());
  }
}

TEST_CASE("TokenEmbedding gives ids of any rank one more dimension of channels",
          "[unit][nn][layers]") {
  // [..., C] as documented: ids [2, 3, 4] were flattened to [24, C].
  nn::TokenEmbedding<double> emb("emb", 7, 3, "ids");
  std::vector<double> table(7 * 3), grad(7 * 3, 0.0);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<double>(i);
  const nn::ParamView<double> view{Tensor<double>(table.data(), Shape{7, 3}),
                                   Tensor<double>(grad.data(), Shape{7, 3})};
  emb.bind(std::span<const nn::ParamView<double>>(&view, 1));
  std::vector<std::int32_t> ids(24);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i % 7);
  Arena<> arena(1 << 20);
  for (const Shape& shape : {Shape{24}, Shape{6, 4}, Shape{2, 3, 4}, Shape{1, 2, 3, 4}}) {
    INFO(shape);
    arena.reset();
    nn::StepContext<double> ctx = context_of(arena);
    ctx.inputs.set("ids", Tensor<const std::int32_t>(ids.data(), shape));
    emb.forward(ctx);
    REQUIRE(ctx.x.rank() == shape.rank() + 1);
    for (int d = 0; d < shape.rank(); ++d) CHECK(ctx.x.dim(d) == shape[d]);
    CHECK(ctx.x.dim(-1) == 3);
    CHECK(ctx.x.data()[3 * 5 + 1] == table[3 * 5 + 1]);  // row 5 looks up id 5
  }
}

TEST_CASE("the gradient checker catches a wrong backward (negative controls)",
          "[unit][nn][layers]") {
  Scale* scale = nullptr;
  auto m = sandwich<double>([&](nn::Sequential<double>& s) { scale = &s.add<Scale>(); });
  const auto good = check(m, 1);
  INFO(good.summary());
  CHECK(good.passed());

  scale->wrong_param_grad = true;
  const auto wrong_param = check(m, 1);
  INFO(wrong_param.summary());
  CHECK_FALSE(wrong_param.passed());
  CHECK(wrong_param.worst_tensor == "scale.a");
  CHECK(wrong_param.worst_error > 0.05);

  scale->wrong_param_grad = false;
  scale->forget_input_grad = true;
  const auto wrong_input = check(m, 1);
  INFO(wrong_input.summary());
  CHECK_FALSE(wrong_input.passed());
  CHECK(wrong_input.worst_tensor == "input of unit 1");
  CHECK(wrong_input.summary().find("MISMATCH") != std::string::npos);
}

TEST_CASE("the gradient checker passes GPT's units, tied embedding included",
          "[unit][nn][layers]") {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");
  c.num_layers = 1;
  nn::GPT<double> gpt(c);
  std::vector<std::int32_t> tokens, targets;
  for (int i = 0; i < 2 * 4; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 7 + 1) % c.vocab_size));
    targets.push_back(static_cast<std::int32_t>((i * 3 + 2) % c.vocab_size));
  }
  engine::MicroBatch b{tokens.data(), targets.data(), 2, 4};
  testing::GradientCheckOptions o;
  o.max_elements = 24;  // evenly spaced elements of each tensor keep the check quick
  for (int unit : {0, 1, 2}) {
    const auto r = testing::check_unit_gradients(gpt, unit, b, o);
    INFO(r.summary());
    CHECK(r.passed());
  }
}

TEST_CASE("a layer model runs in f32 and bf16 close to f64", "[unit][nn][layers]") {
  const auto build = [](auto tag) {
    using T = decltype(tag);
    return sandwich<T>([](nn::Sequential<T>& s) {
      s.template add<nn::Linear<T>>("mid", hidden, hidden);
      s.template add<nn::SiLU<T>>();
      s.template add<nn::LayerNorm<T>>("ln", hidden);
    });
  };
  const auto loss_of = [&](auto tag) {
    using T = decltype(tag);
    auto m = build(tag);
    nn::LocalParameters<SequentialModel<T>> p(m, 99);
    Arena<> arena(1 << 20);
    const Data d;
    nn::StepContext<T> ctx;
    ctx.arena = &arena;
    const engine::MicroBatch b = d.batch();
    ctx.inputs = b.inputs;
    ctx.batch = rows;
    ctx.seq_len = 1;
    const double loss = convert<double>(m.forward(ctx));
    m.backward(ctx);
    double gsum = 0;
    for (T g : p.unit_grads(1)) gsum += std::fabs(convert<double>(g));
    return std::pair{loss, gsum};
  };
  const auto [l64, g64] = loss_of(double{});
  const auto [l32, g32] = loss_of(float{});
  const auto [l16, g16] = loss_of(bf16{});
  CHECK(l64 > 0.1);
  CHECK(std::fabs(l32 - l64) < 1e-5 * l64);
  CHECK(std::fabs(g32 - g64) < 1e-4 * g64);
  CHECK(std::fabs(l16 - l64) < 2e-2 * l64);
  CHECK(std::fabs(g16 - g64) < 5e-2 * g64);
}

TEST_CASE("layers name the input and dtype a micro-batch lacks", "[unit][nn][layers]") {
  auto m = sandwich<double>([](nn::Sequential<double>& s) { s.add<nn::ReLU<double>>(); });
  nn::LocalParameters<SequentialModel<double>> p(m, 1);
  Arena<> arena(1 << 20);
  nn::StepContext<double> ctx = context_of(arena);
  std::vector<double> x(rows * features, 0.5);
  std::vector<float> labels(rows, 1.0f);
  ctx.inputs.set("features", Tensor<const double>(x.data(), Shape{rows, features}));
  CHECK_THROWS_WITH(m.forward(ctx),
                    Catch::Contains("input 'x' is missing") && Catch::Contains("'features' (f64)"));
  arena.reset();
  ctx.x = {};
  ctx.inputs.set("x", Tensor<const double>(x.data(), Shape{rows, features}))
      .set("labels", Tensor<const float>(labels.data(), Shape{rows}));
  CHECK_THROWS_WITH(m.forward(ctx),
                    Catch::Contains("'labels' holds f32") && Catch::Contains("i32 were asked for"));
  // A layer whose input has the wrong width says which layer and both widths.
  SequentialModel<double> narrow;
  auto& u = narrow.add_unit();
  u.add<nn::FromInput<double>>("x");
  u.add<nn::Linear<double>>("fc", features + 1, 2);
  nn::LocalParameters<SequentialModel<double>> narrow_params(narrow, 1);
  arena.reset();
  ctx.x = {};
  CHECK_THROWS_WITH(narrow.forward(ctx),
                    Catch::Contains("Linear 'fc': the input's last dimension is 4, expected 5"));
  // Two layers with one name would share initialisation and checkpoint tensors.
  SequentialModel<double> dup;
  dup.add_unit().add<nn::Linear<double>>("fc", 2, 2);
  dup.add_unit().add<nn::Linear<double>>("fc", 2, 2);
  CHECK_THROWS_WITH(dup.unit_params(0), Catch::Contains("'fc.weight' is used twice"));
}

TEST_CASE("layers refuse a size of 0 when they are built", "[unit][nn][layers]") {
  // A LayerNorm over 0 channels divided by zero in its mean; embeddings and losses of size 0
  // made empty parameters or read no logits at all.
  using T = double;
  const auto none = [] { return nn::ParamView<T>{}; };
  CHECK_THROWS_WITH(nn::LayerNorm<T>("ln", 0), Catch::Contains("LayerNorm 'ln': channels = 0"));
  CHECK_THROWS_WITH(nn::RMSNorm<T>("rms", -1), Catch::Contains("RMSNorm 'rms': channels = -1"));
  CHECK_THROWS_WITH(nn::TokenEmbedding<T>("wte", 0, 4), Catch::Contains("vocab = 0"));
  CHECK_THROWS_WITH(nn::TokenEmbedding<T>("wte", 8, 0), Catch::Contains("channels = 0"));
  CHECK_THROWS_WITH(nn::PositionEmbedding<T>("wpe", 0, 4), Catch::Contains("max_positions = 0"));
  CHECK_THROWS_WITH(nn::PositionEmbedding<T>("wpe", 8, 0), Catch::Contains("channels = 0"));
  CHECK_THROWS_WITH(nn::SoftmaxCrossEntropy<T>(0), Catch::Contains("classes = 0"));
  CHECK_THROWS_WITH(nn::TiedLinear<T>("head", none, 0, 4), Catch::Contains("in = 0"));
  CHECK_THROWS_AS(nn::TiedLinear<T>("head", none, 4, 0), ShapeError);
  CHECK_NOTHROW(nn::LayerNorm<T>("ln", 1));
}

TEST_CASE(
    "a loss layer refuses a training forward without its labels and passes an evaluation's "
    "predictions on",
    "[unit][nn][layers]") {
  std::vector<double> x(rows * features, 0.5);
  for (const bool mse : {false, true}) {
    INFO((mse ? "MSELoss" : "SoftmaxCrossEntropy"));
    auto m = sandwich<double>([](nn::Sequential<double>& s) { s.add<nn::ReLU<double>>(); }, mse);
    nn::LocalParameters<SequentialModel<double>> p(m, 1);
    Arena<> arena(1 << 20);
    nn::StepContext<double> ctx = context_of(arena);
    ctx.inputs.set("x", Tensor<const double>(x.data(), Shape{rows, features}));
    CHECK_THROWS_WITH(
        m.forward(ctx),
        Catch::Contains(mse ? "MSELoss 'target': a training forward needs the labels, and the "
                              "micro-batch has no input 'target'"
                            : "SoftmaxCrossEntropy 'labels': a training forward needs the "
                              "labels, and the micro-batch has no input 'labels'"));
    arena.reset();
    ctx.x = {};
    ctx.training = false;
    CHECK_NOTHROW(m.forward(ctx));
    CHECK(ctx.x.numel() == rows * classes);
  }
  // The hand-written GPT's head refuses it the same way.
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.num_layers = 1;
  nn::HandWrittenGPT<float> gpt(cfg);
  nn::LocalParameters<nn::HandWrittenGPT<float>> gpt_params(gpt, 3);
  std::vector<std::int32_t> tokens(2 * 4, 1);
  Arena<> arena(4 << 20);
  nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.batch = 2;
  ctx.seq_len = 4;
  CHECK_THROWS_WITH(
      gpt.forward(ctx),
      Catch::Contains("GPT's head unit (nn::HandWrittenGPT): a training forward "
                      "needs the labels, and the micro-batch has no input 'targets'"));
  arena.reset();
  ctx.training = false;
  CHECK_NOTHROW(gpt.forward(ctx));
}

TEST_CASE("RMSNorm, Residual and CausalSelfAttention backwards equal finite differences (f64)",
          "[unit][nn][layers]") {
  using T = double;
  const std::vector<std::pair<std::string, std::function<void(nn::Sequential<T>&)>>> cases{
      {"RMSNorm", [](auto& s) { s.template add<nn::RMSNorm<T>>("rms", hidden); }},
      {"per-patch Linear, Flatten, Linear",
       [](auto& s) {
         // [rows, hidden] seen as [rows, 2 patches, 3]: a Linear per patch, then joined.
         s.template add<nn::Reshape<T>>(Shape{2, 3});
         s.template add<nn::Linear<T>>("patch", 3, 4);
         s.template add<nn::Flatten<T>>();
         s.template add<nn::Linear<T>>("join", 8, hidden);
       }},
      {"Residual MLP",
       [](auto& s) {
         auto& r = s.template add<nn::Residual<T>>("mlp");
         r.template add<nn::LayerNorm<T>>("ln", hidden);
         r.template add<nn::Linear<T>>("fc", hidden, 2 * hidden);
         r.template add<nn::GELU<T>>();
         r.template add<nn::Linear<T>>("proj", 2 * hidden, hidden);
       }},
      // The skip gradient reaches each branch's first layer three ways: a LayerNorm that writes
      // from it (the inner residual's), a residual that adds into a copy of it (the outer's
      // first layer), a Linear that adds into a copy of it (the last residual's).
      {"Residuals nested, and a branch starting with a Linear", [](auto& s) {
         auto& outer = s.template add<nn::Residual<T>>("outer");
         auto& inner = outer.template add<nn::Residual<T>>("inner");
         inner.template add<nn::LayerNorm<T>>("ln", hidden);
         inner.template add<nn::Linear<T>>("fc", hidden, hidden);
         outer.template add<nn::LayerNorm<T>>("ln2", hidden);
         outer.template add<nn::Linear<T>>("proj", hidden, hidden);
         auto& last = s.template add<nn::Residual<T>>("last");
         last.template add<nn::Linear<T>>("up", hidden, 2 * hidden);
         last.template add<nn::GELU<T>>();
         last.template add<nn::Linear<T>>("down", 2 * hidden, hidden);
       }}};
  for (const auto& [name, middle] : cases) {
    auto m = sandwich<T>(middle);
    for (int unit : {0, 1, 2}) {
      const auto r = check(m, unit);
      INFO(name << ": " << r.summary());
      CHECK(r.passed());
    }
  }
  // Attention needs (batch, position) rows: 2 sequences of 3 positions, 2 heads of 3 channels,
  // with and without attention dropout.
  for (double p : {0.0, 0.25}) {
    SequentialModel<T> m;
    auto& in = m.add_unit();
    in.add<nn::FromInput<T>>("x");
    in.add<nn::Linear<T>>("qkv", features, 3 * hidden, true, 0.8);
    auto& mid = m.add_unit();
    mid.add<nn::CausalSelfAttention<T>>(2, p, "att");
    mid.add<nn::Linear<T>>("head", hidden, classes);
    mid.add<nn::SoftmaxCrossEntropy<T>>(classes, "labels");
    std::vector<float> x(6 * features);
    std::vector<std::int32_t> labels(6);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(std::sin(1.3 * static_cast<double>(i)));
    for (std::size_t i = 0; i < labels.size(); ++i)
      labels[i] = static_cast<std::int32_t>(i % classes);
    nn::Inputs inputs;
    inputs.set("x", Tensor<const float>(x.data(), Shape{6, features}))
        .set("labels", Tensor<const std::int32_t>(labels.data(), Shape{6}));
    engine::MicroBatch b = engine::MicroBatch::of(inputs, 2);
    b.seq_len = 3;
    for (int unit : {0, 1}) {
      const auto r = testing::check_unit_gradients(m, unit, b);
      INFO("attention, dropout " << p << ": " << r.summary());
      CHECK(r.passed());
    }
  }
}

namespace {

inline std::vector<nn::ParamSpec> block_specs(const nn::GPTConfig& cfg) {
  nn::Sequential<float> s;
  nn::add_gpt_block(s, cfg, 1);
  return s.params();
}

// GPT-2's block (nn::TransformerBlock) rebuilt from layers: same parameter specs, same kernels in
// the same order. Returns every output of forward and backward, for a bitwise comparison.
template <class T>
std::vector<double> block_outputs(bool from_layers) {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.num_layers = 2;
  const std::int64_t B = 2, Tn = 5, C = cfg.channels, N = B * Tn;
  nn::TransformerBlock<T> gpt_block(cfg, 1);
  nn::Sequential<T> layers;
  nn::add_gpt_block(layers, cfg, 1);

  const std::vector<nn::ParamSpec> specs = from_layers ? layers.params() : gpt_block.params();
  std::vector<Buffer<T>> values, grads;
  std::vector<nn::ParamView<T>> views;
  for (const auto& s : specs) {
    values.emplace_back(static_cast<std::size_t>(s.numel()));
    grads.emplace_back(static_cast<std::size_t>(s.numel()));
    nn::initialise(s, values.back().view(), 0, 5);
    views.push_back({values.back().view(s.shape), grads.back().view(s.shape)});
  }
  Buffer<T> x(static_cast<std::size_t>(N * C)), dy(static_cast<std::size_t>(N * C)),
      dx(static_cast<std::size_t>(N * C));
  for (std::int64_t i = 0; i < N * C; ++i) {
    x.view().at(i) = convert<T>(std::sin(0.37 * static_cast<double>(i)));
    dy.view().at(i) = convert<T>(0.01 * std::cos(0.11 * static_cast<double>(i)));
  }
  Arena<> arena(8 << 20);
  nn::StepContext<T> ctx;
  ctx.arena = &arena;
  ctx.batch = B;
  ctx.seq_len = Tn;
  ctx.x = x.view(Shape{N, C});
  if (from_layers) {
    layers.bind(views);
    layers.forward(ctx);
  } else {
    gpt_block.bind(views);
    gpt_block.forward(ctx);
  }
  std::vector<double> out;  // every value widened exactly, for a bitwise comparison
  const auto append = [&](const Tensor<T>& t) {
    for (const T& v : t) out.push_back(convert<double>(v));
  };
  append(ctx.x);
  ctx.dy = dy.view(Shape{N, C});
  if (from_layers) {
    layers.backward(ctx);
  } else {
    ctx.dx = dx.view(Shape{N, C});
    gpt_block.backward(ctx);
  }
  append(ctx.dx);
  for (auto& g : grads) append(g.view());
  return out;
}

}  // namespace

TEST_CASE("GPT's transformer block rebuilt from layers gives the same bits (f64, f32, bf16)",
          "[unit][nn][layers]") {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.num_layers = 2;
  // The same parameters: names, shapes, initialisers, weight-decay flags, in binding order.
  nn::TransformerBlock<float> gpt_block(cfg, 1);
  const std::vector<nn::ParamSpec> want = gpt_block.params(), got = block_specs(cfg);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO(want[i].name);
    CHECK(got[i].name == want[i].name);
    CHECK(got[i].shape == want[i].shape);
    CHECK(got[i].init == want[i].init);
    CHECK(got[i].stddev == want[i].stddev);
    CHECK(got[i].weight_decay == want[i].weight_decay);
  }

  const auto f64_gpt = block_outputs<double>(false), f64_layers = block_outputs<double>(true);
  const auto f32_gpt = block_outputs<float>(false), f32_layers = block_outputs<float>(true);
  REQUIRE(f64_gpt.size() == f64_layers.size());
  CHECK(f64_gpt == f64_layers);
  CHECK(f32_gpt == f32_layers);
  CHECK(block_outputs<bf16>(false) == block_outputs<bf16>(true));
  // Negative control: the comparison sees a one-ulp change of one f32 value.
  auto changed = f32_layers;
  const std::size_t mid = changed.size() / 2;
  changed[mid] = std::nextafter(static_cast<float>(changed[mid]), 1.0f);
  CHECK(changed != f32_gpt);
  CHECK(f32_gpt != f64_gpt);  // and the types really differ
}

TEST_CASE("a layer-built language model reads tokens and targets by name or from the batch",
          "[unit][nn][layers]") {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  const std::int64_t B = 2, Tn = 4, C = cfg.channels, V = cfg.vocab_size;
  SequentialModel<double> m;
  m.add_unit().add<nn::TokenEmbedding<double>>("wte", V, C);  // "tokens": input or ctx.tokens
  nn::add_gpt_block(m.add_unit(), cfg, 0);
  auto& head = m.add_unit();
  head.add<nn::LayerNorm<double>>("ln_f", C);
  head.add<nn::Linear<double>>("lm_head", C, V, false);
  head.add<nn::SoftmaxCrossEntropy<double>>(V, "targets");  // input, or ctx.targets
  std::vector<std::int32_t> tokens, targets;
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 7 + 3) % V));
    targets.push_back(static_cast<std::int32_t>((i * 5 + 1) % V));
  }
  const auto run = [&](bool named) {
    nn::LocalParameters<SequentialModel<double>> p(m, 3);
    Arena<> arena(8 << 20);
    nn::StepContext<double> ctx = context_of(arena, B, Tn);
    if (named) {
      ctx.inputs.set("tokens", Tensor<const std::int32_t>(tokens.data(), Shape{B, Tn}))
          .set("targets", Tensor<const std::int32_t>(targets.data(), Shape{B, Tn}));
    } else {
      ctx.tokens = tokens.data();
      ctx.targets = targets.data();
    }
    std::vector<double> out{m.forward(ctx)};
    m.backward(ctx);
    for (int u = 0; u < m.num_units(); ++u) {
      for (double g : p.unit_grads(u)) out.push_back(g);
    }
    return out;
  };
  const auto named = run(true), pointers = run(false);
  CHECK(named[0] > 1.0);  // about log(V) at initialisation
  CHECK(named == pointers);
  // The sequence layers see (batch, position) rows: the checker passes every unit.
  nn::Inputs in;
  in.set("tokens", Tensor<const std::int32_t>(tokens.data(), Shape{B, Tn}))
      .set("targets", Tensor<const std::int32_t>(targets.data(), Shape{B, Tn}));
  testing::GradientCheckOptions o;
  o.max_elements = 16;
  for (int unit : {0, 1, 2}) {
    const auto r = testing::check_unit_gradients(m, unit, engine::MicroBatch::of(in, B, Tn), o);
    INFO(r.summary());
    CHECK(r.passed());
  }
}

namespace {

// Loss, logits and every gradient of one training forward/backward of model M (bits widened to
// double), from parameters initialised by seed.
template <class M>
std::vector<double> gpt_run(const nn::GPTConfig& cfg, std::uint64_t step) {
  M model(cfg);
  nn::LocalParameters<M> params(model, 21);
  const std::int64_t B = 2, Tn = 6;
  std::vector<std::int32_t> tokens, targets;
  for (std::int64_t i = 0; i < B * Tn; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 11 + 2) % cfg.vocab_size));
    targets.push_back(i == 3 ? -1 : static_cast<std::int32_t>((i * 3 + 5) % cfg.vocab_size));
  }
  Arena<> arena(16 << 20);
  nn::StepContext<typename M::value_type> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = B;
  ctx.seq_len = Tn;
  ctx.step = step;
  std::vector<double> out{convert<double>(model.forward(ctx))};
  for (const auto& v : model.logits()) out.push_back(convert<double>(v));
  model.backward(ctx);
  for (int u = 0; u < model.num_units(); ++u) {
    for (const auto& g : params.unit_grads(u)) out.push_back(convert<double>(g));
  }
  return out;
}

template <class T>
void check_layer_gpt(const nn::GPTConfig& cfg) {
  const auto want = gpt_run<nn::HandWrittenGPT<T>>(cfg, 3);
  const auto got = gpt_run<nn::LayerGPT<T>>(cfg, 3);
  REQUIRE(got.size() == want.size());
  CHECK(got == want);
  // Negative control: another dropout step draws other masks, so the bits differ.
  if (cfg.dropout > 0) CHECK(gpt_run<nn::LayerGPT<T>>(cfg, 4) != want);
}

}  // namespace

TEST_CASE("LayerGPT (GPT-2 from layers, nn::GPT) equals the hand-written GPT bit for bit",
          "[unit][nn][layers]") {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.num_layers = 2;
  nn::GPTConfig padded = cfg;  // 61 tokens in the 64 rows: the table declares 61 rows in use
  padded.vocab_size = 61;
  padded.padded_vocab_size = 64;
  for (const nn::GPTConfig& shape : {cfg, padded}) {
    INFO("vocabulary " << shape.vocab_size << " in " << shape.vocab_rows() << " rows");
    nn::HandWrittenGPT<float> gpt(shape);
    nn::LayerGPT<float> layered(shape);
    REQUIRE(layered.num_units() == gpt.num_units());
    for (int u = 0; u < gpt.num_units(); ++u) {
      const auto want = gpt.unit_params(u), got = layered.unit_params(u);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        INFO(want[i].name);
        CHECK(got[i].name == want[i].name);
        CHECK(got[i].shape == want[i].shape);
        CHECK(got[i].init == want[i].init);
        CHECK(got[i].stddev == want[i].stddev);
        CHECK(got[i].weight_decay == want[i].weight_decay);
        CHECK(got[i].rows_in_use == want[i].rows_in_use);
        // The token table's rows in use are the vocabulary's; no other parameter declares any.
        CHECK(got[i].rows_in_use ==
              (got[i].name == "transformer.wte.weight" ? shape.vocab_size : 0));
      }
      CHECK(layered.unit_uses(u) == gpt.unit_uses(u));
    }
    // The embeddings decay, as in nanoGPT, llm.c and Megatron (every matrix but the norms); the
    // tied head's weight is the token embedding's. Biases and norms do not.
    for (const auto& p : layered.unit_params(0)) {
      INFO(p.name);
      CHECK(p.weight_decay);
    }
    for (const auto& p : gpt.unit_params(0)) CHECK(p.weight_decay);
    for (const auto& p : layered.unit_params(1)) {
      INFO(p.name);
      const bool matrix = p.shape.rank() == 2;
      CHECK(p.weight_decay == matrix);
    }
  }
  for (double dropout : {0.0, 0.1}) {
    INFO("dropout " << dropout);
    cfg.dropout = dropout;
    cfg.attn_dropout = dropout;
    check_layer_gpt<double>(cfg);
    check_layer_gpt<float>(cfg);
    check_layer_gpt<bf16>(cfg);
  }
  // Checkpointed blocks keep only their input and output between forward and backward.
  const auto held_after_forward = [&](bool checkpoint) {
    nn::GPTConfig c = cfg;
    c.checkpoint_activations = checkpoint;
    nn::LayerGPT<float> m(c);
    nn::LocalParameters<nn::LayerGPT<float>> params(m, 1);
    std::vector<std::int32_t> tokens(12, 1), targets(12, 2);
    Arena<> arena(16 << 20);
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.tokens = tokens.data();
    ctx.targets = targets.data();
    ctx.batch = 2;
    ctx.seq_len = 6;
    m.forward(ctx);
    return arena.used_bytes();
  };
  CHECK(held_after_forward(true) < held_after_forward(false) / 2);
  cfg.checkpoint_activations = true;  // blocks recompute their forward before backward
  check_layer_gpt<double>(cfg);
  check_layer_gpt<float>(cfg);
  check_layer_gpt<bf16>(cfg);
}

TEST_CASE(
    "layer edge cases: NaN through ReLU, targets that do not match the rows, a loss that "
    "adds its gradient, an empty batch, a Dropout with no input",
    "[unit][nn][layers]") {
  // ReLU keeps a NaN (as PyTorch's): a diverged activation must reach the loss's checks.
  const float x[3] = {NAN, -1.0f, 2.0f};
  float y[3] = {};
  ops::cpu::relu_forward(y, x, 3);
  CHECK(std::isnan(y[0]));
  CHECK(y[1] == 0.0f);
  CHECK(y[2] == 2.0f);

  Arena<> arena(1 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  std::vector<double> logits(rows * classes);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = 0.1 * static_cast<double>(i % 7);
  std::vector<std::int32_t> targets(rows, 1);

  // ctx.targets hold batch x seq_len labels: 4 of them for 5 rows of logits is an error, not a
  // read past their end.
  nn::SoftmaxCrossEntropy<double> ce(classes, "targets");
  ctx.targets = targets.data();
  ctx.batch = 2;
  ctx.seq_len = 2;
  ctx.x = Tensor<double>(logits.data(), Shape{rows, classes});
  CHECK_THROWS_WITH(ce.forward(ctx), Catch::Contains("4 targets (batch x seq_len) for 5 rows"));
  ctx.batch = rows;
  ctx.seq_len = 1;
  ce.forward(ctx);

  // With overwrite_dx false (the first layer of a Residual branch) the loss adds its gradient
  // to the skip gradient already in dx.
  std::vector<double> written(rows * classes, 0.0), added(rows * classes, 1.0);
  ctx.loss_scale = 1.0;
  ctx.dx = Tensor<double>(written.data(), Shape{rows, classes});
  ctx.overwrite_dx = true;
  ce.backward(ctx);
  ctx.dx = Tensor<double>(added.data(), Shape{rows, classes});
  ctx.overwrite_dx = false;
  ce.backward(ctx);
  for (std::size_t i = 0; i < added.size(); ++i) CHECK(added[i] == Approx(1.0 + written[i]));
  CHECK(written[0] != 0.0);

  // An empty batch through the fused head: no rows, no gradient, no division by zero.
  std::vector<double> w(classes * features, 0.5), gw(classes * features, 0.0);
  nn::LinearCrossEntropy<double> head(
      "head",
      [&] {
        return nn::ParamView<double>{Tensor<double>(w.data(), Shape{classes, features}),
                                     Tensor<double>(gw.data(), Shape{classes, features})};
      },
      features, classes, "targets", 64);
  std::vector<double> none(1);
  arena.reset();
  ctx.batch = 0;
  ctx.x = Tensor<double>(none.data(), Shape{0, features});
  ctx.dx = Tensor<double>(none.data(), Shape{0, features});
  ctx.overwrite_dx = true;
  ctx.training = true;
  head.forward(ctx);
  head.backward(ctx);
  CHECK(gw == std::vector<double>(classes * features, 0.0));

  // Dropout first in unit 0 has no input to drop from.
  nn::Dropout<double> drop(0.5, "d");
  ctx.x = {};
  CHECK_THROWS_WITH(drop.forward(ctx), Catch::Contains("Dropout 'd': no input activation"));
}
