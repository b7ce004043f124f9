#pragma once
// Shared by the fuzz targets: the input as a scratch file, and the rule every reader must
// keep on malformed input (a zero::Error whose message names the file; anything else, an
// escaping foreign exception, a crash or an ASan/UBSan report, is a bug).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <zero/core/error.hpp>

namespace zero::fuzz {

/// A scratch file holding the current input; one per process, rewritten for every input. In
/// /dev/shm when there is one: a file written per input on a disk is most of a run's time.
inline const std::filesystem::path& scratch_path(std::string_view suffix) {
  static const std::filesystem::path path =
      (std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                 : std::filesystem::temp_directory_path()) /
      ("zero_fuzz_" + std::to_string(::getpid()) + std::string(suffix));
  return path;
}

/// Writes the input to the scratch file and returns its path.
inline const std::filesystem::path& write_input(const std::uint8_t* data, std::size_t size,
                                                std::string_view suffix) {
  const auto& path = scratch_path(suffix);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

/// Runs fn; a zero::Error is the expected answer to a malformed input, but its message must
/// name `must_name` (the file) when given. Anything else aborts, which libFuzzer reports.
template <class Fn>
void expect_clean(Fn&& fn, std::string_view must_name = {}) {
  try {
    fn();
  } catch (const zero::Error& e) {
    const std::string_view what = e.what();
    if (!must_name.empty() && what.find(must_name) == std::string_view::npos) {
      std::fprintf(stderr, "error does not name '%.*s': %s\n", static_cast<int>(must_name.size()),
                   must_name.data(), e.what());
      std::abort();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "a foreign exception escaped: %s\n", e.what());
    std::abort();
  }
}

}  // namespace zero::fuzz
