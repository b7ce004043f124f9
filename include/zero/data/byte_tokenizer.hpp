#pragma once
// ByteTokenizer: every byte of UTF-8 (or any) text is its own token 0..255, plus an end-of-text
// token 256 that separates documents. It needs no vocabulary file, round-trips any byte string
// exactly, and gives the examples a real language-modelling task with a 257-entry embedding.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::data {

/// Byte-level tokenizer with one end-of-text token.
struct ByteTokenizer {
  /// The end-of-text token, placed before each document.
  static constexpr std::int32_t eot = 256;
  /// Number of distinct tokens (bytes and end-of-text).
  static constexpr std::int32_t vocab_size = 257;
  /// How decode shows the end-of-text token (GPT-2's spelling).
  static constexpr std::string_view eot_text = "<|endoftext|>";

  /// The tokens of text: one per byte, never eot.
  static std::vector<std::int32_t> encode(std::string_view text) {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  /// The text of tokens, with eot shown as eot_text; throws Error naming the position of a
  /// token outside [0, 256].
  static std::string decode(std::span<const std::int32_t> ids) {
    std::string text;
    text.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == eot) {
        text += eot_text;
        continue;
      }
      expect<Error>(ids[i] >= 0 && ids[i] < eot, "ByteTokenizer::decode: token ", i, " = ", ids[i],
                    " is outside the vocabulary [0, ", vocab_size, ")");
      text += static_cast<char>(static_cast<unsigned char>(ids[i]));
    }
    return text;
  }

  /// text with every byte outside printable ASCII written as an escape (\n, \t, \\, \xNN),
  /// so a sample of a half-trained model shows what it produced without corrupting a terminal.
  static std::string escape(std::string_view text) {
    static constexpr char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(text.size());
    for (const char c : text) {
      const auto b = static_cast<unsigned char>(c);
      if (c == '\\') {
        out += "\\\\";
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\t') {
        out += "\\t";
      } else if (b < 0x20 || b > 0x7e) {
        out += "\\x";
        out += hex[b >> 4];
        out += hex[b & 15];
      } else {
        out += c;
      }
    }
    return out;
  }
};

}  // namespace zero::data
