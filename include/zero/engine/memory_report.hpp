#pragma once
// MemoryReport: the bytes of model state one rank of an Engine holds right now, by category, as
// measured from its buffers (not computed from a formula: the estimator does that, and tests
// compare the two).

#include <cstddef>

namespace zero::engine {

/// Bytes of model state held by this rank, by category.
struct MemoryReport {
  /// fp32 (f64) master slice(s) this rank updates (with Offload<CPU> in bf16/f16, also their
  /// copy in the compute type that the host optimizer writes for the gathers)
  std::size_t master_bytes = 0;
  std::size_t optimizer_bytes = 0;         ///< optimizer states of that slice
  std::size_t grad_accumulator_bytes = 0;  ///< fp32 gradient shards or whole accumulators
  std::size_t whole_param_bytes = 0;       ///< gathered (whole) unit parameters in compute type
  std::size_t whole_grad_bytes = 0;        ///< whole unit gradients in compute type
  /// ZeRO++ hpZ (stage 3): the secondary shards the forward's gathers kept for the backward's,
  /// in compute type (0 between steps)
  std::size_t secondary_param_bytes = 0;
  std::size_t scratch_bytes = 0;  ///< reduction/gather buffers in flight or kept for reuse
  /// ZeRO++ LoCo (qgZ's error feedback): the errors kept for each unit's packings, block-wise
  /// int8, from a unit's first reduction on
  std::size_t kept_error_bytes = 0;
  std::size_t offloaded_bytes = 0;  ///< state kept off this memory (files for NVMe)
  /// Of the bytes above, those in host memory beside a compute device (Offload<CPU>: the master
  /// slice and its compute copy, its optimizer states and the gradient shard); 0 without offload.
  std::size_t host_bytes = 0;

  /// Everything this rank holds in memory (offloaded bytes excluded).
  std::size_t total() const {
    return master_bytes + optimizer_bytes + grad_accumulator_bytes + whole_param_bytes +
           whole_grad_bytes + secondary_param_bytes + scratch_bytes + kept_error_bytes;
  }
  /// What this rank holds in the compute device's memory: total() less host_bytes.
  std::size_t device_bytes() const { return total() - host_bytes; }
  /// The sharded part: master, optimizer states and gradient shards (16 psi / N with Adam).
  std::size_t sharded_state_bytes() const {
    return master_bytes + optimizer_bytes + grad_accumulator_bytes;
  }
};

}  // namespace zero::engine
