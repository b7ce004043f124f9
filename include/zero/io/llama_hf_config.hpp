#pragma once
// nn::LlamaConfig from and to a Hugging Face config.json (LlamaForCausalLM's): the file that sits
// beside model.safetensors, so a model directory from the Hub gives both the shape
// (read_hf_config) and the weights (engine::load_llama_weights), and save_llama_weights plus
// write_hf_config give one Hugging Face loads back.
//
// Keys read: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (default: num_attention_heads), rope_theta (10000), rms_norm_eps (1e-6,
// Hugging Face's default), initializer_range (0.02), rope_scaling (null; rope_type "default",
// none; Llama 3.1's "llama3" with its factor, low_freq_factor, high_freq_factor and
// original_max_position_embeddings; or "linear", position interpolation, with its factor; older
// files name the key "type"). What nn::LayerLlama cannot be is refused with a ConfigError
// naming the file and the key: another model_type, hidden_act other than silu, attention or MLP
// biases, attention dropout, a head_dim other than hidden_size / num_attention_heads, another
// rope_type. tie_word_embeddings is reported (HfLlamaConfig::tied), not refused: LayerLlama's head
// is untied, and loading a tied file gives it a copy of the token table (io/llama_layout.hpp), so
// training unties the two. Every other key (token ids, max_position_embeddings, torch_dtype, ...)
// is ignored.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>
#include <zero/io/json_file.hpp>
#include <zero/nn/llama_config.hpp>

