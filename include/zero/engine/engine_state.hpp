#pragma once
// EngineState: the narrow, named view through which checkpoints, weight import/export and other
// tools reach an engine's state, instead of its internals. It lists what a rank holds (the
// shards of each unit's master, the optimizer states beside them, the training counters) and
// the few transitions such tools need (state replaced from outside, state inconsistent).
//
//   auto state = engine.state();
//   state.for_each_unit(StateAccess::read, [&](int u, std::span<float> master,
//                                              optim::AnyOptimizer* optimizer) { ... });
//
// Passes go through the engine's state store, so offloaded slices (Offload<NVMe>) are swapped
// in one unit at a time and, for update/overwrite passes, written back out. On a device without
// offload (the optimizer's states in device memory) each unit's master slice and states are
// staged through host copies for the call the same way: copied down first (unless the pass
// overwrites them), copied back up after (unless it only reads).

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <optim/any_optimizer.hpp>
#include <parallel/comm/any_comm.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/partition.hpp>
#include <zero/engine/state_store.hpp>
#include <zero/engine/training_state.hpp>
#include <zero/nn/param.hpp>

namespace zero::engine {

/// What a caller does with the shards a rank holds.
enum class ShardUse : unsigned char {
  save,  ///< write them out: a replicated unit (stage 0) is written by rank 0 alone
  fill,  ///< overwrite them: every rank fills every shard it holds
};

/// A view of an engine's state for checkpoint and weight tools (see the file comment).
template <class Eng>
class EngineState {
 public:
  using MasterT = typename Eng::MasterT;
  /// Every rank holds whole units (stage 0) rather than its shard of each.
  static constexpr bool holds_whole_units = !Eng::stage_traits::shards_optimizer_states;
  /// The master slices and optimizer states are memory the host reads (host memory, or pinned
  /// host memory under Offload<CPU>); false on a device without offload, where for_each_unit
  /// stages them through host copies, as it does the units Offload<CPU> keeps on the device
  /// (EngineOptions::offload_ratio).
  static constexpr bool host_reads_states = Eng::host_reads_states;

  explicit EngineState(Eng& eng) : eng_(eng) {}

  /// This rank in the data-parallel group, and the group's size.
  int rank() const { return eng_.rank(); }
  int world_size() const { return eng_.world_size(); }
  /// The data-parallel communicator the state is sharded over.
  parallel::AnyComm& comm() { return eng_.comm_; }
  /// Every rank holding a distinct part of the state (tp x dp x pp): checkpoints run their
  /// collectives on host values (sizes, text, the outcome) over it.
  auto state_comm() { return host_values(eng_.groups_.state_group()); }
  /// The collectives on host values over group, staged through the engine's memory where its
  /// communicator cannot read the host's (NcclComm).
  auto host_values(parallel::AnyComm& group) { return eng_.host_values(group); }
  /// This rank in the tensor-parallel group, and the group's size (1 without one).
  int tp_rank() const { return eng_.groups_.tp_rank(); }
  int tp_size() const { return eng_.groups_.tp_size(); }
  /// Number of units, their parameters and their partitions.
  int num_units() const { return eng_.num_units(); }
  const std::vector<nn::ParamSpec>& unit_specs(int u) const { return eng_.unit_specs(u); }
  const UnitPartition& partition(int u) const { return eng_.partition(u); }
  /// True when the engine has optimizers (built from a config) rather than an update callback.
  bool has_optimizer() const { return !eng_.optimizers_.empty(); }

