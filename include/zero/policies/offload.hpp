#pragma once
// Offload<Where>: where the engine keeps the fp32 master and the optimizer states (and, at stage
// 3, parameter shards when the config asks for it): None (beside the compute), CPU (host memory
// while a GPU computes) or NVMe (files, swapped in by sub-group for the update).
//
// The same three words name a place at run time (OffloadDevice: the config's
// "offload_optimizer.device", the memory estimator's columns), so one vocabulary says where
// state lives, from the policy tag to the JSON key.

#include <type_traits>

namespace zero {

/// Tag that every Offload<Where> carries, so policy lookup can find it.
struct offload_policy {};

/// Offload target: nothing is moved.
struct None {};
/// Offload target: host memory (pinned where possible).
struct CPU {};
/// Offload target: files on a fast local disk, through io_uring and O_DIRECT.
struct NVMe {};

/// Policy tag selecting where optimizer states (and stage-3 parameter shards) live.
template <class Where>
struct Offload {
  static_assert(std::is_same_v<Where, None> || std::is_same_v<Where, CPU> ||
                    std::is_same_v<Where, NVMe>,
                "zero::Offload<Where>: Where must be zero::None, zero::CPU or zero::NVMe");
  using kind = offload_policy;
  using where = Where;  ///< None, CPU or NVMe
};

/// The run-time name of an offload place: none (beside the compute), cpu, nvme.
enum class OffloadDevice : unsigned char { none, cpu, nvme };

/// Name of an offload device as written in configs ("none", "cpu", "nvme").
constexpr const char* name_of(OffloadDevice d) {
  return d == OffloadDevice::none ? "none" : d == OffloadDevice::cpu ? "cpu" : "nvme";
}

/// The OffloadDevice a policy target names (None -> none, CPU -> cpu, NVMe -> nvme).
template <class Where>
inline constexpr OffloadDevice offload_device_of =
    std::is_same_v<Where, NVMe>  ? OffloadDevice::nvme
    : std::is_same_v<Where, CPU> ? OffloadDevice::cpu
                                 : OffloadDevice::none;

}  // namespace zero
