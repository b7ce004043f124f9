#pragma once
// SwapLayout: where each tensor of a sub-group lives in its swap file and in a swap buffer (the
// two are identical, so a whole sub-group moves as one transfer). Each tensor starts at a
// multiple of the direct-I/O alignment and the total is padded to it, so tensors of any size
// (not multiples of a block) go through O_DIRECT.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::offload {

/// One flat fp32 tensor of a sub-group, as the engine names it ("master", "exp_avg", ...).
struct SwapTensor {
  std::string name;
  std::int64_t numel = 0;
};

/// The tensors of one sub-group with their byte offsets.
struct SwapLayout {
  std::vector<SwapTensor> tensors;
  std::vector<std::size_t> offsets;  ///< byte offset of each tensor, a multiple of alignment
  std::size_t bytes = 0;             ///< total, padded to alignment

  /// Lays out tensors (fp32) with every start a multiple of alignment.
  static SwapLayout plan(std::vector<SwapTensor> tensors, std::size_t alignment) {
    SwapLayout l;
    for (const auto& t : tensors) {
      expect<ShapeError>(t.numel >= 0, "NVMe swap: tensor '", t.name, "' has ", t.numel,
                         " elements");
      l.offsets.push_back(l.bytes);
      const auto b = static_cast<std::size_t>(t.numel) * sizeof(float);
      l.bytes += (b + alignment - 1) / alignment * alignment;
    }
    l.tensors = std::move(tensors);
    return l;
  }
  /// Elements in all tensors.
  std::int64_t numel() const {
    std::int64_t n = 0;
    for (const auto& t : tensors) n += t.numel;
    return n;
  }
};

}  // namespace zero::offload
