// custom_model: bring your own model. An MLP classifier built from zero's layers learns the two
// spirals (a generated 2-D data set no linear model separates), trained by
// Engine<MyModel, ZeroStage<3>> over LocalComm ranks with AdamW from a DeepSpeed config. The
// features (f32) and labels (i32) travel as named MicroBatch inputs from a data::ArrayLoader,
// which gives every rank its rows of the same global batch at any world size.
//
//   custom_model [--ranks 2] [--steps 1500] [--hidden 64] [--min-accuracy 0.95]
//
// It prints the loss now and then and the accuracy on the whole data set, and exits 1 when
// the accuracy is below --min-accuracy (CTest runs it so).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <zero/config/config.hpp>
#include <zero/data/array_loader.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/sequential_model.hpp>

#include "../cli_number.hpp"

using namespace zero;

namespace {

struct Options {
  int ranks = 2;
  int steps = 1500;
  std::int64_t hidden = 64;
  double min_accuracy = 0.95;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> const char* {
      expect<ConfigError>(i + 1 < argc, "custom_model: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--ranks") {
      o.ranks = static_cast<int>(examples::parse_integer(a, value(), 1, 1024));
    } else if (a == "--steps") {
      o.steps = static_cast<int>(examples::parse_integer(a, value(), 0, 1 << 30));
    } else if (a == "--hidden") {
      o.hidden = examples::parse_integer(a, value(), 1, 1 << 20);
    } else if (a == "--min-accuracy") {
      o.min_accuracy = examples::parse_real(a, value(), 0.0, 1.0);
    } else {
      raise<ConfigError>("custom_model: unknown option '", a,
                         "' (known: --ranks --steps --hidden --min-accuracy)");
    }
  }
  return o;
}

// Two interleaved spirals of `per_class` points each, 1.75 turns, with a little noise:
// features [2 * per_class, 2] f32, labels [2 * per_class] i32 (0 or 1).
struct Spirals {
  std::vector<float> features;
  std::vector<std::int32_t> labels;
  std::int64_t size = 0;

  explicit Spirals(std::int64_t per_class, std::uint64_t seed = 42) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> noise(0.0, 0.02);
    for (std::int64_t i = 0; i < per_class; ++i) {
      const double t = 0.1 + 0.9 * static_cast<double>(i) / static_cast<double>(per_class);
      const double angle = 1.75 * 2 * std::numbers::pi * t;
      for (int cls = 0; cls < 2; ++cls) {
        const double a = angle + cls * std::numbers::pi;  // the second arm is the first rotated
        features.push_back(static_cast<float>(2 * t * std::cos(a) + noise(gen)));
        features.push_back(static_cast<float>(2 * t * std::sin(a) + noise(gen)));
        labels.push_back(cls);
      }
    }
    size = 2 * per_class;
  }
};

// The user's model: three units of layers, 2 -> hidden -> hidden -> 2 classes. A unit is what
// ZeRO-3 gathers and releases at once, so units group layers of a similar size.
using Model = nn::SequentialModel<float>;
Model make_model(std::int64_t hidden, nn::SoftmaxCrossEntropy<float>** loss) {
  Model m;
  auto& first = m.add_unit();
  first.add<nn::FromInput<float>>("features");
  first.add<nn::Linear<float>>("mlp.fc1", 2, hidden);
  first.add<nn::SiLU<float>>();
  auto& middle = m.add_unit();
  middle.add<nn::Linear<float>>("mlp.fc2", hidden, hidden);
  middle.add<nn::SiLU<float>>();
  auto& head = m.add_unit();
  head.add<nn::Linear<float>>("mlp.out", hidden, 2);
  *loss = &head.add<nn::SoftmaxCrossEntropy<float>>(2, "labels");
  return m;
}

Config make_config(int ranks) {
  return Config::from_json_string(R"({
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": )" +
                                  std::to_string(64 / ranks) + R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99],
                  "eps": 1e-8, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3}
  })");
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  expect<ConfigError>(o.ranks > 0 && 64 % o.ranks == 0, "custom_model: --ranks ", o.ranks,
                      " must divide the global batch of 64");
  const Spirals data(256);
  const Config config = make_config(o.ranks);
  double accuracy = 0;
  parallel::LocalComm::run(o.ranks, [&](parallel::LocalComm& comm) {
    nn::SoftmaxCrossEntropy<float>* loss_layer = nullptr;
    Model model = make_model(o.hidden, &loss_layer);
    Engine<Model, ZeroStage<3>> engine(model, comm, config);

    data::ArrayLoader loader({64, comm.size(), comm.rank(), 1, /*shuffle=*/true, 7});
    loader.add("features", data.features, Shape{data.size, 2})
        .add("labels", data.labels, Shape{data.size});
    for (int step = 0; step < o.steps; ++step) {
      const data::ArrayBatch batch = loader.next();  // this rank's rows of the step's batch
      engine.forward(engine::MicroBatch::of(batch.inputs(), batch.rows, 1, batch.first_row));
      engine.backward();
      engine.step();
      if (comm.rank() == 0 && (step % 250 == 0 || step + 1 == o.steps)) {
        std::printf("step %5d  loss %.4f (rank 0's rows)\n", step,
                    static_cast<double>(engine.loss()));
      }
    }

    // Every rank evaluates (stage 3 gathers each unit on all ranks); rank 0 counts.
    nn::Inputs all;
    all.set("features", Tensor<const float>(data.features.data(), Shape{data.size, 2}));
    engine.evaluate(engine::MicroBatch::of(all, data.size));
    if (comm.rank() != 0) return;
    const Tensor<const float> logits = loss_layer->logits();
    std::int64_t correct = 0;
    for (std::int64_t i = 0; i < data.size; ++i) {
      const int predicted = logits.at(2 * i + 1) > logits.at(2 * i) ? 1 : 0;
      if (predicted == data.labels[static_cast<std::size_t>(i)]) ++correct;
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(data.size);
  });
  std::printf("accuracy %.4f on %lld points (%d ranks, ZeRO stage 3)\n", accuracy,
              static_cast<long long>(data.size), o.ranks);
  if (accuracy < o.min_accuracy) {
    std::fprintf(stderr, "custom_model: accuracy %.4f is below --min-accuracy %.4f\n", accuracy,
                 o.min_accuracy);
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "custom_model: %s\n", e.what());
  return 1;
}
