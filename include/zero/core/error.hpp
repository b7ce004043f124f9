#pragma once
// Error types. Every error zero raises derives from zero::Error and says what went wrong, where
// (key path, rank, group, file, tensor) and what was expected, so a user can act on it.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace zero {

/// Base of every exception zero throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration value or combination is invalid; the message names the key path.
class ConfigError : public Error {
 public:
  using Error::Error;
};
/// A collective failed, timed out or saw mismatched arguments; names op, group and ranks.
class CommError : public Error {
 public:
  using Error::Error;
};
/// A checkpoint is missing, truncated, corrupted or incompatible; names the file and tensor.
class CheckpointError : public Error {
 public:
  using Error::Error;
};
/// Tensor shapes, sizes or dtypes do not fit together.
class ShapeError : public Error {
 public:
  using Error::Error;
};
/// A file or device I/O operation failed.
class IoError : public Error {
 public:
  using Error::Error;
};
/// An allocation or a fixed-capacity pool ran out of memory.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};
/// A CUDA, cuBLAS or NCCL call failed; names the call and the place.
class CudaError : public Error {
 public:
  using Error::Error;
};

namespace detail {
/// Streams every argument into one string (std::format is not in g++ 12).
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return std::move(out).str();
}
}  // namespace detail

/// Throws ErrorType with the concatenation of parts as its message.
template <class ErrorType = Error, class... Parts>
[[noreturn]] void raise(const Parts&... parts) {
  throw ErrorType(detail::concat(parts...));
}

/// Throws ErrorType with the message built from parts when condition is false; the parts are
/// only formatted on failure.
template <class ErrorType = Error, class... Parts>
inline void expect(bool condition, const Parts&... parts) {
  if (!condition) [[unlikely]]
    raise<ErrorType>(parts...);
}

}  // namespace zero
