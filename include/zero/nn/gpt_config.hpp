#pragma once
// GPT-2 shapes: the four published sizes and small ones for tests.

#include <cstdint>
#include <string>
#include <string_view>

#include <zero/core/error.hpp>

namespace zero::nn {

/// The shape and regularisation of a GPT-2 style model.
struct GPTConfig {
  std::int64_t vocab_size = 50257;  ///< V: the tokens, and the classes the loss runs over
  /// Rows of the token embedding (the LM head's logits columns) when the table is padded past
  /// the vocabulary (Megatron pads it to a multiple of the tensor-parallel size, llm.c to 128);
  /// 0: vocab_size. The padding rows are never a token nor in the softmax: the loss masks their
  /// logits and their gradient is zero.
  std::int64_t padded_vocab_size = 0;
  std::int64_t max_seq_len = 1024;      ///< positions in wpe
  std::int64_t num_layers = 12;         ///< L
  std::int64_t num_heads = 12;          ///< NH
  std::int64_t channels = 768;          ///< C
  double dropout = 0.0;                 ///< residual and embedding dropout (off by default)
  double attn_dropout = 0.0;            ///< attention-probability dropout, GPT-2's attn_pdrop (off)
  bool checkpoint_activations = false;  ///< recompute each block's forward before its backward
  /// Most bytes of logits the LM head holds at once when training (nn::LinearCrossEntropy):
  /// a batch with more is done in row chunks, its gradients computed chunk by chunk in the
  /// training forward and held for the backward; 0: no bound.
  std::int64_t logits_chunk_bytes = std::int64_t{256} << 20;

  /// Throws ConfigError naming the field when the shape is inconsistent.
  void validate() const {
    expect<ConfigError>(
        vocab_size > 0 && max_seq_len > 0 && num_layers > 0 && num_heads > 0 && channels > 0,
        "GPTConfig: every size must be positive (vocab_size ", vocab_size, ", max_seq_len ",
        max_seq_len, ", num_layers ", num_layers, ", num_heads ", num_heads, ", channels ",
        channels, ")");
    expect<ConfigError>(padded_vocab_size == 0 || padded_vocab_size >= vocab_size,
                        "GPTConfig: padded_vocab_size (", padded_vocab_size,
                        ") must be 0 (unpadded) or at least vocab_size (", vocab_size, ")");
    expect<ConfigError>(channels % num_heads == 0, "GPTConfig: channels (", channels,
                        ") must be a multiple of num_heads (", num_heads, ")");
    expect<ConfigError>(dropout >= 0.0 && dropout < 1.0, "GPTConfig: dropout ", dropout,
                        " must be in [0, 1)");
    expect<ConfigError>(attn_dropout >= 0.0 && attn_dropout < 1.0, "GPTConfig: attn_dropout ",
                        attn_dropout, " must be in [0, 1)");
    expect<ConfigError>(logits_chunk_bytes >= 0, "GPTConfig: logits_chunk_bytes ",
                        logits_chunk_bytes, " must be >= 0");
  }

  /// Rows of the token embedding: padded_vocab_size when set, else vocab_size.
  std::int64_t vocab_rows() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }

  /// Parameter count: wte (its padding rows included), wpe, L blocks of 12C^2 + 13C, and ln_f
  /// (the LM head is tied).
  std::int64_t num_parameters() const {
    const std::int64_t C = channels;
    return vocab_rows() * C + max_seq_len * C + num_layers * (12 * C * C + 13 * C) + 2 * C;
  }

  /// A published GPT-2 size by name: "gpt2" (124M), "gpt2-medium" (350M), "gpt2-large" (774M),
  /// "gpt2-xl" (1.5B); or "tiny" / "small-test" for tests. Throws ConfigError otherwise.
  static GPTConfig preset(std::string_view name) {
    GPTConfig c;
    if (name == "gpt2" || name == "124M") return c;
    if (name == "gpt2-medium" || name == "350M") return c.with(24, 16, 1024);
    if (name == "gpt2-large" || name == "774M") return c.with(36, 20, 1280);
    if (name == "gpt2-xl" || name == "1.5B") return c.with(48, 25, 1600);
    if (name == "tiny") {
      c = c.with(2, 2, 16);
      c.vocab_size = 64;
      c.max_seq_len = 16;
      return c;
    }
    if (name == "small-test") {
      c = c.with(4, 4, 128);
      c.vocab_size = 512;
      c.max_seq_len = 64;
      return c;
    }
    raise<ConfigError>("unknown GPT preset '", std::string(name),
                       "': expected gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny or small-test");
  }

 private:
  GPTConfig with(std::int64_t layers, std::int64_t heads, std::int64_t ch) const {
    GPTConfig c = *this;
    c.num_layers = layers;
    c.num_heads = heads;
    c.channels = ch;
    return c;
  }
};

}  // namespace zero::nn
