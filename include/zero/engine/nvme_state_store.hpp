#pragma once
// NvmeStates, the state store of Offload<NVMe> (ZeRO-Infinity on the host): each unit's fp32
// master slice and optimizer states move to one swap file per unit (a sub-group: master first,
// then the states) and their memory is given back. A pass streams them through the swapper's
// buffer_count aligned buffers (read ahead, fn, write behind); inside fn the unit's master is
// UnitState::swapped_in_master and its optimizer is bound to the buffer. A stage-3 gather reads
// the master's byte range alone, from a read ahead when the prefetch started one (into one of
// the swap buffers a pass would use: the next pass drops it unused), or from what the update
// pass left in those buffers (hand_over_masters). The units the engine gathers again right after
// the step (every unit at stages 1-2, the persistent ones at stage 3) keep their updated slice,
// rounded to the compute type, for that gather (keep_for_gather), which then reads nothing.
// See docs/offload.md.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <optim/any_optimizer.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/memory_report.hpp>
#include <zero/engine/state_store.hpp>
#include <zero/offload/nvme_swapper.hpp>

namespace zero::engine {

/// Master slices and optimizer states in swap files, one sub-group per unit.
template <class Unit>
class NvmeStates {
 public:
  /// False: a master slice is resident only inside for_each_unit.
  static constexpr bool in_memory = false;

  NvmeStates(std::vector<Unit>& units, std::vector<optim::AnyOptimizer>& optimizers)
      : units_(units), optimizers_(optimizers) {}

  /// Writes every unit's master slice and states to its file and frees their memory.
  void settle(const StoreOptions& options) {
    expect<ConfigError>(options.nvme.has_value(),
                        "Offload<NVMe>: no NVMe settings (build the engine from a config whose "
                        "offload_optimizer or offload_param device is nvme)");
    std::vector<std::vector<offload::SwapTensor>> groups;
    for (const auto& o : optimizers_) {
      std::vector<offload::SwapTensor> g;
      g.push_back({"master", static_cast<std::int64_t>(o.numel())});
      for (const auto& name : o.state_names()) {
        g.push_back({name, static_cast<std::int64_t>(o.numel())});
      }
      groups.push_back(std::move(g));
    }
    offload::SwapperOptions so;
    so.rank = options.rank;
    so.faults = options.faults;
    swapper_.emplace(*options.nvme, std::move(groups), so);
    hand_over_masters_ = options.hand_over_masters;
    for (std::size_t u = 0; u < optimizers_.size(); ++u) {
      auto& o = optimizers_[u];
      Unit& s = units_[u];
      std::vector<std::span<float>> tensors{std::span<float>(s.master.data(), s.master.size())};
      for (const auto& name : o.state_names()) tensors.push_back(o.state(name));
      swapper_->swap_out(u, std::span<const std::span<float>>(tensors));
      o.release_state_storage();
      s.master = {};
    }
  }

  /// fn(u) for every unit, its master slice and states swapped into a buffer (read unless
  /// access is overwrite; written back unless access is read). The optimizer step's pass (step)
  /// goes last unit to first with hand_over_masters, and leaves the first units' master slices
  /// to their next read.
  template <class Fn>
  void for_each_unit(StateAccess access, Fn&& fn, bool step = false) {
    offload::SwapPass pass;
    pass.read = reads_first(access);
    pass.write = keeps_changes(access);
    if (hand_over_masters_ && step) {
      pass.reverse = true;
      pass.hand_over = 0;  // the master, tensor 0 of each group
    }
    drop_kept();  // a pass may change the slices a kept copy holds
    try {
      swapper_->for_each_group(
          [&](std::size_t g, std::span<const std::span<float>> group) {
            SwappedIn in(*this, g, group);
            fn(static_cast<int>(g));
          },
          pass);
    } catch (...) {
      drop_kept();  // some group's write may not have landed: its copy is not what the file holds
      throw;
    }
  }

  /// Inside for_each_unit's fn: keeps unit u's master slice as it is now, rounded to the compute
  /// type, for the next read_master_into of u in that type (the gather after the step), which
  /// then reads nothing from the file. The next pass, a failed one, or that read drops it.
  template <class Backend>
  void keep_for_gather(int u, Backend& backend) {
    const Unit& s = units_[static_cast<std::size_t>(u)];
    expect<Error>(s.swapped_in_master.has_value(), "NvmeStates::keep_for_gather: unit ", u,
                  "'s master slice is not in a swap buffer (call it inside for_each_unit's fn)");
    if (kept_.size() != units_.size()) kept_.resize(units_.size());
    auto& k = kept_[static_cast<std::size_t>(u)];
    k.resize(s.swapped_in_master->size());
    backend.convert_into(std::span<T>(k), std::span<const float>(*s.swapped_in_master));
  }

