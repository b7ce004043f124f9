#pragma once
// EngineGroups: the communicators an engine works over, type-erased.
//   dp     the data-parallel group: ZeRO shards every unit over it and reduces gradients in it;
//   tp     the tensor-parallel group, when the model is split over one (tp > 1): the global
//          gradient norm and the Inf/NaN verdict sum over it too, each tensor-parallel part
//          counted once and parameters whole on every tp rank counted on tp rank 0 only;
//   state  every rank that holds a distinct part of the state (tp x dp): checkpoints are saved
//          and loaded over it, so a save at one (tp, dp, stage) loads at any other.
// Built from a communicator (data parallelism only) or from ProcessGroups.

#include <optional>
#include <utility>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/topology.hpp>

namespace zero::engine {

/// The groups of an engine (see the file comment).
struct EngineGroups {
  parallel::AnyComm dp;                    ///< ZeRO's data-parallel group
  std::optional<parallel::AnyComm> tp;     ///< the tensor-parallel group (tp > 1 only)
  std::optional<parallel::AnyComm> state;  ///< tp x dp (tp > 1 only; else dp)

  /// Data parallelism only, over dp.
  template <parallel::Communicator C>
  explicit EngineGroups(C& data_parallel) : dp(data_parallel) {}

  /// The grid's data-parallel group and, with tp > 1, its tensor-parallel and tp x dp groups
  /// (ProcessGroups must have built the tp-dp mask, as standard_masks() does).
  template <parallel::Communicator C>
  explicit EngineGroups(parallel::ProcessGroups<C>& groups) : dp(groups.data_parallel()) {
    if (groups.grid().size(parallel::Axis::tp) > 1) {
      tp.emplace(groups.tp());
      state.emplace(groups.get({parallel::Axis::tp, parallel::Axis::dp}));
    }
  }

  /// Ranks of the tensor-parallel group (1 without one).
  int tp_size() const { return tp ? tp->size() : 1; }
  /// This rank in the tensor-parallel group.
  int tp_rank() const { return tp ? tp->rank() : 0; }
  /// The group checkpoints run over.
  parallel::AnyComm& state_group() { return state ? *state : dp; }
};

}  // namespace zero::engine
