#pragma once
// Helpers of the offload tests: a scratch directory that accepts O_DIRECT, the engines to run
// every test with, random data, and a tmpfs mount that skips (with a message) where mount fails.

#include <sys/mount.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <zero/offload/direct_io.hpp>
#include <zero/offload/make_file_io.hpp>
#include "../support/temp_dir.hpp"

namespace zero::testing {

/// The system temp directory when it takes O_DIRECT, else the build directory.
inline std::filesystem::path direct_io_base() {
  const auto tmp = std::filesystem::temp_directory_path();
  if (offload::probe_direct_io(tmp).supported) return tmp;
  return ZERO_OFFLOAD_TEST_SCRATCH;
}

/// The engines this build offers.
inline std::vector<offload::IoBackend> backends() {
  std::vector<offload::IoBackend> b{offload::IoBackend::posix};
  if (offload::uring_available()) b.push_back(offload::IoBackend::uring);
  return b;
}

/// A readable name of an engine.
inline const char* name_of(offload::IoBackend b) {
  return b == offload::IoBackend::posix   ? "posix"
         : b == offload::IoBackend::uring ? "uring"
                                          : "auto";
}

/// n floats from a seeded generator.
inline std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

/// A small tmpfs mounted on a fresh directory, unmounted on destruction; mounted() is false
/// (with why()) where the process may not mount.
class TmpfsMount {
 public:
  explicit TmpfsMount(const std::string& size) : dir_("tmpfs") {
    const std::string opts = "size=" + size;
    if (::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, opts.c_str()) == 0)
      mounted_ = true;
    else
      why_ = std::strerror(errno);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  ~TmpfsMount() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::filesystem::path& path() const { return dir_.path(); }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string why_;
};

}  // namespace zero::testing
