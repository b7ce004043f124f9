// A user's model built from layers (nn::SequentialModel: an MLP classifier on float features
// with integer labels, fed by data::ArrayLoader through MicroBatch inputs) trained by the engine
// at ZeRO stages 0-3 over 1, 2 and 4 LocalComm ranks, with gradient accumulation 1 and 2,
// equals the single-process run on the same global batches (f64 SGD, 1e-10), with a negative
// control; the layers' gradients pass the public checker on the same model. A training forward
// without the labels is refused before it counts, and the run still ends at the same weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/data/array_loader.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/layer_norm.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/testing/gradient_check.hpp>

#include "../support/per_rank.hpp"
#include "../support/worse.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using parallel::LocalComm;

namespace {

constexpr std::int64_t samples = 48, global_batch = 8, in_features = 3, hidden = 8, classes = 3;
constexpr int steps = 3;
constexpr double lr = 0.5;

// features -> Linear -> GELU | Linear -> LayerNorm -> ReLU | Linear -> cross-entropy.
nn::SequentialModel<double> mlp() {
  using T = double;
  nn::SequentialModel<T> m;
  auto& u0 = m.add_unit();
  u0.add<nn::FromInput<T>>("features");
  u0.add<nn::Linear<T>>("fc1", in_features, hidden);
  u0.add<nn::GELU<T>>();
  auto& u1 = m.add_unit();
  u1.add<nn::Linear<T>>("fc2", hidden, hidden);
  u1.add<nn::LayerNorm<T>>("ln", hidden);
  u1.add<nn::ReLU<T>>();
  auto& u2 = m.add_unit();
  u2.add<nn::Linear<T>>("out", hidden, classes);
  u2.add<nn::SoftmaxCrossEntropy<T>>(classes, "labels");
  return m;
}

// f32 features (converted by FromInput) and i32 labels; shift perturbs the features for the
// negative control.
data::ArrayLoader loader(int world, int rank, int micro, double shift = 0.0) {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  for (std::int64_t s = 0; s < samples; ++s) {
    for (std::int64_t f = 0; f < in_features; ++f) {
      x.push_back(
          static_cast<float>(std::sin(0.7 * static_cast<double>(s * in_features + f)) + shift));
    }
    y.push_back(static_cast<std::int32_t>((s * 5) % classes));
  }
  data::ArrayLoader l({global_batch, world, rank, micro, /*shuffle=*/true, 11});
  l.add("features", x, Shape{samples, in_features}).add("labels", y, Shape{samples});
  return l;
}

void sgd(std::span<double> p, std::span<const double> g) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
}