namespace zero::io::llama {

/// A config.json's model, and whether its file ties the LM head to the token table.
struct HfLlamaConfig {
  nn::LlamaConfig model;
  bool tied = false;  ///< tie_word_embeddings
};

/// The LlamaConfig of a parsed config.json; where names it in errors (see the file comment).
inline HfLlamaConfig hf_config_from_json(const nlohmann::json& j, const std::string& where) {
  expect<ConfigError>(j.is_object(), where, ": a Hugging Face config is a JSON object");
  const auto has = [&](const char* key) { return j.contains(key) && !j.at(key).is_null(); };
  const auto integer = [&](const char* key) -> std::int64_t {
    expect<ConfigError>(has(key), where, ": '", key, "' is missing");
    expect<ConfigError>(j.at(key).is_number_integer(), where, ": '", key, "' must be an integer");
    return j.at(key).get<std::int64_t>();
  };
  const auto number = [&](const nlohmann::json& obj, const char* key, double fallback) {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    expect<ConfigError>(obj.at(key).is_number(), where, ": '", key, "' must be a number");
    return obj.at(key).get<double>();
  };
  const auto flag = [&](const char* key) {
    if (!has(key)) return false;
    expect<ConfigError>(j.at(key).is_boolean(), where, ": '", key, "' must be true or false");
    return j.at(key).get<bool>();
  };
  const auto text = [&](const nlohmann::json& obj, const char* key) -> std::string {
    if (!obj.contains(key) || obj.at(key).is_null()) return {};
    expect<ConfigError>(obj.at(key).is_string(), where, ": '", key, "' must be a string");
    return obj.at(key).get<std::string>();
  };

  if (const std::string type = text(j, "model_type"); !type.empty()) {
    expect<ConfigError>(type == "llama", where, ": model_type '", type,
                        "' is not a Llama (nn::LayerLlama builds model_type 'llama')");
  }
  if (const std::string act = text(j, "hidden_act"); !act.empty()) {
    expect<ConfigError>(act == "silu", where, ": hidden_act '", act,
                        "': nn::LayerLlama's MLP is SwiGLU (silu)");
  }
  expect<ConfigError>(!flag("attention_bias"), where,
                      ": attention_bias is true; nn::LayerLlama's projections have no biases");
  expect<ConfigError>(!flag("mlp_bias"), where,
                      ": mlp_bias is true; nn::LayerLlama's projections have no biases");
  expect<ConfigError>(number(j, "attention_dropout", 0.0) == 0.0, where,
                      ": attention_dropout must be 0 (nn::LayerLlama has no dropout)");

  HfLlamaConfig out;
  nn::LlamaConfig& c = out.model;
  c.vocab_size = integer("vocab_size");
  c.channels = integer("hidden_size");
  c.intermediate_size = integer("intermediate_size");
  c.num_layers = integer("num_hidden_layers");
  c.num_heads = integer("num_attention_heads");
  c.num_kv_heads = has("num_key_value_heads") ? integer("num_key_value_heads") : c.num_heads;
  c.rope_theta = number(j, "rope_theta", 10000.0);
  c.rms_norm_eps = number(j, "rms_norm_eps", 1e-6);
  c.initializer_range = number(j, "initializer_range", 0.02);
  if (has("head_dim")) {
    const std::int64_t head_dim = integer("head_dim");
    expect<ConfigError>(c.num_heads > 0 && head_dim * c.num_heads == c.channels, where,
                        ": head_dim ", head_dim, " is not hidden_size / num_attention_heads (",
                        c.channels, " / ", c.num_heads,
                        "); nn::LayerLlama's heads split hidden_size");
  }
  if (has("rope_scaling")) {
    const nlohmann::json& s = j.at("rope_scaling");
    expect<ConfigError>(s.is_object(), where, ": rope_scaling must be an object or null");
    std::string type = text(s, "rope_type");
    if (type.empty()) type = text(s, "type");  // the key's older name
    expect<ConfigError>(type == "llama3" || type == "linear" || type == "default", where,
                        ": rope_scaling's rope_type '", type,
                        "' is not supported (Llama 3.1's 'llama3', 'linear' or 'default')");
    if (type == "linear") {
      c.rope_scaling.type = ops::cpu::RopeScaling::Type::linear;
      c.rope_scaling.factor = number(s, "factor", 1.0);
    } else if (type == "llama3") {
      c.rope_scaling.factor = number(s, "factor", 1.0);
      c.rope_scaling.low_freq_factor = number(s, "low_freq_factor", 1.0);
      c.rope_scaling.high_freq_factor = number(s, "high_freq_factor", 4.0);
      const double original = number(s, "original_max_position_embeddings", 8192.0);
      expect<ConfigError>(original >= 1.0 && std::floor(original) == original, where,
                          ": rope_scaling's original_max_position_embeddings ", original,
                          " must be a positive integer");
      c.rope_scaling.original_max_position_embeddings = static_cast<std::int64_t>(original);
    }
  }
  out.tied = flag("tie_word_embeddings");
  try {
    c.validate();
  } catch (const ConfigError& e) {
    raise<ConfigError>(where, ": ", e.what());
  }
  return out;
}

/// read_hf_config: the LlamaConfig of a config.json file, or of the config.json in a model's
/// directory (ConfigError naming the file).
inline HfLlamaConfig read_hf_config(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::path file =
      std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  return hf_config_from_json(read_json_file<ConfigError>(file, "Hugging Face config"),
                             file.string());
}

/// c as a LlamaForCausalLM config.json (tie_word_embeddings false: LayerLlama's head is its own).
inline nlohmann::json hf_config_json(const nn::LlamaConfig& c) {
  c.validate();
  nlohmann::json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.channels},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_size()},
      {"hidden_act", "silu"},
      {"rope_theta", c.rope_theta},
      {"rms_norm_eps", c.rms_norm_eps},
      {"initializer_range", c.initializer_range},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"tie_word_embeddings", false},
      {"rope_scaling", nullptr},
  };
  const ops::cpu::RopeScaling& scaling = c.rope_scaling;
  if (scaling.active()) {
    nlohmann::json& s = j["rope_scaling"];
    s = {{"rope_type", ops::cpu::RopeScaling::name_of(scaling.type)}, {"factor", scaling.factor}};
    if (scaling.type == ops::cpu::RopeScaling::Type::llama3) {
      s["low_freq_factor"] = scaling.low_freq_factor;
      s["high_freq_factor"] = scaling.high_freq_factor;
      s["original_max_position_embeddings"] = scaling.original_max_position_embeddings;
    }
  }
  return j;
}

/// Writes hf_config_json(c) to file (IoError when it cannot be written).
inline void write_hf_config(const nn::LlamaConfig& c, const std::filesystem::path& file) {
  const std::string text = hf_config_json(c).dump(2) + "\n";
  std::ofstream out(file);
  out << text;
  out.flush();
  expect<IoError>(out.good(), "cannot write Hugging Face config '", file.string(), "'");
}

}  // namespace zero::io::llama
