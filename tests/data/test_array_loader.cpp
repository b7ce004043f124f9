// nn::Inputs (typed access with errors that name the tensor and both dtypes) and
// data::ArrayLoader: the global batch of a step is the same at any world size and micro-batch
// count, the ranks' micro-batches concatenated are that batch, and the position restores.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/data/array_loader.hpp>
#include <zero/nn/inputs.hpp>

using namespace zero;

namespace {

constexpr std::int64_t samples = 40;

// features [samples, 3] f32 (sample s holds s*10 + column), labels [samples] i32 = s.
data::ArrayLoader make_loader(data::ArrayLoaderConfig c) {
  std::vector<float> features;
  std::vector<std::int32_t> labels;
  for (std::int64_t s = 0; s < samples; ++s) {
    for (int f = 0; f < 3; ++f) features.push_back(static_cast<float>(s * 10 + f));
    labels.push_back(static_cast<std::int32_t>(s));
  }
  data::ArrayLoader loader(c);
  loader.add("features", features, Shape{samples, 3}).add("labels", labels, Shape{samples});
  return loader;
}

std::vector<std::int32_t> labels_of(const data::ArrayBatch& b) {
  const auto t = b.get<std::int32_t>("labels");
  return {t.begin(), t.end()};
}

}  // namespace

TEST_CASE("Inputs hands out typed views and names the tensor on a wrong dtype or name",
          "[unit][data]") {
  std::vector<float> x{1, 2, 3, 4, 5, 6};
  std::vector<std::uint8_t> mask{1, 0};
  nn::Inputs in;
  in.set("x", Tensor<const float>(x.data(), Shape{2, 3}))
      .set("mask", Tensor<const std::uint8_t>(mask.data(), Shape{2}));
  CHECK(in.size() == 2);
  const auto xv = in.get<float>("x");
  CHECK(xv.shape() == Shape{2, 3});
  CHECK(xv.data() == x.data());
  CHECK(in.get<std::uint8_t>("mask").at(1) == 0);
  CHECK_THROWS_WITH(in.get<double>("x"),
                    Catch::Contains("'x' holds f32") && Catch::Contains("f64 were asked for"));
  CHECK_THROWS_WITH(in.get<float>("labels"), Catch::Contains("'labels' is missing") &&
                                                 Catch::Contains("'x' (f32)") &&
                                                 Catch::Contains("'mask' (u8)"));
  CHECK_THROWS_AS(in.get<float>("labels"), nn::InputError);
  std::vector<double> converted(6);
  in.copy_as("x", Tensor<double>(converted.data(), Shape{6}));
  CHECK(converted[5] == 6.0);
  // set replaces an entry of the same name.
  std::vector<double> y{7, 8};
  in.set("x", Tensor<const double>(y.data(), Shape{2}));
  CHECK(in.size() == 2);
  CHECK(in.get<double>("x").at(1) == 8.0);
}

TEST_CASE("ArrayLoader: ranks' micro-batches concatenate to the same global batch at any world",
          "[unit][data]") {
  for (bool shuffle : {false, true}) {
    const data::ArrayLoader ref = make_loader({8, 1, 0, 1, shuffle, 7});
    for (int world : {1, 2, 4}) {
      for (int micro : {1, 2}) {
        INFO("shuffle " << shuffle << " world " << world << " micro " << micro);
        for (std::int64_t step : {0, 3, 5}) {  // 5 steps per epoch: step 5 starts epoch 1
          const auto want = labels_of(ref.global_batch(step));
          std::vector<std::int32_t> got;
          for (int r = 0; r < world; ++r) {
            const data::ArrayLoader l = make_loader({8, world, r, micro, shuffle, 7});
            for (int m = 0; m < micro; ++m) {
              const data::ArrayBatch b = l.micro_batch(step, m);
              CHECK(b.rows == 8 / world / micro);
              const auto f = b.get<float>("features");
              const auto lab = labels_of(b);
              CHECK(f.shape() == Shape{b.rows, 3});
              for (std::int64_t i = 0; i < b.rows; ++i) {  // rows stay aligned across arrays
                CHECK(f.at(i * 3 + 2) ==
                      static_cast<float>(lab[static_cast<std::size_t>(i)] * 10 + 2));
              }
              got.insert(got.end(), lab.begin(), lab.end());
            }
          }
          CHECK(got == want);
        }
      }
    }
  }
  // Without shuffling, step s holds samples [8s, 8s + 8).
  const auto first = labels_of(make_loader({8, 1, 0, 1, false, 0}).global_batch(1));
  CHECK(first == std::vector<std::int32_t>{8, 9, 10, 11, 12, 13, 14, 15});
  // Shuffled epochs are permutations that differ from the identity.
  const data::ArrayLoader shuffled = make_loader({8, 1, 0, 1, true, 7});
  std::vector<int> seen(samples, 0);
  for (std::int64_t s = 0; s < 5; ++s) {
    for (auto v : labels_of(shuffled.global_batch(s))) ++seen[static_cast<std::size_t>(v)];
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == samples);
  CHECK(labels_of(shuffled.global_batch(0)) !=
        labels_of(make_loader({8, 1, 0, 1, false, 7}).global_batch(0)));
}