  /// fn(u, master, optimizer) for every unit in order: master is this rank's master of u (the
  /// whole padded unit when holds_whole_units), optimizer its optimizer or null. access says
  /// whether fn's writes are kept and whether the old values are read first.
  template <class Fn>
  void for_each_unit(StateAccess access, Fn&& fn) {
    for_each_unit(access, std::forward<Fn>(fn), [](int) { return true; });
  }
  /// The same for the units wanted(u) names only: the others are neither staged nor passed to
  /// fn (a save's units this rank does not save).
  template <class Fn, class Wanted>
  void for_each_unit(StateAccess access, Fn&& fn, Wanted&& wanted) {
    eng_.store_.for_each_unit(access, [&](int u) {
      if (!wanted(u)) return;
      optim::AnyOptimizer* opt = optimizer_of(u);
      if (reads_host_memory(u)) {
        fn(u, eng_.unit(u).resident_master(), opt);
      } else {
        HostStaging staged(eng_, u, opt, access);
        fn(u, staged.master(), opt);
        staged.keep(access);
      }
    });
  }
  /// fn(u, master) for every unit (for_each_unit without the optimizer).
  template <class Fn>
  void for_each_master(StateAccess access, Fn&& fn) {
    for_each_unit(access, [&](int u, std::span<MasterT> m, optim::AnyOptimizer*) { fn(u, m); });
  }
  /// fn(r, shard) for each shard of unit u this rank holds, as parts of `slice` (u's master or
  /// a state of it): its own shard, or every shard of a whole unit (rank 0 alone when saving).
  /// r and rank 0 count in the group u is sharded over (the expert data-parallel group for an
  /// expert unit: each group of ranks holding the same experts saves them).
  template <class Span, class Fn>
  void for_each_owned_shard(int u, Span slice, ShardUse use, Fn&& fn) const {
    const UnitPartition& p = partition(u);
    for (int r : owned_shard_ranks(u, use)) {
      if constexpr (holds_whole_units) {
        fn(r, slice.subspan(static_cast<std::size_t>(p.shard_begin(r)),
                            static_cast<std::size_t>(p.shard_numel())));
      } else {
        fn(r, slice);
      }
    }
  }
  /// The r for_each_owned_shard passes for unit u, in its order (no slice needed: what a
  /// streamed save declares before it reads the slice).
  std::vector<int> owned_shard_ranks(int u, ShardUse use) const {
    if (use == ShardUse::save && !saves_unit(u)) return {};
    if constexpr (holds_whole_units) {
      std::vector<int> all(static_cast<std::size_t>(partition(u).world_size()));
      for (std::size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
      return all;
    } else {
      return {eng_.unit_rank(u)};
    }
  }

  /// True when this rank saves shards of unit u: a replica's owner saves it, under hybrid
  /// sharding replica 0 of each shard, and of whole units (stage 0) the group's rank 0 alone.
  bool saves_unit(int u) const {
    if (eng_.unit_is_replica(u) || eng_.unit_replica_rank(u) != 0) return false;
    return !holds_whole_units || eng_.unit_rank(u) == 0;
  }
  /// The optimizer of unit u, or null for an engine with an update callback.
  optim::AnyOptimizer* optimizer_of(int u) {
    return eng_.optimizers_.empty() ? nullptr : &eng_.optimizers_[static_cast<std::size_t>(u)];
  }

  /// The engine's own state as saved in a checkpoint: counters, scheduler, loss scaler and the
  /// settings it ran with.
  nlohmann::json to_json() const {
    nlohmann::json j;
    j["format"] = "zero-engine-1";
    j["stage"] = Eng::stage;
    j["world_size"] = world_size();
    j["tensor_parallel"] = tp_size();
    j["precision"] = name_of(dtype_of<typename Eng::T>);
    j["master_dtype"] = name_of(dtype_of<MasterT>);
    j["optimizer"] = optimizer_name();
    j["optimizer_step"] = has_optimizer() ? eng_.optimizers_[0].step_count() : eng_.training_.steps;
    eng_.training_.save(j);
    j["seed"] = eng_.options_.seed;
    return j;
  }
  /// CheckpointError when what to_json saved does not fit this engine (another optimizer, or a
  /// malformed state); changes nothing, so a load checks it before it replaces any slice.
  void check_json(const nlohmann::json& j) const {
    try {
      const std::string saved = j.at("optimizer").get<std::string>();
      expect<CheckpointError>(saved == optimizer_name(), "checkpoint: saved with optimizer ", saved,
                              ", this engine runs ", optimizer_name());
      (void)j.at("optimizer_step").get<std::int64_t>();
    } catch (const nlohmann::json::exception& e) {
      raise<CheckpointError>("checkpoint: malformed engine state: ", e.what());
    }
  }
  /// Restores what to_json saved; CheckpointError when it does not fit this engine.
  void load_json(const nlohmann::json& j) {
    check_json(j);
    try {
      eng_.training_.load(j);
      for (auto& o : eng_.optimizers_) o.set_step_count(j.at("optimizer_step").get<std::int64_t>());
    } catch (const nlohmann::json::exception& e) {
      raise<CheckpointError>("checkpoint: malformed engine state: ", e.what());
    }
  }
  /// The counters, learning rate, scheduler and loss scaler.
  TrainingState& training() { return eng_.training_; }

  /// Raises CheckpointError naming what when the engine is inside an accumulation window.
  void require_between_steps(std::string_view what) const {
    expect<CheckpointError>(
        eng_.between_steps(), what,
        ": called in the middle of gradient accumulation; call it after step()");
  }
  /// Raises Error naming what when an earlier step or load stopped part-way.
  void require_consistent(std::string_view what) const { eng_.expect_consistent(what); }
  /// Records that the state is inconsistent (a load that stopped part-way) and why; training
  /// and saving are refused until a checkpoint loads.
  void mark_inconsistent(std::string why) { eng_.inconsistent_ = std::move(why); }
  /// Records that the state is whole again: a load replaced every slice and the engine state.
  void mark_consistent() { eng_.inconsistent_.clear(); }
  /// Why the state is inconsistent; empty when it is whole.
  const std::string& inconsistency() const { return eng_.inconsistent_; }
  /// The master slices were replaced from outside: refresh the compute copies and re-gather.
  void masters_replaced() { eng_.masters_replaced(); }
  /// Waits for every collective in flight.
  void synchronize() { eng_.synchronize(); }

 private:
  // Unit u's master slice and optimizer states copied into host memory for one call of a pass
  // (copied down unless the pass overwrites them), the optimizer bound to the copies meanwhile.
  // keep() copies them back up when the pass keeps its changes; the destructor binds the
  // optimizer to its device states again, also when the call threw.
  class HostStaging {
   public:
    HostStaging(Eng& eng, int u, optim::AnyOptimizer* opt, StateAccess access)
        : eng_(eng), unit_(eng.unit(u)), opt_(opt) {
      expect<Error>(opt_ == nullptr || unit_.optimizer_states.size() == opt_->state_names().size(),
                    "EngineState: the optimizer's states are not in the unit's device buffers");
      const std::span<MasterT> device = unit_.resident_master();
      master_.resize(device.size());
      if (reads_first(access)) {
        eng_.backend_.copy_to_host(std::span<MasterT>(master_), std::span<const MasterT>(device));
      }
      if (opt_ == nullptr) return;
      std::vector<std::span<float>> bound;
      for (auto& b : unit_.optimizer_states) {
        states_.emplace_back(b.size());
        if (reads_first(access)) {
          eng_.backend_.copy_to_host(std::span<float>(states_.back()),
                                     std::span<const float>(b.data(), b.size()));
        }
        bound.emplace_back(states_.back());
      }
      opt_->bind_state(std::span<const std::span<float>>(bound));
    }
    ~HostStaging() {
      if (opt_ == nullptr) return;
      std::vector<std::span<float>> device;
      for (auto& b : unit_.optimizer_states) device.emplace_back(b.data(), b.size());
      opt_->bind_state(std::span<const std::span<float>>(device));
    }
    HostStaging(const HostStaging&) = delete;
    HostStaging& operator=(const HostStaging&) = delete;

    // The host copy of the master slice.
    std::span<MasterT> master() { return master_; }
    // Copies what the pass wrote back into the unit's memory (nothing for a read-only pass).
    void keep(StateAccess access) {
      if (!keeps_changes(access)) return;
      const std::span<MasterT> device = unit_.resident_master();
      eng_.backend_.copy_from_host(device, std::span<const MasterT>(master_));
      for (std::size_t k = 0; k < states_.size(); ++k) {
        auto& b = unit_.optimizer_states[k];
        eng_.backend_.copy_from_host(std::span<float>(b.data(), b.size()),
                                     std::span<const float>(states_[k]));
      }
    }

   private:
    Eng& eng_;
    typename Eng::Unit& unit_;
    optim::AnyOptimizer* opt_;
    std::vector<MasterT> master_;
    std::vector<std::vector<float>> states_;
  };

  // for_each_unit reads unit u's state where it is (in host memory, or swapped in there from
  // files), rather than staging it from device memory.
  bool reads_host_memory(int u) const {
    if constexpr (Eng::backend_type::Device::kind == DeviceKind::host || !host_reads_states) {
      (void)u;
      return host_reads_states;
    } else {
      return eng_.unit_offloaded(u);
    }
  }

  std::string optimizer_name() const {
    return has_optimizer() ? eng_.optimizers_[0].type_name() : "callback";
  }

  Eng& eng_;
};

}  // namespace zero::engine
