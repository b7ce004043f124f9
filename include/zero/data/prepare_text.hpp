#pragma once
// Turning a text file into training data: byte tokens, an end-of-text token before each
// document, a validation split taken from the end, and llm.c-format token files. This is what
// examples/data/prepare_text runs on data/corpus.txt.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/token_file.hpp>

namespace zero::data {

/// Training and validation tokens of one text.
struct PreparedText {
  std::vector<std::int32_t> train;  ///< eot, then the text's first part.
  std::vector<std::int32_t> val;    ///< eot, then the text's last part.
};

/// Byte-tokenizes text, splitting off about val_fraction of it (in [0, 1)) at a line start
/// near the end as validation data; each part starts with the end-of-text token.
inline PreparedText tokenize_text(std::string_view text, double val_fraction) {
  expect<ConfigError>(val_fraction >= 0.0 && val_fraction < 1.0, "tokenize_text: val_fraction ",
                      val_fraction, " is outside [0, 1)");
  std::size_t cut = text.size();
  if (val_fraction > 0.0) {
    cut = static_cast<std::size_t>(static_cast<double>(text.size()) * (1.0 - val_fraction));
    // Start validation at a line so that it does not begin mid-word.
    const std::size_t newline = text.find('\n', cut);
    cut = newline == std::string_view::npos ? cut : newline + 1;
  }
  const auto part = [](std::string_view piece) {
    std::vector<std::int32_t> ids{ByteTokenizer::eot};
    const auto bytes = ByteTokenizer::encode(piece);
    ids.insert(ids.end(), bytes.begin(), bytes.end());
    return ids;
  };
  PreparedText out;
  out.train = part(text.substr(0, cut));
  if (cut < text.size()) out.val = part(text.substr(cut));
  return out;
}

/// Reads text_path and writes <out_prefix>_train.bin and, when val_fraction > 0,
/// <out_prefix>_val.bin as llm.c token files; returns the tokens written.
inline PreparedText prepare_text_file(const std::filesystem::path& text_path,
                                      const std::filesystem::path& out_prefix,
                                      double val_fraction = 0.1) {
  std::ifstream in(text_path, std::ios::binary);
  expect<IoError>(static_cast<bool>(in), "cannot open text file '", text_path.string(), "'");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  expect<IoError>(!in.bad(), "reading text file '", text_path.string(), "' failed");
  PreparedText tokens = tokenize_text(text, val_fraction);
  const std::string prefix = out_prefix.string();
  write_token_file(prefix + "_train.bin", tokens.train);
  if (!tokens.val.empty()) write_token_file(prefix + "_val.bin", tokens.val);
  return tokens;
}

}  // namespace zero::data
