#pragma once
// EngineGroups: the communicators an engine works over, type-erased.
//   dp     the data-parallel group: ZeRO shards every dense unit over it and averages gradients
//          in it (with expert parallelism: the ep x dp ranks, DeepSpeed's data-parallel group;
//          x cp under Ulysses sequence parallelism);
//   expert_dp  with expert parallelism (ep > 1), the expert data-parallel group: the ranks that
//          hold the same experts (the grid's dp axis, x cp under Ulysses). ZeRO shards
//          expert units (the model's unit_is_expert) over it and averages their gradients in
//          it; the engine scales every unit's averaged gradient by |its group| / |dp| (1/ep for
//          an expert unit: an expert has summed the tokens of the whole ep group already, so its
//          gradient is divided by the whole data-parallel size, as DeepSpeed and Megatron do);
//   tp     the tensor-parallel group, when the model is split over one (tp > 1): the global
//          gradient norm and the Inf/NaN verdict sum over it too, each tensor-parallel part
//          counted once and parameters whole on every tp rank counted on tp rank 0 only;
//   pp     the pipeline-parallel group, when the model's units are split over stages (pp > 1):
//          the global gradient norm and the Inf/NaN verdict sum over it too (a unit counted by
//          the stage that owns it, never by a stage holding a replica of it);
//   shards, replicas  with hybrid sharding (shard_within: EngineOptions::shard_size, DeepSpeed's
//          MiCS, FSDP's HYBRID_SHARD), dp (and expert_dp) split into shard groups of
//          shard_size consecutive ranks, which ZeRO shards a unit over and gathers it from, and
//          replica groups, the ranks at the same place of every shard group, which hold the same
//          shard and average its reduced gradient;
//   secondary  with ZeRO++'s hierarchical partitioning (secondary_within: EngineOptions::
//          hpz_size), dp (and expert_dp) split into groups of hpz_size consecutive ranks (one
//          node's), which stage 3's backward gathers a unit from, out of the secondary shards
//          the forward's gather over the whole group left on each rank, and the groups across
//          them (the ranks at the same place of every secondary group), over which ZeRO++'s
//          quantized gradients take their second hop;
//   state  every rank that holds a distinct part of the state (tp x dp x pp, and x cp under
//          context parallelism; ep x dp, x cp and x pp when there are; every rank with both tp
//          and ep): checkpoints are saved and loaded over it, so a save at one (tp, cp, dp, pp,
//          ep, stage) loads at any other.
// Built from a communicator (data parallelism only) or from ProcessGroups.

#include <optional>
#include <string>
#include <utility>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/topology.hpp>
#include <zero/core/error.hpp>

namespace zero::engine {

/// The groups of an engine (see the file comment).
struct EngineGroups {
  parallel::AnyComm dp;                        ///< ZeRO's data-parallel group (dense units)
  std::optional<parallel::AnyComm> expert_dp;  ///< expert units' group (ep > 1 only)
  std::optional<parallel::AnyComm> tp;         ///< the tensor-parallel group (tp > 1 only)
  std::optional<parallel::AnyComm> pp;         ///< the pipeline-parallel group (pp > 1 only)
  std::optional<parallel::AnyComm> state;      ///< the state group (tp or pp > 1 only; else dp)
  /// Hybrid sharding: dp's shard and replica groups (shard_within; empty without it, or when the
  /// shard size is dp's).
  std::optional<parallel::AnyComm> dp_shard, dp_replicas;
  /// The same split of expert_dp.
  std::optional<parallel::AnyComm> expert_shard, expert_replicas;
  /// ZeRO++ hpZ: dp's and expert_dp's secondary groups (secondary_within; empty without it).
  std::optional<parallel::AnyComm> dp_secondary, expert_secondary;
  /// The groups across them: the ranks at the same place of every secondary group.
  std::optional<parallel::AnyComm> dp_across_secondary, expert_across_secondary;
  /// The grid's expert-parallel size (the engine checks the model's experts against it).
  int ep = 1;
  /// The grid's context (Ulysses sequence) parallel size (the engine checks the model's
  /// sequence-parallel group against it).
  int cp = 1;
  /// Ranks that read different samples: |dp|, except with Ulysses sequence parallelism, whose
  /// sp ranks share their samples (|dp| / sp). DeepSpeed's batch arithmetic divides by it.
  int sample_ranks = 0;

