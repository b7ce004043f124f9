#pragma once
// EngineGroups: the communicators an engine works over, type-erased.
//   dp     the data-parallel group: ZeRO shards every unit over it and reduces gradients in it;
//   tp     the tensor-parallel group, when the model is split over one (tp > 1): the global
//          gradient norm and the Inf/NaN verdict sum over it too, each tensor-parallel part
//          counted once and parameters whole on every tp rank counted on tp rank 0 only;
//   pp     the pipeline-parallel group, when the model's units are split over stages (pp > 1):
//          the global gradient norm and the Inf/NaN verdict sum over it too (a unit counted by
//          the stage that owns it, never by a stage holding a replica of it);
//   state  every rank that holds a distinct part of the state (tp x dp x pp): checkpoints are
//          saved and loaded over it, so a save at one (tp, dp, pp, stage) loads at any other.
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
  std::optional<parallel::AnyComm> pp;     ///< the pipeline-parallel group (pp > 1 only)
  std::optional<parallel::AnyComm> state;  ///< tp x dp x pp (tp or pp > 1 only; else dp)

  /// Data parallelism only, over dp.
  template <parallel::Communicator C>
  explicit EngineGroups(C& data_parallel) : dp(data_parallel) {}

  /// The grid's data-parallel group and, with tp > 1, its tensor-parallel group, with pp > 1 its
  /// pipeline-parallel group, and then the group of tp x dp x pp (ProcessGroups must have built
  /// the tp-dp and tp-dp-pp masks, as standard_masks() does).
  template <parallel::Communicator C>
  explicit EngineGroups(parallel::ProcessGroups<C>& groups) : dp(groups.data_parallel()) {
    using parallel::Axis;
    const bool split_tp = groups.grid().size(Axis::tp) > 1;
    const bool split_pp = groups.grid().size(Axis::pp) > 1;
    if (split_tp) tp.emplace(groups.tp());
    if (split_pp) {
      pp.emplace(groups.pp());
      state.emplace(groups.get({Axis::tp, Axis::dp, Axis::pp}));
    } else if (split_tp) {
      state.emplace(groups.get({Axis::tp, Axis::dp}));
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
