#pragma once
// Where a unit's master slice and optimizer states live between updates, behind one small
// interface, so the engine's flow does not branch on offloading:
//
//   settle(options)             once the units and optimizers exist: move the states where they
//                               live (nothing to do in memory; write them to files for NVMe)
//   for_each_unit(access, fn, step)
//                               fn(u) for every unit in order (the optimizer step's pass may go
//                               last to first under NVMe: hand_over_masters), with u's master
//                               slice and states reachable (UnitState::resident_master(), the
//                               bound optimizer)
//   read_master_into(u, out)    copy u's master slice into out, rounded to out's type, at any
//                               time (a stage-3 gather, an export)
//   read_ahead(u)               start reading u's master slice for a later read_master_into,
//                               when the store reads it from somewhere slow (read_ahead_capacity
//                               at once; false when none is free); reading_ahead(u) says whether
//                               one is held, read_stats() how the reads went
//   report(r)                   what the store holds outside the units' own buffers
//
// NvmeStates also has keep_for_gather(u, backend): called inside the step's fn, it keeps u's
// updated slice for the gather right after the step, whose read_master_into then reads nothing.
//
// InMemoryStates is the store of Offload<None> (state beside the compute). NvmeStates
// (nvme_state_store.hpp) is Offload<NVMe>'s; an Offload<CPU> store for a GPU engine keeps them
// in pinned host memory behind the same members.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <optim/any_optimizer.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/offload/fault_injector.hpp>
#include <zero/offload/nvme_config.hpp>
#include <zero/offload/tensor_read_stats.hpp>

namespace zero::engine {

/// What a pass over the units' states does with them.
enum class StateAccess : unsigned char {
  read,       ///< only reads: nothing is written back (checkpoint save, export)
  update,     ///< reads, changes in place and keeps the changes (the optimizer step)
  overwrite,  ///< writes every value without reading the old ones (checkpoint or weights load)
};
/// True when a pass of this kind reads the state first.
constexpr bool reads_first(StateAccess a) {
  return a != StateAccess::overwrite;
}
/// True when a pass of this kind keeps what fn wrote.
constexpr bool keeps_changes(StateAccess a) {
  return a != StateAccess::read;
}

/// What a store needs to settle: the NVMe settings when the states go to files.
struct StoreOptions {
  std::optional<offload::NvmeConfig> nvme;         ///< Offload<NVMe>
  int rank = 0;                                    ///< names this rank's swap directory
  std::shared_ptr<offload::FaultInjector> faults;  ///< tests only: fail chosen swap requests
  /// NVMe: the optimizer step's pass visits the units last to first and leaves the master slices
  /// of the first ones in its buffers for their next read_master_into (the next forward's first
  /// gathers at stage 3), which then reads nothing (SwapPass::hand_over).
  bool hand_over_masters = false;
};

/// The master slices and optimizer states stay in the units' buffers and the optimizers.
template <class Unit>
class InMemoryStates {
 public:
  /// True: every master slice is always resident.
  static constexpr bool in_memory = true;

  /// The optimizers stay where they are; the argument keeps one constructor for every store.
  InMemoryStates(std::vector<Unit>& units, std::vector<optim::AnyOptimizer>&) : units_(units) {}

  /// Nothing moves.
  void settle(const StoreOptions&) {}
  /// fn(u) for every unit in order; everything is already where fn looks.
  template <class Fn>
  void for_each_unit(StateAccess, Fn&& fn, bool /*step*/ = false) {
    for (int u = 0; u < static_cast<int>(units_.size()); ++u) fn(u);
  }
  /// Copies unit u's master slice into out (the slice's size), rounded to out's type.
  template <class E, class Backend>
  void read_master_into(int u, std::span<E> out, Backend& backend) {
    const auto m = units_[static_cast<std::size_t>(u)].resident_master();
    backend.convert_into(out, std::span<const typename decltype(m)::value_type>(m));
  }
  /// Nothing to read ahead: the slices are where read_master_into looks.
  static constexpr std::size_t read_ahead_capacity() { return 0; }
  /// Never reads ahead.
  static constexpr bool read_ahead(int) { return false; }
  /// Never reads ahead.
  static constexpr bool reading_ahead(int) { return false; }
  /// Nothing read from files.
  static offload::TensorReadStats read_stats() { return {}; }
  /// Nothing outside the units' buffers.
  void report(MemoryReport&) const {}

 private:
  std::vector<Unit>& units_;
};

}  // namespace zero::engine
