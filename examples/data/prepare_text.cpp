// prepare_text: turns a text file into llm.c-format token files with zero's byte tokenizer.
//   ./prepare_text [text=data/corpus.txt] [out_prefix=corpus] [val_fraction=0.1]
// writes <out_prefix>_train.bin and <out_prefix>_val.bin and prints one JSON line per file.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>

#include "../cli_number.hpp"

int main(int argc, char** argv) {
  const std::string text = argc > 1 ? argv[1] : ZERO_DEFAULT_CORPUS;
  const std::string prefix = argc > 2 ? argv[2] : "corpus";
  if (argc > 4) {
    std::fprintf(stderr, "usage: prepare_text [text] [out_prefix] [val_fraction in [0, 1)]\n");
    return 2;
  }
  try {
    const double val_fraction =
        argc > 3 ? zero::examples::parse_real("val_fraction", argv[3], 0.0, 1.0) : 0.1;
    zero::expect<zero::ConfigError>(val_fraction < 1.0,
                                    "val_fraction must be below 1 (all of "
                                    "the text would be validation), got ",
                                    val_fraction);
    const auto tokens = zero::data::prepare_text_file(text, prefix, val_fraction);
    std::printf("{\"file\": \"%s_train.bin\", \"tokens\": %zu}\n", prefix.c_str(),
                tokens.train.size());
    if (!tokens.val.empty()) {
      std::printf("{\"file\": \"%s_val.bin\", \"tokens\": %zu}\n", prefix.c_str(),
                  tokens.val.size());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prepare_text: %s\n", e.what());
    return 1;
  }
  return 0;
}
