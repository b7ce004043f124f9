// Hugging Face Llama configs (io/llama_hf_config.hpp): Llama 2's and Llama 3.2's config.json
// give their LlamaConfig (defaults for keys left out, Llama 3.1's rope scaling, tied embeddings
// reported), what LayerLlama cannot be is refused naming the key, and a written config reads back
// as the same model. Llama 3.1's frequency scaling and linear position interpolation
// (ops::cpu::RopeScaling) against Hugging Face's formulas evaluated independently (Python,
// float64).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>
#include <zero/io/llama_hf_config.hpp>
#include <zero/ops/cpu/rotary.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;

namespace {

// Llama 3.2 1B's config.json as the Hub has it.
constexpr const char* llama32_1b = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "use_cache": true, "vocab_size": 128256})";

// Llama 2 7B's, with the keys Hugging Face defaults left out (num_key_value_heads, rope_theta).
constexpr const char* llama2_7b = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "vocab_size": 32000})";

io::llama::HfLlamaConfig parse(const nlohmann::json& j) {
  return io::llama::hf_config_from_json(j, "config.json");
}

// A rotary pair's expected cos and sin at one position, from Hugging Face's formula in Python.
struct Pair {
  int i;
  double cos, sin;
};

// Checks the pairs of a rotary table row (c, s) against want, within 1e-12.
void check_pairs(const std::vector<double>& c, const std::vector<double>& s,
                 const std::vector<Pair>& want) {
  for (const Pair& p : want) {
    INFO("pair " << p.i);
    CHECK(std::abs(c[static_cast<std::size_t>(p.i)] - p.cos) <= 1e-12);
    CHECK(std::abs(s[static_cast<std::size_t>(p.i)] - p.sin) <= 1e-12);
  }
}

}  // namespace

TEST_CASE("a Hugging Face config.json gives Llama's shape", "[unit][io][llama]") {
  const io::llama::HfLlamaConfig small = parse(nlohmann::json::parse(llama32_1b));
  const nn::LlamaConfig& c = small.model;
  CHECK(c.vocab_size == 128256);
  CHECK(c.channels == 2048);
  CHECK(c.intermediate_size == 8192);
  CHECK(c.num_layers == 16);
  CHECK(c.num_heads == 32);
  CHECK(c.num_kv_heads == 8);
  CHECK(c.head_size() == 64);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.rope_scaling.active());
  CHECK(c.rope_scaling.factor == 32.0);
  CHECK(c.rope_scaling.low_freq_factor == 1.0);
  CHECK(c.rope_scaling.high_freq_factor == 4.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(small.tied);
  // Llama 3.2 1B's published count (1,235,814,400 with the head tied) plus the untied head.
  CHECK(c.num_parameters() == 1235814400 + c.vocab_size * c.channels);
  const nn::LlamaConfig preset = nn::LlamaConfig::preset("llama3.2-1b");
  CHECK(preset.num_parameters() == c.num_parameters());
  CHECK(preset.rope_scaling.factor == c.rope_scaling.factor);

  const io::llama::HfLlamaConfig seven = parse(nlohmann::json::parse(llama2_7b));
  CHECK(seven.model.num_kv_heads == 32);  // num_attention_heads when left out
  CHECK(seven.model.rope_theta == 10000.0);
  CHECK(!seven.model.rope_scaling.active());
  CHECK(!seven.tied);
  CHECK(seven.model.num_parameters() == nn::LlamaConfig::preset("llama2-7b").num_parameters());
}

