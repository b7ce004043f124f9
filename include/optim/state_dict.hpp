#pragma once
// A plain, named snapshot of optimizer, loss-scaler or schedule state: float buffers (optimizer
// states of a shard), integer counters (steps) and real numbers (loss scale). Checkpoint files
// come later; this is what they will serialise.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::optim {

/// Named buffers, counters and scalars of one stateful object.
struct StateDict {
  std::map<std::string, std::vector<float>> buffers;  ///< e.g. "exp_avg" -> shard values
  std::map<std::string, std::int64_t> counters;       ///< e.g. "step"
  std::map<std::string, double> scalars;              ///< e.g. "cur_scale"

  /// The counter called name; CheckpointError naming owner and key when it is missing.
  std::int64_t counter(const std::string& name, const char* owner) const {
    const auto it = counters.find(name);
    expect<CheckpointError>(it != counters.end(), owner, ": state has no counter '", name, "'");
    return it->second;
  }
  /// The scalar called name; CheckpointError naming owner and key when it is missing.
  double scalar(const std::string& name, const char* owner) const {
    const auto it = scalars.find(name);
    expect<CheckpointError>(it != scalars.end(), owner, ": state has no scalar '", name, "'");
    return it->second;
  }
  /// The buffer called name, which must hold size elements.
  const std::vector<float>& buffer(const std::string& name, std::size_t size,
                                   const char* owner) const {
    const auto it = buffers.find(name);
    expect<CheckpointError>(it != buffers.end(), owner, ": state has no buffer '", name, "'");
    expect<CheckpointError>(it->second.size() == size, owner, ": buffer '", name, "' holds ",
                            it->second.size(), " elements, expected ", size);
    return it->second;
  }
};

}  // namespace zero::optim
