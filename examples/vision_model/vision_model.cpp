// vision_model: a small convolution-free vision model (patches, a Linear per patch, then a dense
// head, in the spirit of MLP-Mixer / ViT's patch embedding) built from zero's layers. It learns
// to tell four generated shapes apart in 12x12 grey images stored as u8 pixels: horizontal and
// vertical bars, and the two diagonals, at random places on a noisy background. Trained with
// Engine<Model, ZeroStage<2>> over LocalComm ranks and AdamW; the images travel as named u8
// MicroBatch inputs and FromInput scales them to [0, 1].
//
//   vision_model [--ranks 2] [--steps 400] [--min-accuracy 0.95]
//
// It prints the accuracy on held-out images and exits 1 below --min-accuracy.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <zero/config/config.hpp>
#include <zero/data/array_loader.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/cross_entropy.hpp>
#include <zero/nn/layers/flatten.hpp>
#include <zero/nn/layers/input.hpp>
#include <zero/nn/layers/layer_norm.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/sequential_model.hpp>

#include "../cli_number.hpp"

using namespace zero;

namespace {

constexpr std::int64_t side = 12, patch = 4, grid = side / patch, patches = grid * grid;
constexpr std::int64_t patch_pixels = patch * patch, classes = 4;

struct Options {
  int ranks = 2;
  int steps = 400;
  double min_accuracy = 0.95;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::puts("usage: vision_model [--ranks 2] [--steps 400] [--min-accuracy 0.95]");
      std::exit(0);
    }
    // The name first: a typo is an unknown option, not "a flag that needs a value".
    expect<ConfigError>(a == "--ranks" || a == "--steps" || a == "--min-accuracy",
                        "vision_model: unknown option '", a,
                        "' (known: --ranks --steps --min-accuracy)");
    expect<ConfigError>(i + 1 < argc, "vision_model: ", a, " needs a value");
    const char* v = argv[++i];
    if (a == "--ranks") {
      o.ranks = static_cast<int>(examples::parse_integer(a, v, 1, 1024));
    } else if (a == "--steps") {
      o.steps = static_cast<int>(examples::parse_integer(a, v, 0, 1 << 30));
    } else {  // --min-accuracy
      o.min_accuracy = examples::parse_real(a, v, 0.0, 1.0);
    }
  }
  return o;
}

// count images with labels; pixels already cut into patches: [count, patches, patch_pixels] u8,
// patch (py, px) holding pixels (py*4 + y, px*4 + x) row by row.
struct Images {
  std::vector<std::uint8_t> pixels;
  std::vector<std::int32_t> labels;
  std::int64_t count = 0;

  Images(std::int64_t n, std::uint64_t seed) : count(n) {
    std::mt19937_64 gen(seed);
    const auto uniform = [&](int lo, int hi) {
      return std::uniform_int_distribution<int>(lo, hi)(gen);
    };
    pixels.resize(static_cast<std::size_t>(n * patches * patch_pixels));
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint8_t image[side][side];
      for (auto& row : image) {
        for (auto& p : row) p = static_cast<std::uint8_t>(uniform(0, 60));
      }
      const int label = uniform(0, classes - 1);
      const int length = uniform(6, 10), a = uniform(0, side - 2), b = uniform(0, side - length);
      for (int k = 0; k < length; ++k) {
        for (int t = 0; t < 2; ++t) {  // strokes two pixels thick
          int y = 0, x = 0;
          switch (label) {
            case 0:
              y = std::min<int>(a + t, side - 1), x = b + k;
              break;  // horizontal
            case 1:
              y = b + k, x = std::min<int>(a + t, side - 1);
              break;  // vertical
            case 2:
              y = b + k, x = std::min<int>(b + k + t, side - 1);
              break;  // diagonal
            default:
              y = b + k, x = std::max<int>(side - 1 - b - k - t, 0);
              break;  // anti
          }
          image[y][x] = static_cast<std::uint8_t>(uniform(170, 255));
        }
      }
      for (std::int64_t py = 0; py < grid; ++py) {
        for (std::int64_t px = 0; px < grid; ++px) {
          for (std::int64_t y = 0; y < patch; ++y) {
            for (std::int64_t x = 0; x < patch; ++x) {
              const std::int64_t at = ((i * patches + py * grid + px) * patch + y) * patch + x;
              pixels[static_cast<std::size_t>(at)] = image[py * patch + y][px * patch + x];
            }
          }
        }
      }
      labels.push_back(label);
    }
  }
  Shape shape() const { return Shape{count, patches, patch_pixels}; }
};

