// Fuzz target: a token file in each format (llm.c header, raw uint16, raw int32); every token
// is read back through the checked accessors.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <zero/data/token_file.hpp>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& path = zero::fuzz::write_input(data, size, ".bin");
  for (auto format : {zero::data::TokenFormat::llmc, zero::data::TokenFormat::raw_u16,
                      zero::data::TokenFormat::raw_i32}) {
    zero::fuzz::expect_clean(
        [&] {
          const auto tokens = zero::data::TokenFile::open(path, format);
          std::vector<std::int32_t> all(static_cast<std::size_t>(tokens.size()));
          tokens.copy(0, all);
          for (std::int64_t i = 0; i < tokens.size(); ++i) (void)tokens[i];
        },
        path.string());
  }
  return 0;
}
