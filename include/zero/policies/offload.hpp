#pragma once
// Offload<Where>: where the engine keeps the fp32 master and the optimizer states (and, at stage
// 3, parameter shards when the config asks for it): None (beside the compute), CPU (host memory
// while a GPU computes) or NVMe (files, swapped in by sub-group for the update).

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
  using kind = offload_policy;
  using where = Where;  ///< None, CPU or NVMe
};

}  // namespace zero
