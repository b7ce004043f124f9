#pragma once
// Where a fused optimizer pass runs. run_fused (cpu/fused_driver.hpp) runs it on the host's
// threads. When StepOptions::executor is set, run_fused hands the same pass to that executor
// instead: the same rules, ranges, FusedIo and state pointers. A device backend's executor
// (optim/cuda/fused_executor.cuh) launches one kernel per group on its stream, over the device
// memory that the shard and the states live in.
//
// The optimizers (adam.hpp, sgd.hpp, ...) build their per-group rules on the host as before and
// never branch on where the pass runs, so every optimizer whose passes all go through run_fused
// runs on a device. LAMB does not: its trust-ratio norms are summed on the host between two
// passes, so it refuses an executor.

#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>

#include <optim/fused_io.hpp>
#include <optim/param_groups.hpp>
#include <optim/update_rules.hpp>

namespace zero::optim {

/// Every update rule a fused pass runs (update_rules.hpp), so that one virtual call carries any
/// of them.
using AnyRule =
    std::variant<AdamRule, SgdRule<false>, SgdRule<true>, RmspropRule<false, false>,
                 RmspropRule<false, true>, RmspropRule<true, false>, RmspropRule<true, true>,
                 AdagradRule, LionRule, LambMomentsRule, LambApplyRule>;

/// Runs fused passes somewhere other than the host's threads (see the file comment).
class FusedExecutor {
 public:
  virtual ~FusedExecutor() = default;
  /// Where the passes run, for messages ("cuda").
  virtual const char* where() const = 0;
  /// rules[k] over ranges[k] of the shard io describes, with the state buffers states (each
  /// io.numel floats, in the rule's order); step selects the stochastic-rounding stream. Every
  /// pointer is memory this executor's kernels reach. The pass may still be running when this
  /// returns: the executor orders it before whatever its device runs next.
  virtual void run(std::span<const AnyRule> rules, std::span<const Range> ranges, const FusedIo& io,
                   std::span<float* const> states, std::uint32_t step) const = 0;
};

}  // namespace zero::optim
