// GPT-2 Hugging Face layout: which weights are Conv1D, the transposition both ways, and range
// imports of transposed weights that equal the slice of the whole transposed tensor.
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/io/gpt2_layout.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::io;
using zero::testing::TempDir;

TEST_CASE("GPT-2 Conv1D weights are exactly the four projection weights", "[unit][gpt2]") {
  CHECK(gpt2::is_conv1d_weight("transformer.h.0.attn.c_attn.weight"));
  CHECK(gpt2::is_conv1d_weight("transformer.h.11.attn.c_proj.weight"));
  CHECK(gpt2::is_conv1d_weight("h.3.mlp.c_fc.weight"));
  CHECK(gpt2::is_conv1d_weight("transformer.h.3.mlp.c_proj.weight"));
  CHECK_FALSE(gpt2::is_conv1d_weight("transformer.h.0.attn.c_attn.bias"));
  CHECK_FALSE(gpt2::is_conv1d_weight("transformer.wte.weight"));
  CHECK_FALSE(gpt2::is_conv1d_weight("transformer.wpe.weight"));
  CHECK_FALSE(gpt2::is_conv1d_weight("transformer.h.0.ln_1.weight"));
  CHECK_FALSE(gpt2::is_conv1d_weight("lm_head.weight"));

  CHECK(gpt2::zero_name_of("h.0.attn.c_attn.weight") == "transformer.h.0.attn.c_attn.weight");
  CHECK(gpt2::zero_name_of("transformer.ln_f.bias") == "transformer.ln_f.bias");
  CHECK_FALSE(gpt2::zero_name_of("h.0.attn.bias").has_value());   // causal-mask buffer
  CHECK_FALSE(gpt2::zero_name_of("lm_head.weight").has_value());  // tied to wte
  CHECK(gpt2::file_extents("transformer.h.0.mlp.c_fc.weight", Shape{16, 4}) ==
        std::vector<std::int64_t>{4, 16});
  CHECK(gpt2::file_extents("transformer.wte.weight", Shape{10, 4}) ==
        std::vector<std::int64_t>{10, 4});
}

TEST_CASE("Conv1D and Linear layouts transpose into each other", "[unit][gpt2]") {
  std::vector<float> conv(2 * 3), linear(3 * 2), back(2 * 3);
  for (int i = 0; i < 6; ++i) conv[static_cast<std::size_t>(i)] = static_cast<float>(i);
  // conv [in=2, out=3] = [[0 1 2], [3 4 5]] -> linear [out=3, in=2] = [[0 3], [1 4], [2 5]]
  gpt2::conv1d_to_linear<float>(Tensor<float>(conv.data(), Shape{2, 3}),
                                Tensor<float>(linear.data(), Shape{3, 2}));
  CHECK(linear == std::vector<float>{0, 3, 1, 4, 2, 5});
  gpt2::linear_to_conv1d<float>(Tensor<float>(linear.data(), Shape{3, 2}),
                                Tensor<float>(back.data(), Shape{2, 3}));
  CHECK(back == conv);
  CHECK_THROWS_AS(gpt2::transpose<float>(Tensor<float>(conv.data(), Shape{2, 3}),
                                         Tensor<float>(linear.data(), Shape{2, 3})),
                  ShapeError);
}

TEST_CASE("GPT-2 export then import gives back zero's layout, in any shard split", "[unit][gpt2]") {
  TempDir dir("gpt2");
  const std::int64_t C = 4;
  const std::string fc = "transformer.h.0.mlp.c_fc.weight";  // zero [4C, C], file [C, 4C]
  const std::string ln = "transformer.h.0.ln_1.weight";
  std::vector<float> fc_zero(static_cast<std::size_t>(4 * C * C)), ln_zero(C);
  for (std::size_t i = 0; i < fc_zero.size(); ++i) fc_zero[i] = static_cast<float>(i) * 0.5f;
  for (std::size_t i = 0; i < ln_zero.size(); ++i) ln_zero[i] = 1.0f + static_cast<float>(i);
  const auto path = dir / "gpt2.safetensors";
  {
    SafetensorsWriter writer(path, {gpt2::export_decl(fc, DType::bf16, Shape{4 * C, C}),
                                    gpt2::export_decl(ln, DType::f32, Shape{C})});
    gpt2::export_tensor(writer, fc, Tensor<const float>(fc_zero.data(), Shape{4 * C, C}),
                        DTypeRule::convert);
    gpt2::export_tensor(writer, ln, Tensor<const float>(ln_zero.data(), Shape{C}));
    writer.commit();
  }
  SafetensorsReader reader(path);
  CHECK(reader.info(fc).shape == std::vector<std::int64_t>{C, 4 * C});
  // The file holds the Conv1D layout: element (i, o) of [C, 4C] is zero's (o, i).
  const auto stored = reader.read_vector<bf16>(fc);
  CHECK(static_cast<float>(stored[1]) == fc_zero[static_cast<std::size_t>(1 * C + 0)]);

  for (int world : {1, 3, 5}) {
    std::vector<float> gathered(fc_zero.size());
    const std::int64_t n = 4 * C * C, per = (n + world - 1) / world;
    for (int rank = 0; rank < world; ++rank) {
      const std::int64_t first = rank * per,
                         count = std::max<std::int64_t>(0, std::min(per, n - first));
      gpt2::import_range(reader, fc, Shape{4 * C, C}, first,
                         Tensor<float>(gathered.data() + first, Shape{count}), DTypeRule::convert);
    }
    CHECK(gathered == fc_zero);  // 0.5 * i is exact in bf16 for i < 512
  }
  std::vector<float> ln_back(C);
  gpt2::import_range(reader, ln, Shape{C}, 0, Tensor<float>(ln_back.data(), Shape{C}));
  CHECK(ln_back == ln_zero);
  std::vector<float> wrong(C);
  CHECK_THROWS_WITH(
      gpt2::import_range(reader, fc, Shape{C, 4 * C}, 0, Tensor<float>(wrong.data(), Shape{C})),
      Catch::Contains("gpt2.safetensors") && Catch::Contains(fc) &&
          Catch::Contains("needs it stored as [16, 4]"));
  CHECK_THROWS_WITH(gpt2::stored_name(reader, "transformer.wte.weight"),
                    Catch::Contains("no GPT-2 tensor 'transformer.wte.weight'"));
}

TEST_CASE("GPT-2 names resolve with or without the transformer. prefix", "[unit][gpt2]") {
  TempDir dir("gpt2-names");
  const auto path = dir / "bare.safetensors";
  std::vector<float> wte(6, 2.0f);
  {
    SafetensorsWriter writer(path, {TensorDecl("wte.weight", DType::f32, Shape{3, 2})});
    writer.write("wte.weight", Tensor<const float>(wte.data(), Shape{3, 2}));
    writer.commit();
  }
  SafetensorsReader reader(path);
  CHECK(gpt2::stored_name(reader, "transformer.wte.weight") == "wte.weight");
  std::vector<float> out(2);
  gpt2::import_range(reader, "transformer.wte.weight", Shape{3, 2}, 4,
                     Tensor<float>(out.data(), Shape{2}));
  CHECK(out == std::vector<float>{2.0f, 2.0f});
}
