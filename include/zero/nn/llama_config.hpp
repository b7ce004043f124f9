#pragma once
// Llama shapes (Touvron et al., "Llama 2", 2023; Meta's Llama 3, 2024): the published sizes and a
// small one for tests. Grouped-query attention when num_kv_heads < num_heads.

#include <cstdint>
#include <string>
#include <string_view>

#include <zero/core/error.hpp>
#include <zero/ops/cpu/rotary.hpp>

namespace zero::nn {

/// The shape of a Llama-family decoder (Hugging Face's LlamaConfig, under its names).
struct LlamaConfig {
  std::int64_t vocab_size = 32000;         ///< V
  std::int64_t num_layers = 32;            ///< L (num_hidden_layers)
  std::int64_t num_heads = 32;             ///< query heads (num_attention_heads)
  std::int64_t num_kv_heads = 32;          ///< key/value heads (num_key_value_heads)
  std::int64_t channels = 4096;            ///< C (hidden_size)
  std::int64_t intermediate_size = 11008;  ///< F, the SwiGLU MLP's hidden units
  double rope_theta = 10000.0;             ///< RoPE's base (Llama 3: 500000)
  ops::cpu::RopeScaling rope_scaling;      ///< Llama 3.1's or linear scaling (none by default)
  double rms_norm_eps = 1e-5;              ///< RMSNorm's epsilon
  double initializer_range = 0.02;         ///< stddev of every projection and embedding
  bool checkpoint_activations = false;     ///< recompute each block's forward before its backward
  /// Most bytes of logits the LM head holds at once when training (nn::LinearCrossEntropy).
  std::int64_t logits_chunk_bytes = std::int64_t{256} << 20;

  /// Channels per head.
  std::int64_t head_size() const { return channels / num_heads; }
  /// Query heads per key/value head.
  std::int64_t group() const { return num_heads / num_kv_heads; }

  /// Throws ConfigError naming the field when the shape is inconsistent.
  void validate() const {
    expect<ConfigError>(vocab_size > 0 && num_layers > 0 && num_heads > 0 && num_kv_heads > 0 &&
                            channels > 0 && intermediate_size > 0,
                        "LlamaConfig: every size must be positive (vocab_size ", vocab_size,
                        ", num_layers ", num_layers, ", num_heads ", num_heads, ", num_kv_heads ",
                        num_kv_heads, ", channels ", channels, ", intermediate_size ",
                        intermediate_size, ")");
    expect<ConfigError>(channels % num_heads == 0, "LlamaConfig: channels (", channels,
                        ") must be a multiple of num_heads (", num_heads, ")");
    expect<ConfigError>(num_heads % num_kv_heads == 0, "LlamaConfig: num_heads (", num_heads,
                        ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
    expect<ConfigError>(head_size() % 2 == 0, "LlamaConfig: the head size channels / num_heads (",
                        head_size(), ") must be even for the rotary embedding");
    expect<ConfigError>(rope_theta > 1.0, "LlamaConfig: rope_theta ", rope_theta,
                        " must be greater than 1");
    rope_scaling.validate();
    expect<ConfigError>(rms_norm_eps > 0.0, "LlamaConfig: rms_norm_eps ", rms_norm_eps,
                        " must be positive");
    expect<ConfigError>(initializer_range > 0.0, "LlamaConfig: initializer_range ",
                        initializer_range, " must be positive");
    expect<ConfigError>(logits_chunk_bytes >= 0, "LlamaConfig: logits_chunk_bytes ",
                        logits_chunk_bytes, " must be >= 0");
  }

  /// Parameter count: the token table, L blocks (the qkv and output projections, the SwiGLU
  /// MLP's three, two norms), the final norm and the untied LM head.
  std::int64_t num_parameters() const {
    const std::int64_t C = channels, F = intermediate_size, hs = head_size();
    const std::int64_t qkv = (num_heads + 2 * num_kv_heads) * hs * C, out = num_heads * hs * C;
    return 2 * vocab_size * C + num_layers * (qkv + out + 3 * C * F + 2 * C) + C;
  }

  /// "tiny" (tests: V 64, L 2, 4 heads over 2 key/value heads of 8, F 48), "llama2-7b",
  /// "llama2-13b", "llama3-8b", "llama3.1-8b" (3's shape, its rope scaling), "llama3.2-1b" (its
  /// head untied here); ConfigError for another name.
  static LlamaConfig preset(std::string_view name) {
    LlamaConfig c;
    if (name == "tiny") {
      c.vocab_size = 64;
      c.num_layers = 2;
      c.num_heads = 4;
      c.num_kv_heads = 2;
      c.channels = 32;
      c.intermediate_size = 48;
    } else if (name == "llama2-7b") {
      // the defaults
    } else if (name == "llama2-13b") {
      c.num_layers = 40;
      c.num_heads = c.num_kv_heads = 40;
      c.channels = 5120;
      c.intermediate_size = 13824;
    } else if (name == "llama3-8b" || name == "llama3.1-8b") {
      c.vocab_size = 128256;
      c.num_kv_heads = 8;
      c.intermediate_size = 14336;
      c.rope_theta = 500000.0;
      if (name == "llama3.1-8b") c.rope_scaling.factor = 8.0;
    } else if (name == "llama3.2-1b") {
      c.vocab_size = 128256;
      c.num_layers = 16;
      c.num_heads = 32;
      c.num_kv_heads = 8;
      c.channels = 2048;
      c.intermediate_size = 8192;
      c.rope_theta = 500000.0;
      c.rope_scaling.factor = 32.0;
    } else {
      raise<ConfigError>("LlamaConfig: unknown preset '", std::string(name),
                         "' (tiny, llama2-7b, llama2-13b, llama3-8b, llama3.1-8b, llama3.2-1b)");
    }
    return c;
  }
};

}  // namespace zero::nn
