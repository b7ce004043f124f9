// Fuzz target: a safetensors file, header and data (SafetensorsReader opens it, then every
// tensor is read whole and converted to f32 where the dtype allows).
#include <cstddef>
#include <cstdint>
#include <string>

#include <zero/io/safetensors_reader.hpp>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& path = zero::fuzz::write_input(data, size, ".safetensors");
  zero::fuzz::expect_clean(
      [&] {
        zero::io::SafetensorsReader reader(path);
        for (const auto& t : reader.tensors()) {
          if (t.bytes() > (1u << 20)) continue;  // the data section is bounded by the file anyway
          (void)reader.read_vector<float>(t.name, zero::io::DTypeRule::convert);
        }
      },
      path.string());
  return 0;
}