  /// Data parallelism only, over dp.
  template <parallel::Communicator C>
  explicit EngineGroups(C& data_parallel) : dp(data_parallel), sample_ranks(dp.size()) {}

  /// The grid's data-parallel group and, with tp > 1, its tensor-parallel group, with pp > 1 its
  /// pipeline-parallel group, and then the group of tp x dp x pp (ProcessGroups must have built
  /// the tp-dp, tp-dp-pp, tp-dp-cp, tp-dp-cp-pp, ep-dp-pp, cp-ep-dp, cp-ep-dp-pp and
  /// tp-cp-ep-dp-pp masks, as standard_masks() does). With cp > 1 the data-parallel group is
  /// dp x cp, and the state group has the cp axis too. With ep > 1 the data-parallel group is ep x
  /// dp (x cp), the expert data-parallel group dp (x cp) and the state group ep x dp (x cp, x pp),
  /// with tp > 1 too every axis (the tp-cp-ep-dp-pp mask: each expert is split over tp, Megatron's
  /// expert tensor parallelism).
  template <parallel::Communicator C>
  explicit EngineGroups(parallel::ProcessGroups<C>& groups)
      : dp(dense_group(groups)), sample_ranks(dp.size() / groups.grid().size(parallel::Axis::cp)) {
    using parallel::Axis;
    const bool split_tp = groups.grid().size(Axis::tp) > 1;
    const bool split_pp = groups.grid().size(Axis::pp) > 1;
    ep = groups.grid().size(Axis::ep);
    cp = groups.grid().size(Axis::cp);
    if (ep > 1) expert_dp.emplace(groups.data_parallel());  // dp, or dp x cp
    if (split_tp) tp.emplace(groups.tp());
    if (split_pp) pp.emplace(groups.pp());
    // Every rank holding a distinct part of the state: ZeRO shards over dp x cp when cp > 1, so
    // the cp axis is in it then.
    if (split_tp && ep > 1) {  // every rank holds its own part: tp x ep x dp (x cp, x pp)
      state.emplace(groups.get({Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp}));
    } else if (split_pp && ep > 1) {
      state.emplace(cp > 1 ? groups.get({Axis::cp, Axis::ep, Axis::dp, Axis::pp})
                           : groups.get({Axis::ep, Axis::dp, Axis::pp}));
    } else if (split_pp) {
      state.emplace(cp > 1 ? groups.get({Axis::tp, Axis::dp, Axis::cp, Axis::pp})
                           : groups.get({Axis::tp, Axis::dp, Axis::pp}));
    } else if (split_tp) {
      state.emplace(cp > 1 ? groups.get({Axis::tp, Axis::dp, Axis::cp})
                           : groups.get({Axis::tp, Axis::dp}));
    }
  }

  /// Ranks of the tensor-parallel group (1 without one).
  int tp_size() const { return tp ? tp->size() : 1; }
  /// This rank in the tensor-parallel group.
  int tp_rank() const { return tp ? tp->rank() : 0; }
  /// The group checkpoints run over.
  parallel::AnyComm& state_group() { return state ? *state : dp; }
  /// The group ZeRO shards a unit over: expert_dp for an expert unit when there is one, else dp,
  /// or its shard group under hybrid sharding.
  parallel::AnyComm& shard_group(bool expert) {
    if (expert && expert_dp) return expert_shard ? *expert_shard : *expert_dp;
    return dp_shard ? *dp_shard : dp;
  }
  /// The ranks holding the same shards as this one under hybrid sharding, which average the
  /// reduced gradient shards (null without it).
  parallel::AnyComm* replica_group(bool expert) {
    auto& r = expert && expert_dp ? expert_replicas : dp_replicas;
    return r ? &*r : nullptr;
  }

  /// Hybrid sharding: splits dp (and expert_dp) into shard groups of shard_size consecutive
  /// ranks and replica groups across them (collective over dp; every rank passes the same size).
  /// A group of shard_size ranks stays whole. ConfigError unless shard_size divides each group.
  void shard_within(int shard_size) {
    const char* option = "shard_size (zero_optimization.mics_shard_size)";
    split_consecutive(dp, "dp", shard_size, option, "shard", dp_shard, &dp_replicas, "replicas");
    if (expert_dp) {
      split_consecutive(*expert_dp, "expert-dp", shard_size, option, "shard", expert_shard,
                        &expert_replicas, "replicas");
    }
  }

