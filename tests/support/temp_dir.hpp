#pragma once
// A fresh directory under the system temp directory, removed with everything in it when the
// test ends, so tests that write files neither collide (ctest -j) nor leave litter.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace zero::testing {

/// A unique temporary directory that is deleted on destruction.
class TempDir {
 public:
  /// Creates <base>/zero-<tag>-<pid>-<n> (base: the system temp directory), taking the first n
  /// that does not exist yet.
  explicit TempDir(std::string_view tag,
                   const std::filesystem::path& base = std::filesystem::temp_directory_path()) {
    for (int n = 0;; ++n) {
      path_ = base / ("zero-" + std::string(tag) + "-" + std::to_string(::getpid()) + "-" +
                      std::to_string(n));
      if (std::filesystem::create_directory(path_)) break;
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  /// The directory.
  const std::filesystem::path& path() const { return path_; }
  /// A path inside the directory.
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// Writes bytes to path as they are (for hand-made malformed files).
inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The whole content of path.
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace zero::testing