// One process on each step's whole global batch.
std::vector<std::vector<double>> reference(double shift = 0.0) {
  auto model = mlp();
  nn::LocalParameters<nn::SequentialModel<double>> params(model, 1234);  // the engine's seed
  data::ArrayLoader l = loader(1, 0, 1, shift);
  Arena<> arena(8 << 20);
  for (int step = 0; step < steps; ++step) {
    params.zero_grads();
    const data::ArrayBatch b = l.next();
    nn::StepContext<double> ctx;
    ctx.arena = &arena;
    ctx.batch = b.rows;
    ctx.seq_len = 1;
    ctx.inputs = b.inputs();
    model.forward(ctx);
    model.backward(ctx);
    arena.reset();
    for (int u = 0; u < model.num_units(); ++u) {
      sgd(params.unit_values(u).span(), params.unit_grads(u).span());
    }
  }
  std::vector<std::vector<double>> out;
  for (int u = 0; u < model.num_units(); ++u) {
    const auto v = params.unit_values(u);
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

// Stage S on world ranks with micro micro-batches per step: the worst difference to want.
// refused, when given, asks each window first for a training forward without the labels and
// receives what each rank's refusal said (and whether the engine was broken after it).
template <int S>
double engine_error(int world, int micro, const std::vector<std::vector<double>>& want,
                    std::vector<std::string>* refused = nullptr) {
  std::vector<double> worst(static_cast<std::size_t>(world), 0.0);
  if (refused != nullptr) refused->assign(static_cast<std::size_t>(world), "");
  LocalComm::run(world, [&](LocalComm& comm) {
    auto model = mlp();
    engine::EngineOptions o;
    o.gradient_accumulation_steps = micro;
    o.activation_bytes = 4 << 20;
    o.persistence_threshold = 0;  // stage 3: gather every unit per use
    o.prefetch_elems = 1;
    engine::Engine<nn::SequentialModel<double>, ZeroStage<S>> eng(
        model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(p, g); }, o);
    data::ArrayLoader l = loader(world, comm.rank(), micro);
    double w = 0;
    for (int step = 0; step < steps; ++step) {
      for (int m = 0; m < micro; ++m) {
        const data::ArrayBatch b = l.next();  // alive until the backward
        if (refused != nullptr && m == 0) {
          const nn::Inputs all = b.inputs();
          const nn::InputTensor& f = all.entry("features");
          nn::Inputs unlabelled;
          unlabelled.set_raw("features", f.data, f.shape, f.dtype);
          std::string& seen = (*refused)[static_cast<std::size_t>(comm.rank())];
          seen += testing::thrown_message(
              [&] { eng.forward(engine::MicroBatch::of(unlabelled, b.rows)); });
          seen += eng.broken_reason().empty() ? " | consistent\n" : " | broken\n";
        }
        eng.forward(engine::MicroBatch::of(b.inputs(), b.rows));
        eng.backward();
        if (eng.step() != (m + 1 == micro)) w = 1e9;
      }
    }
    for (int u = 0; u < eng.num_units(); ++u) {
      const auto got = eng.gather_unit_values(u);
      const auto& ref = want[static_cast<std::size_t>(u)];
      if (got.size() != ref.size()) w = 1e9;
      for (std::size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
        w = zero::testing::worse(w, std::fabs(got[i] - ref[i]));
      }
    }
    worst[static_cast<std::size_t>(comm.rank())] = w;
  });
  return *std::max_element(worst.begin(), worst.end());
}

template <int S>
void check_stage() {
  const auto want = reference();
  const auto wrong = reference(/*shift=*/1e-3);
  for (int world : {1, 2, 4}) {
    for (int micro : {1, 2}) {
      INFO("stage " << S << " world " << world << " micro-batches " << micro);
      CHECK(engine_error<S>(world, micro, want) < 1e-10);
      if (world == 2 && micro == 2) CHECK(engine_error<S>(world, micro, wrong) > 1e-6);
    }
  }
}

}  // namespace

TEST_CASE("a layer-built MLP at stage 0 equals its single-process run", "[unit][engine][custom]") {
  check_stage<0>();
}
TEST_CASE("a layer-built MLP at stage 1 equals its single-process run", "[unit][engine][custom]") {
  check_stage<1>();
}
TEST_CASE("a layer-built MLP at stage 2 equals its single-process run", "[unit][engine][custom]") {
  check_stage<2>();
}
TEST_CASE("a layer-built MLP at stage 3 equals its single-process run", "[unit][engine][custom]") {
  check_stage<3>();
}

TEST_CASE(
    "a training forward without the labels is refused at the forward, and the run goes on to "
    "the single-process weights",
    "[unit][engine][custom]") {
  // Before, the forward passed the logits on and counted as a micro-step; its backward then
  // threw ("backward needs labels") and left the engine broken until a checkpoint was loaded.
  const auto want = reference();
  auto check = [&]<int S>(std::integral_constant<int, S>) {
    for (int micro : {1, 2}) {
      INFO("stage " << S << " micro-batches " << micro);
      std::vector<std::string> refused;
      CHECK(engine_error<S>(2, micro, want, &refused) < 1e-10);
      for (const std::string& seen : refused) {
        CHECK_THAT(seen, Catch::Contains("SoftmaxCrossEntropy 'labels': a training forward needs "
                                         "the labels, and the micro-batch has no input 'labels'"));
        CHECK_THAT(seen, !Catch::Contains("broken") && !Catch::Contains("(nothing thrown)"));
      }
    }
  };
  check(std::integral_constant<int, 0>{});
  check(std::integral_constant<int, 3>{});
}

TEST_CASE("a parameter name holding '/' is refused when the engine is built",
          "[unit][engine][custom]") {
  // Checkpoints key a parameter's optimizer states "<name>/<state>": the save of "enc/fc" went
  // through, and its load refused the checkpoint as holding a tensor the model has not ('enc').
  nn::SequentialModel<double> m;
  auto& u0 = m.add_unit();
  u0.add<nn::FromInput<double>>("features");
  u0.add<nn::Linear<double>>("enc/fc", in_features, classes);
  u0.add<nn::SoftmaxCrossEntropy<double>>(classes, "labels");
  LocalComm::run(1, [&](LocalComm& comm) {
    const auto build = [&] {
      engine::Engine<nn::SequentialModel<double>, ZeroStage<1>> eng(
          m, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(p, g); });
    };
    CHECK_THROWS_WITH(build(),
                      Catch::Contains("parameter 'enc/fc.") && Catch::Contains("hold no '/'"));
  });
}

