#pragma once
// Turning a text file into training data: byte tokens, an end-of-text token before each
// document, a validation split taken from the end, and llm.c-format token files. This is what
// examples/data/prepare_text runs on data/corpus.txt.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
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
/// near the end as validation data (neither part empty when val_fraction > 0 and the text has
/// two bytes or more);
/// each part starts with the end-of-text token.
inline PreparedText tokenize_text(std::string_view text, double val_fraction) {
  expect<ConfigError>(val_fraction >= 0.0 && val_fraction < 1.0, "tokenize_text: val_fraction ",
                      val_fraction, " is outside [0, 1)");
  std::size_t cut = text.size();
  if (val_fraction > 0.0 && text.size() >= 2) {
    cut = std::clamp(
        static_cast<std::size_t>(static_cast<double>(text.size()) * (1.0 - val_fraction)),
        std::size_t{1}, text.size() - 1);
    // Start validation at a line so that it does not begin mid-word: the first line start at
    // or after the cut (the cut itself when a line starts there), or else the one before it,
    // whichever keeps validation within half to twice the share asked for; or else the cut
    // itself: neither part is ever empty.
    const auto wanted = static_cast<double>(text.size() - cut);
    const auto near_share = [&](std::size_t start) {
      const auto got = static_cast<double>(text.size() - start);
      return got >= 0.5 * wanted && got <= 2.0 * wanted;
    };
    const std::size_t next = text.find('\n', cut - 1);  // a line starts at next + 1 >= cut
    const std::size_t before = cut >= 2 ? text.rfind('\n', cut - 2) : std::string_view::npos;
    if (next != std::string_view::npos && next + 1 < text.size() && near_share(next + 1)) {
      cut = next + 1;
    } else if (before != std::string_view::npos && near_share(before + 1)) {
      cut = before + 1;
    }
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

/// Reads text_path and tokenizes it as tokenize_text does (nothing is written).
inline PreparedText tokenize_text_file(const std::filesystem::path& text_path,
                                       double val_fraction) {
  std::ifstream in(text_path, std::ios::binary);
  expect<IoError>(static_cast<bool>(in), "cannot open text file '", text_path.string(), "'");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  expect<IoError>(!in.bad(), "reading text file '", text_path.string(), "' failed");
  return tokenize_text(text, val_fraction);
}

/// Reads text_path and writes <out_prefix>_train.bin and, when val_fraction > 0,
/// <out_prefix>_val.bin as llm.c token files; returns the tokens written. An earlier run's
/// <out_prefix>_val.bin is removed first: it may overlap the new training file, and a write that
/// fails part-way must not leave the two side by side.
inline PreparedText prepare_text_file(const std::filesystem::path& text_path,
                                      const std::filesystem::path& out_prefix,
                                      double val_fraction = 0.1) {
  PreparedText tokens = tokenize_text_file(text_path, val_fraction);
  const std::string prefix = out_prefix.string();
  std::error_code ec;
  std::filesystem::remove(prefix + "_val.bin", ec);
  expect<IoError>(!ec, "cannot remove the earlier validation file '", prefix,
                  "_val.bin': ", ec.message());
  write_token_file(prefix + "_train.bin", tokens.train);
  if (!tokens.val.empty()) write_token_file(prefix + "_val.bin", tokens.val);
  return tokens;
}

}  // namespace zero::data