  /// The group stage 3's backward gathers a unit from under hpZ (null without it).
  parallel::AnyComm* secondary_group(bool expert) {
    auto& g = expert && expert_dp ? expert_secondary : dp_secondary;
    return g ? &*g : nullptr;
  }
  /// The group across the secondary groups, the second hop of qgZ's exchange (null without hpZ).
  parallel::AnyComm* across_secondary_group(bool expert) {
    auto& g = expert && expert_dp ? expert_across_secondary : dp_across_secondary;
    return g ? &*g : nullptr;
  }

  /// ZeRO++ hpZ: splits dp (and expert_dp) into secondary groups of size consecutive ranks and,
  /// with across (qgZ's second hop), the groups across them (collective over dp; every rank
  /// passes the same arguments). A group of size ranks needs no secondary group, and neither
  /// does an expert_dp of fewer (its units gather over it as without hpZ). ConfigError unless
  /// size divides dp, and expert_dp when it is larger.
  void secondary_within(int size, bool across = false) {
    const char* option = "hpz_size (zero_optimization.zero_hpz_partition_size)";
    split_consecutive(dp, "dp", size, option, "secondary", dp_secondary,
                      across ? &dp_across_secondary : nullptr, "across");
    if (expert_dp && expert_dp->size() > size) {
      split_consecutive(*expert_dp, "expert-dp", size, option, "secondary", expert_secondary,
                        across ? &expert_across_secondary : nullptr, "across");
    }
  }

  /// ConfigError unless every group runs its ops on dp's device stream (none, for host
  /// communicators): a device backend orders that one stream after its compute, so a group on
  /// another would read gradients the backward is still writing. Splits of one NcclComm or
  /// CudaLocalComm share its stream.
  void expect_one_device_stream() const {
    const void* stream = dp.device_stream();
    const auto check = [&](const std::optional<parallel::AnyComm>& group, const char* role) {
      expect<ConfigError>(!group || group->device_stream() == stream, "EngineGroups: the ", role,
                          " group runs its ops on another device stream than the data-parallel "
                          "group's, which the engine orders after its compute; make every group "
                          "a split of one communicator (its splits share its stream)");
    };
    check(expert_dp, "expert data-parallel");
    check(tp, "tensor-parallel");
    check(pp, "pipeline-parallel");
    check(state, "state (checkpoint)");
    check(dp_shard, "shard");
    check(dp_replicas, "replica");
    check(expert_shard, "expert shard");
    check(expert_replicas, "expert replica");
    check(dp_secondary, "secondary (hpZ)");
    check(expert_secondary, "expert secondary (hpZ)");
    check(dp_across_secondary, "across the secondary (hpZ)");
    check(expert_across_secondary, "expert across the secondary (hpZ)");
  }

 private:
  // Splits whole (role: "dp" or "expert-dp") into groups of size consecutive ranks, named
  // <role>-<suffix>, and, when across is given, into the groups across them (the ranks at the
  // same place of every group, <role>-<across_suffix>); a group of size ranks stays whole.
  // ConfigError naming option unless size divides whole.
  static void split_consecutive(parallel::AnyComm& whole, const char* role, int size,
                                const char* option, const char* suffix,
                                std::optional<parallel::AnyComm>& groups,
                                std::optional<parallel::AnyComm>* across,
                                const char* across_suffix) {
    expect<ConfigError>(size > 0 && whole.size() % size == 0, "EngineGroups: ", option, " ", size,
                        " must divide the ", whole.size(), " ranks of the ", role,
                        " group ZeRO shards over");
    if (size == whole.size()) return;
    const int r = whole.rank();
    groups.emplace(whole.split(r / size, r % size, std::string(role) + "-" + suffix));
    if (across != nullptr) {
      across->emplace(whole.split(r % size, r / size, std::string(role) + "-" + across_suffix));
    }
  }

  // The data-parallel group of the grid: ep x dp (x cp) with expert parallelism, else dp (x cp).
  template <parallel::Communicator C>
  static C& dense_group(parallel::ProcessGroups<C>& groups) {
    using parallel::Axis;
    const parallel::Grid& g = groups.grid();
    if (g.size(Axis::ep) == 1) return groups.data_parallel();
    return g.size(Axis::cp) > 1 ? groups.get({Axis::cp, Axis::ep, Axis::dp})
                                : groups.get({Axis::ep, Axis::dp});
  }
};

}  // namespace zero::engine