TEST_CASE("an empty or repeated parameter name is refused when the engine is built",
          "[unit][engine][custom]") {
  // SequentialModel names its parameters itself; a hand-written model names them as it likes.
  // An empty name or one given twice would key two tensors alike in a checkpoint.
  struct Renamed : nn::SequentialModel<double> {
    std::string last;  // the name the model's last parameter reports
    std::vector<nn::ParamSpec> unit_params(int u) const {
      std::vector<nn::ParamSpec> specs = nn::SequentialModel<double>::unit_params(u);
      if (u == num_units() - 1) specs.back().name = last;
      return specs;
    }
  };
  Renamed m;
  auto& u0 = m.add_unit();
  u0.add<nn::FromInput<double>>("features");
  u0.add<nn::Linear<double>>("fc1", in_features, classes);
  auto& u1 = m.add_unit();
  u1.add<nn::Linear<double>>("fc2", classes, classes);
  u1.add<nn::SoftmaxCrossEntropy<double>>(classes, "labels");
  const std::string first = m.unit_params(0).front().name;
  LocalComm::run(1, [&](LocalComm& comm) {
    const auto build = [&] {
      engine::Engine<Renamed, ZeroStage<2>> eng(
          m, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(p, g); });
    };
    m.last = "";
    CHECK_THROWS_WITH(
        build(), Catch::Contains("unit 1's parameter ''") && Catch::Contains("must be non-empty"));
    m.last = first;
    CHECK_THROWS_WITH(build(), Catch::Contains("unit 1's parameter '" + first + "'") &&
                                   Catch::Contains("name of another parameter"));
    m.last = "fc2.renamed";
    CHECK_NOTHROW(build());
  });
}

TEST_CASE("the layer-built MLP's units pass the gradient checker", "[unit][engine][custom]") {
  auto model = mlp();
  const data::ArrayBatch b = loader(1, 0, 1).global_batch(0);
  for (int u = 0; u < model.num_units(); ++u) {
    const auto r =
        testing::check_unit_gradients(model, u, engine::MicroBatch::of(b.inputs(), b.rows));
    INFO(r.summary());
    CHECK(r.passed());
  }
}

namespace {

// LayerGPT (GPT-2 from layers, its LM head a TiedLinear on unit 0's table) under the engine at
// stage S on 2 ranks: its parameters after 3 steps against nn::GPT's single-process reference.
template <int S>
double layer_gpt_error(const std::vector<std::vector<double>>& want) {
  std::vector<double> worst(2, 0.0);
  LocalComm::run(2, [&](LocalComm& comm) {
    nn::LayerGPT<double> model(test::tiny());
    engine::EngineOptions o;
    o.activation_bytes = 32 << 20;
    o.persistence_threshold = 0;
    o.prefetch_elems = 1;
    engine::Engine<nn::LayerGPT<double>, ZeroStage<S>> eng(
        model, comm,
        [](int, std::span<double> p, std::span<const double> g) { test::sgd(1.0, p, g); }, o);
    worst[static_cast<std::size_t>(comm.rank())] = test::max_error(eng, comm, 1, 3, want);
  });
  return std::max(worst[0], worst[1]);
}

}  // namespace

TEST_CASE("LayerGPT under the engine equals nn::GPT's single-process run (stages 0-3)",
          "[unit][engine][custom]") {
  const auto want = test::reference_sgd(test::micro_rows * 2, 3, 1.0);
  CHECK(layer_gpt_error<0>(want) < 1e-10);
  CHECK(layer_gpt_error<1>(want) < 1e-10);
  CHECK(layer_gpt_error<2>(want) < 1e-10);
  CHECK(layer_gpt_error<3>(want) < 1e-10);
  // Negative control: the reference after one step more.
  CHECK(layer_gpt_error<3>(test::reference_sgd(test::micro_rows * 2, 4, 1.0)) > 1e-6);
}
