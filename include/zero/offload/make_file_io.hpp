#pragma once
// make_file_io: the best FileIo engine this build and kernel offer. io_uring when zero::uring is
// linked (ZERO_WITH_URING) and the kernel allows it; otherwise pread/pwrite threads, whose
// name() says why the fallback was taken.

#include <memory>
#include <string>

#include <zero/offload/file_io.hpp>
#include <zero/offload/posix_file_io.hpp>
#if defined(ZERO_WITH_URING)
#include <zero/offload/uring_file_io.hpp>
#endif

namespace zero::offload {

/// Which engine to build.
enum class IoBackend : unsigned char { automatic, uring, posix };

/// Builds the engine; uring when asked but unavailable throws IoError, automatic falls back.
inline std::unique_ptr<FileIo> make_file_io(const IoOptions& options,
                                            IoBackend backend = IoBackend::automatic) {
  if (backend == IoBackend::posix) return std::make_unique<PosixFileIo>(options);
#if defined(ZERO_WITH_URING)
  try {
    return std::make_unique<UringFileIo>(options);
  } catch (const IoError& e) {
    if (backend == IoBackend::uring) throw;
    return std::make_unique<PosixFileIo>(options, e.what());
  }
#else
  expect<IoError>(backend != IoBackend::uring,
                  "NVMe offload: io_uring was asked for but zero was built without liburing "
                  "(install liburing-dev and link zero::uring)");
  return std::make_unique<PosixFileIo>(options, "built without liburing");
#endif
}

/// True when this build can use io_uring (zero::uring linked).
constexpr bool uring_available() {
#if defined(ZERO_WITH_URING)
  return true;
#else
  return false;
#endif
}

}  // namespace zero::offload
