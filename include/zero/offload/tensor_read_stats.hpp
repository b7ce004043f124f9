#pragma once
// TensorReadStats: how the reads of single tensors from swap files went (NvmeSwapper's
// swap_in_tensor, which a stage-3 gather under Offload<NVMe> calls for a unit's master slice):
// how many found their bytes read ahead, how many found them left in a buffer by the last pass
// (handed over, read by no one), how many read them when asked, how many reads ahead were thrown
// away unused, and how long the callers waited for the bytes. The engine's NVMe store adds the
// gathers it served from the copy the step's pass kept (kept), which read nothing either.

#include <cstdint>

namespace zero::offload {

/// Counts and waiting time of swap_in_tensor since the swapper was made.
struct TensorReadStats {
  std::int64_t read_ahead = 0;   ///< served by a read started ahead (read_ahead)
  std::int64_t handed_over = 0;  ///< served from a pass's buffer (SwapPass::hand_over), no read
  std::int64_t on_demand = 0;    ///< read when asked (no read ahead for that tensor)
  /// served from a copy the optimizer step's pass kept for the gather after it (NvmeStates's
  /// keep_for_gather; the swapper never sets it), no read
  std::int64_t kept = 0;
  std::int64_t dropped = 0;  ///< reads ahead or hand-overs discarded unused (a pass or swap_out)
  double wait_s = 0;         ///< seconds swap_in_tensor waited for bytes from the file

  /// What happened after before, an earlier copy of the same counters.
  TensorReadStats since(const TensorReadStats& before) const {
    TensorReadStats d;
    d.read_ahead = read_ahead - before.read_ahead;
    d.handed_over = handed_over - before.handed_over;
    d.on_demand = on_demand - before.on_demand;
    d.kept = kept - before.kept;
    d.dropped = dropped - before.dropped;
    d.wait_s = wait_s - before.wait_s;
    return d;
  }
};

}  // namespace zero::offload
