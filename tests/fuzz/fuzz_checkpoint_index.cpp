// Fuzz target: a checkpoint's index.json (parse_index, which validates what readers rely on).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <zero/checkpoint/index.hpp>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string where = "checkpoint 'fuzz/step1/index.json'";
  zero::fuzz::expect_clean(
      [&] {
        auto index = zero::checkpoint::parse_index(text, where);
        // What readers do next with a valid index: walk every tensor's segments.
        std::int64_t elems = 0;
        for (const auto& t : index.tensors) {
          for (const auto& s : t.segments) elems += s.count;
        }
        (void)elems;
      },
      where);
  return 0;
}
