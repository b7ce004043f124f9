// Fuzz target: the DeepSpeed JSON config (Config::from_json_string and every key reader).
#include <cstddef>
#include <cstdint>
#include <string>

#include <zero/config/config.hpp>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  zero::fuzz::expect_clean([&] { (void)zero::Config::from_json_string(text); });
  return 0;
}