// unit 0: patch embedding (a Linear shared by the 9 patches) and a norm; unit 1: the patches
// joined and mixed; unit 2: the classifier and its loss.
using Model = nn::SequentialModel<float>;
Model make_model(nn::SoftmaxCrossEntropy<float>** loss) {
  Model m;
  auto& embed = m.add_unit();
  embed.add<nn::FromInput<float>>("patches", 1.0 / 255.0);  // u8 pixels -> [0, 1]
  embed.add<nn::Linear<float>>("patch_embed", patch_pixels, 32);
  embed.add<nn::GELU<float>>();
  embed.add<nn::LayerNorm<float>>("patch_norm", 32);
  auto& mix = m.add_unit();
  mix.add<nn::Flatten<float>>();  // [N, 9, 32] -> [N, 288]
  mix.add<nn::Linear<float>>("mix", patches * 32, 64);
  mix.add<nn::GELU<float>>();
  auto& head = m.add_unit();
  head.add<nn::Linear<float>>("classifier", 64, classes);
  *loss = &head.add<nn::SoftmaxCrossEntropy<float>>(classes, "labels");
  return m;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  expect<ConfigError>(o.ranks > 0 && 64 % o.ranks == 0, "vision_model: --ranks ", o.ranks,
                      " must divide the global batch of 64");
  const Images train(2048, 1), test(512, 2);
  const Config config = Config::from_json_string(R"({
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": )" +
                                                 std::to_string(64 / o.ranks) + R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2}})");
  double accuracy = 0;
  parallel::LocalComm::run(o.ranks, [&](parallel::LocalComm& comm) {
    nn::SoftmaxCrossEntropy<float>* loss_layer = nullptr;
    Model model = make_model(&loss_layer);
    Engine<Model, ZeroStage<2>> engine(model, comm, config);
    data::ArrayLoader loader({64, comm.size(), comm.rank(), 1, /*shuffle=*/true, 3});
    loader.add("patches", train.pixels, train.shape()).add("labels", train.labels, Shape{2048});
    for (int step = 0; step < o.steps; ++step) {
      const data::ArrayBatch batch = loader.next();
      engine.forward(engine::MicroBatch::of(batch.inputs(), batch.rows, 1, batch.first_row));
      engine.backward();
      engine.step();
      if (comm.rank() == 0 && (step % 100 == 0 || step + 1 == o.steps)) {
        std::printf("step %4d  loss %.4f (rank 0's rows)\n", step,
                    static_cast<double>(engine.loss()));
      }
    }
    nn::Inputs held_out;
    held_out.set("patches", Tensor<const std::uint8_t>(test.pixels.data(), test.shape()));
    engine.evaluate(engine::MicroBatch::of(held_out, test.count));  // every rank: collectives
    if (comm.rank() != 0) return;
    const Tensor<const float> logits = loss_layer->logits();
    std::int64_t correct = 0;
    for (std::int64_t i = 0; i < test.count; ++i) {
      std::int64_t best = 0;
      for (std::int64_t c = 1; c < classes; ++c) {
        if (logits.at(i * classes + c) > logits.at(i * classes + best)) best = c;
      }
      if (best == test.labels[static_cast<std::size_t>(i)]) ++correct;
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(test.count);
  });
  std::printf("accuracy %.4f on %lld held-out images (%d ranks, ZeRO stage 2)\n", accuracy,
              static_cast<long long>(test.count), o.ranks);
  if (accuracy < o.min_accuracy) {
    std::fprintf(stderr, "vision_model: accuracy %.4f is below --min-accuracy %.4f\n", accuracy,
                 o.min_accuracy);
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "vision_model: %s\n", e.what());
  return 1;
}
