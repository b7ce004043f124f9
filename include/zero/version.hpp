#pragma once
// zero's version: the one place it is written; CMake reads these lines.

#define ZERO_VERSION_MAJOR 0
#define ZERO_VERSION_MINOR 1
#define ZERO_VERSION_PATCH 0

namespace zero {
/// The library version as "major.minor.patch".
inline constexpr const char* version_string = "0.1.0";
}  // namespace zero