  /// Copies unit u's master slice into out: from its swap buffer when it is in one, from a read
  /// held ahead or handed over, from the copy keep_for_gather kept (out in the compute type),
  /// else straight from its file (through staging when out is not fp32).
  template <class E, class Backend>
  void read_master_into(int u, std::span<E> out, Backend& backend) {
    Unit& s = units_[static_cast<std::size_t>(u)];
    if constexpr (std::is_same_v<E, T>) {
      std::vector<T> kept;
      if (static_cast<std::size_t>(u) < kept_.size()) kept.swap(kept_[static_cast<std::size_t>(u)]);
      // A read already held (ahead, handed over) goes first; the copy is dropped either way.
      if (!kept.empty() && !reading_ahead(u)) {
        expect<Error>(kept.size() == out.size(), "NvmeStates::read_master_into: unit ", u,
                      "'s kept slice holds ", kept.size(), " values, the read asks for ",
                      out.size());
        std::copy(kept.begin(), kept.end(), out.begin());
        ++kept_reads_;
        return;
      }
    }
    if (s.swapped_in_master) {
      backend.convert_into(out, std::span<const float>(*s.swapped_in_master));
    } else if constexpr (std::is_same_v<E, float>) {
      swapper_->swap_in_tensor(static_cast<std::size_t>(u), 0, out);
    } else {
      staging_.resize(out.size());
      swapper_->swap_in_tensor(static_cast<std::size_t>(u), 0, std::span<float>(staging_));
      backend.convert_into(out, std::span<const float>(staging_));
    }
  }
  /// How many master slices may be read ahead at once (the swap buffers but one).
  std::size_t read_ahead_capacity() const { return swapper_ ? swapper_->read_ahead_capacity() : 0; }
  /// Starts reading unit u's master slice from its file for a later read_master_into; false when
  /// every buffer for that is held (NvmeSwapper::read_ahead).
  bool read_ahead(int u) {
    return swapper_ && swapper_->read_ahead(static_cast<std::size_t>(u), 0);
  }
  /// True while a read ahead of unit u's master slice waits for its read_master_into.
  bool reading_ahead(int u) const {
    return swapper_ && swapper_->reading_ahead(static_cast<std::size_t>(u), 0);
  }
  /// How the master slices' reads from the files went (read ahead or on demand, waiting time).
  offload::TensorReadStats read_stats() const {
    offload::TensorReadStats r = swapper_ ? swapper_->read_stats() : offload::TensorReadStats{};
    r.kept = kept_reads_;
    return r;
  }
  /// The swap files (offloaded), the swap buffers and the kept copies not yet read (scratch).
  void report(MemoryReport& r) const {
    if (!swapper_) return;
    r.offloaded_bytes += swapper_->file_bytes();
    r.scratch_bytes += swapper_->buffer_bytes();
    for (const auto& k : kept_) r.scratch_bytes += k.size() * sizeof(T);
  }

 private:
  // Binds unit g's master slice (group tensor 0) and optimizer states (the rest) to a swap
  // buffer for the life of the object.
  struct SwappedIn {
    NvmeStates& store;
    std::size_t g;
    SwappedIn(NvmeStates& st, std::size_t group, std::span<const std::span<float>> tensors)
        : store(st), g(group) {
      store.units_[g].swapped_in_master = tensors[0];
      store.optimizers_[g].bind_state(tensors.subspan(1));
    }
    ~SwappedIn() {
      store.units_[g].swapped_in_master.reset();
      store.optimizers_[g].bind_state({});
    }
    SwappedIn(const SwappedIn&) = delete;
    SwappedIn& operator=(const SwappedIn&) = delete;
  };

  void drop_kept() {
    for (auto& k : kept_) k = {};
  }

  using T = typename Unit::compute_type;
  std::vector<Unit>& units_;
  std::vector<optim::AnyOptimizer>& optimizers_;
  std::optional<offload::NvmeSwapper> swapper_;
  std::vector<std::vector<T>> kept_;  // per unit: keep_for_gather's copy, until its read
  std::int64_t kept_reads_ = 0;       // read_master_into calls served from a kept copy
  bool hand_over_masters_ = false;
  std::vector<float> staging_;  // a slice read for a bf16/f16 gather
};

/// The state store of Offload<Where>.
template <class Where, class Unit>
using state_store_t =
    std::conditional_t<std::is_same_v<Where, NVMe>, NvmeStates<Unit>, InMemoryStates<Unit>>;

}  // namespace zero::engine