TEST_CASE("a config LayerLlama cannot be is refused, naming the key", "[unit][io][llama]") {
  const auto refused = [](const char* key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(llama32_1b);
    if (value.is_discarded()) {
      j.erase(key);
    } else {
      j[key] = value;
    }
    try {
      (void)parse(j);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const nlohmann::json erase = nlohmann::json(nlohmann::json::value_t::discarded);
  CHECK_THAT(refused("model_type", "mistral"), Catch::Contains("model_type 'mistral'"));
  CHECK_THAT(refused("hidden_act", "gelu"), Catch::Contains("hidden_act 'gelu'"));
  CHECK_THAT(refused("attention_bias", true), Catch::Contains("attention_bias"));
  CHECK_THAT(refused("mlp_bias", true), Catch::Contains("mlp_bias"));
  CHECK_THAT(refused("attention_dropout", 0.1), Catch::Contains("attention_dropout"));
  CHECK_THAT(refused("head_dim", 128), Catch::Contains("head_dim 128"));
  CHECK_THAT(refused("vocab_size", erase), Catch::Contains("'vocab_size' is missing"));
  CHECK_THAT(refused("hidden_size", "2048"), Catch::Contains("'hidden_size' must be an integer"));
  CHECK_THAT(refused("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}),
             Catch::Contains("rope_type 'yarn'"));
  CHECK_THAT(refused("rope_scaling", {{"rope_type", "linear"}, {"factor", 0.5}}),
             Catch::Contains("factor 0.5 must be >= 1"));
  CHECK_THAT(refused("num_key_value_heads", 5),
             Catch::Contains("config.json") && Catch::Contains("num_kv_heads"));
  CHECK(refused("rope_scaling", nullptr) == "accepted");
  CHECK(refused("torch_dtype", "float32") == "accepted");  // keys LayerLlama ignores

  const testing::TempDir dir("llama_hf_config");
  const auto bad = dir.path() / "config.json";
  std::ofstream(bad) << "{ not json";
  CHECK_THROWS_WITH(io::llama::read_hf_config(bad),
                    Catch::Contains(bad.string()) && Catch::Contains("invalid JSON"));
  CHECK_THROWS_WITH(io::llama::read_hf_config(dir.path() / "absent.json"),
                    Catch::Contains("cannot open"));
}

TEST_CASE("linear rope scaling and rope_type default read as Hugging Face's", "[unit][io][llama]") {
  nlohmann::json j = nlohmann::json::parse(llama32_1b);
  // Position interpolation as long-context Llama 2 fine-tunes write it (the older key name).
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 8.0}};
  const nn::LlamaConfig linear = parse(j).model;
  CHECK(linear.rope_scaling.type == ops::cpu::RopeScaling::Type::linear);
  CHECK(linear.rope_scaling.factor == 8.0);
  j["rope_scaling"] = {{"rope_type", "default"}};
  CHECK(!parse(j).model.rope_scaling.active());

  // Every pair turns 8 times slower. Values at position 1000 (theta 10000, head size 128) from
  // Hugging Face's _compute_linear_scaling_rope_parameters transcribed in Python (float64).
  std::vector<double> c(64), s(64);
  ops::cpu::rotary_table(c.data(), s.data(), 1000, 1, 128, 10000.0, linear.rope_scaling);
  check_pairs(c, s,
              {{0, 0.7877145121442345, -0.6160404591886565},
               {20, 0.7343544105816086, 0.6787662334407467},
               {63, 0.999895820447059, 0.01443427353567455}});
  // The same table as position 125 without scaling, where Llama 3.1's rule would keep the fast
  // pairs as they are.
  std::vector<double> c0(64), s0(64);
  ops::cpu::rotary_table(c0.data(), s0.data(), 125, 1, 128, 10000.0);
  for (int i = 0; i < 64; ++i) CHECK(std::abs(c0[i] - c[i]) <= 1e-12);

  // Written back as it was read.
  const testing::TempDir dir("llama_hf_config_linear");
  const auto file = dir.path() / "config.json";
  io::llama::write_hf_config(linear, file);
  std::ifstream in(file);
  const nlohmann::json written = nlohmann::json::parse(in);
  CHECK(written.at("rope_scaling") == nlohmann::json{{"rope_type", "linear"}, {"factor", 8.0}});
  const nn::LlamaConfig back = io::llama::read_hf_config(file).model;
  CHECK(back.rope_scaling.type == ops::cpu::RopeScaling::Type::linear);
  CHECK(back.rope_scaling.factor == 8.0);
}

TEST_CASE("a written Llama config.json reads back as the same model", "[unit][io][llama]") {
  const testing::TempDir dir("llama_hf_config_round");
  for (const char* text : {llama32_1b, llama2_7b}) {
    const nn::LlamaConfig c = parse(nlohmann::json::parse(text)).model;
    const auto file = dir.path() / "config.json";
    io::llama::write_hf_config(c, file);
    const io::llama::HfLlamaConfig back = io::llama::read_hf_config(file);
    CHECK(back.model.vocab_size == c.vocab_size);
    CHECK(back.model.channels == c.channels);
    CHECK(back.model.intermediate_size == c.intermediate_size);
    CHECK(back.model.num_layers == c.num_layers);
    CHECK(back.model.num_heads == c.num_heads);
    CHECK(back.model.num_kv_heads == c.num_kv_heads);
    CHECK(back.model.rope_theta == c.rope_theta);
    CHECK(back.model.rms_norm_eps == c.rms_norm_eps);
    CHECK(back.model.rope_scaling.factor == c.rope_scaling.factor);
    CHECK(back.model.rope_scaling.original_max_position_embeddings ==
          c.rope_scaling.original_max_position_embeddings);
    CHECK(!back.tied);  // LayerLlama's head is its own
    // A model's directory reads as its config.json.
    CHECK(io::llama::read_hf_config(dir.path()).model.num_layers == c.num_layers);
  }
}

TEST_CASE("Llama 3.1's rope scaling gives Hugging Face's frequencies", "[unit][io][llama]") {
  // Llama 3.1 8B: theta 500000, head size 128, factor 8, low 1, high 4, original 8192. Pairs
  // 0-28 keep their frequency, 29-34 blend, 35-63 turn 8 times slower. Values at position 1000
  // from Hugging Face's _compute_llama3_parameters transcribed in Python (float64).
  const std::vector<Pair> want = {
      {0, 0.5623790762907029, 0.8268795405320025},
      {20, -0.6581203423130288, -0.752912753932208},
      {28, -0.9975612472618343, -0.06979654691611657},
      {30, 0.1975938422192489, 0.9802839759564749},
      {33, 0.9515083638577134, 0.30762287546412614},
      {35, 0.9954374140316272, 0.09541674248278899},
      {40, 0.9994124633089483, 0.03427430791044675},
      {63, 0.9999999529084668, 0.0003068925940741034},
  };
  ops::cpu::RopeScaling scaling;
  scaling.factor = 8.0;
  std::vector<double> c(64), s(64);
  ops::cpu::rotary_table(c.data(), s.data(), 1000, 1, 128, 500000.0, scaling);
  check_pairs(c, s, want);
  // Without scaling the slow pairs differ (a negative control), the fast ones do not.
  std::vector<double> c0(64), s0(64);
  ops::cpu::rotary_table(c0.data(), s0.data(), 1000, 1, 128, 500000.0);
  CHECK(c0[20] == c[20]);
  CHECK(std::abs(c0[40] - c[40]) > 1e-3);
  scaling.high_freq_factor = 0.5;  // below low_freq_factor
  CHECK_THROWS_AS(ops::cpu::rotary_table(c.data(), s.data(), 0, 1, 128, 500000.0, scaling),
                  ConfigError);
}