TEST_CASE("ArrayLoader saves and restores its position and rejects bad settings", "[unit][data]") {
  data::ArrayLoader a = make_loader({8, 2, 1, 2, true, 3});
  for (int i = 0; i < 5; ++i) a.next();
  const data::ArrayLoaderState saved = a.state();
  CHECK(saved.step == 2);
  CHECK(saved.micro == 1);
  CHECK(data::ArrayLoaderState::from_json(saved.to_json()) == saved);
  data::ArrayLoader b = make_loader({8, 2, 1, 2, true, 3});
  b.restore(saved);
  CHECK(labels_of(b.next()) == labels_of(a.next()));
  // At a step boundary the state restores at another world size.
  data::ArrayLoader c = make_loader({8, 4, 0, 1, true, 3});
  c.restore(a.state());
  CHECK(c.state().step == 3);
  // Mid-step at another world size, or another seed: refused by name.
  a.next();
  CHECK_THROWS_WITH(c.restore(a.state()), Catch::Contains("world_size (mid-step)"));
  data::ArrayLoader d = make_loader({8, 2, 1, 2, true, 4});
  CHECK_THROWS_WITH(d.restore(saved), Catch::Contains("seed = 3"));
  CHECK_THROWS_AS(data::ArrayLoaderState::from_json(nlohmann::json{{"step", 1}}), data::DataError);
  // Other arrays with as many samples (another dtype, sample shape or name) are another
  // dataset: the state named only the sample count and restored onto them.
  CHECK(saved.arrays == "features:f32[3];labels:i32[]");
  data::ArrayLoader other({8, 2, 1, 2, true, 3});
  other.add("features", std::vector<float>(samples * 4), Shape{samples, 4})
      .add("labels", std::vector<std::int32_t>(samples), Shape{samples});
  CHECK_THROWS_WITH(other.restore(saved),
                    Catch::Contains("arrays = features:f32[3];labels:i32[]") &&
                        Catch::Contains("features:f32[4]"));
  // A state saved before the arrays were kept restores without the check.
  nlohmann::json older = saved.to_json();
  older.erase("arrays");
  CHECK_NOTHROW(other.restore(data::ArrayLoaderState::from_json(older)));

  CHECK_THROWS_WITH(make_loader({6, 4, 0, 1, false, 0}),
                    Catch::Contains("global_batch 6 is not divisible by world_size 4"));
  data::ArrayLoader e({8, 1, 0, 1, false, 0});
  e.add("x", std::vector<float>(20), Shape{10, 2});
  CHECK_THROWS_WITH(e.add("y", std::vector<float>(9), Shape{9}),
                    Catch::Contains("9 samples, but 'x' has 10"));
  CHECK_THROWS_WITH(e.add("x", std::vector<float>(10), Shape{10}),
                    Catch::Contains("already added"));
  data::ArrayLoader small({8, 1, 0, 1, false, 0});
  CHECK_THROWS_WITH(small.add("z", std::vector<float>(5), Shape{5}),
                    Catch::Contains("fewer than one global batch of 8"));
}
