#pragma once
// TensorReadStats: how the reads of single tensors from swap files went (NvmeSwapper's
// swap_in_tensor, which a stage-3 gather under Offload<NVMe> calls for a unit's master slice):
// how many found their bytes read ahead, how many found them left in a buffer by the last pass
// (handed over, read by no one), how many read them when asked, how many reads ahead were thrown
// away unused, and how long the callers waited for the bytes.

#include <cstdint>

namespace zero::offload {

/// Counts and waiting time of swap_in_tensor since the swapper was made.
struct TensorReadStats {
  std::int64_t read_ahead = 0;   ///< served by a read started ahead (read_ahead)
  std::int64_t handed_over = 0;  ///< served from a pass's buffer (SwapPass::hand_over), no read
  std::int64_t on_demand = 0;    ///< read when asked (no read ahead for that tensor)
  std::int64_t dropped = 0;  ///< reads ahead or hand-overs discarded unused (a pass or swap_out)
  double wait_s = 0;         ///< seconds swap_in_tensor waited for bytes from the file
};

}  // namespace zero::offload
