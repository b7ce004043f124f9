#pragma once
// ProcessGroups: the communicators of a Grid, built on any communicator with one split per axis
// mask (collective over the world, each rank calling it once per mask, unlike torch's
// every-rank-creates-every-group).

#include <string>
#include <utility>
#include <vector>

#include <parallel/topology.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// The masks ProcessGroups builds unless told otherwise: tp, cp, ep, dp, pp, dp-cp (ZeRO's
/// data-parallel group when context parallel is on), ep-dp (the data-parallel group of dense
/// parameters with expert parallelism), ep-dp-pp (with pipeline stages too, its checkpoints'
/// group), cp-ep-dp and cp-ep-dp-pp (the same two under Ulysses sequence parallelism), tp-pp
/// (Megatron's model-parallel group),
/// tp-dp (every rank holding a distinct part of a tensor-parallel model's state: checkpoints),
/// tp-dp-pp (the same with pipeline stages), tp-dp-cp and tp-dp-cp-pp (the same with
/// context parallelism, whose ZeRO shards are over dp x cp), and tp-cp-ep-dp-pp (the whole
/// grid: the same with experts split over ep and tp).
inline std::vector<AxisMask> standard_masks() {
  return {AxisMask{Axis::tp},
          AxisMask{Axis::cp},
          AxisMask{Axis::ep},
          AxisMask{Axis::dp},
          AxisMask{Axis::pp},
          AxisMask{Axis::dp, Axis::cp},
          AxisMask{Axis::ep, Axis::dp},
          AxisMask{Axis::ep, Axis::dp, Axis::pp},
          AxisMask{Axis::cp, Axis::ep, Axis::dp},
          AxisMask{Axis::cp, Axis::ep, Axis::dp, Axis::pp},
          AxisMask{Axis::tp, Axis::pp},
          AxisMask{Axis::tp, Axis::dp},
          AxisMask{Axis::tp, Axis::dp, Axis::pp},
          AxisMask{Axis::tp, Axis::dp, Axis::cp},
          AxisMask{Axis::tp, Axis::dp, Axis::cp, Axis::pp},
          AxisMask{Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp}};
}

/// The sub-communicators of a Grid over a world communicator of type Comm.
template <class Comm>
class ProcessGroups {
 public:
  /// Splits world once per mask (every rank must pass the same masks in the same order). Each
  /// group is named after its mask ("tp", "dp-cp") in logs and errors.
  ProcessGroups(Comm& world, Grid grid, const std::vector<AxisMask>& masks = standard_masks())
      : grid_(std::move(grid)) {
    expect<ConfigError>(world.size() == grid_.world(), "ProcessGroups: the communicator has ",
                        world.size(), " ranks but the grid (tp=", grid_.size(Axis::tp),
                        ", cp=", grid_.size(Axis::cp), ", ep=", grid_.size(Axis::ep),
                        ", dp=", grid_.size(Axis::dp), ", pp=", grid_.size(Axis::pp), ") has ",
                        grid_.world());
    const int r = world.rank();
    for (AxisMask m : masks) {
      groups_.emplace_back(m, world.split(grid_.color(r, m), grid_.key(r, m), m.to_string()));
    }
  }

  /// The grid the groups follow.
  const Grid& grid() const { return grid_; }
  /// This rank's communicator for mask; throws ConfigError when it was not built.
  Comm& get(AxisMask mask) {
    for (auto& [m, comm] : groups_) {
      if (m == mask) return comm;
    }
    raise<ConfigError>("ProcessGroups: no group for axes '", mask.to_string(),
                       "' was built; pass it in the masks");
  }
  /// Tensor-parallel group.
  Comm& tp() { return get({Axis::tp}); }
  /// Context-parallel group.
  Comm& cp() { return get({Axis::cp}); }
  /// Expert-parallel group.
  Comm& ep() { return get({Axis::ep}); }
  /// Data-parallel group.
  Comm& dp() { return get({Axis::dp}); }
  /// Pipeline-parallel group.
  Comm& pp() { return get({Axis::pp}); }
  /// Data x context parallel group (ZeRO shards over it when cp > 1).
  Comm& dp_cp() { return get({Axis::dp, Axis::cp}); }
  /// The group ZeRO shards over: data parallel, or data x context parallel when cp > 1.
  Comm& data_parallel() { return grid_.size(Axis::cp) > 1 ? dp_cp() : dp(); }
  /// Model-parallel group, tensor x pipeline (gradient-norm statistics).
  Comm& mp() { return get({Axis::tp, Axis::pp}); }
  /// Tensor x data parallel group (the ranks holding distinct parts of a model's state).
  Comm& tp_dp() { return get({Axis::tp, Axis::dp}); }
  /// Tensor x data x pipeline parallel group (the same, with pipeline stages).
  Comm& tp_dp_pp() { return get({Axis::tp, Axis::dp, Axis::pp}); }

 private:
  Grid grid_;
  std::vector<std::pair<AxisMask, Comm>> groups_;
};

}  // namespace zero::parallel
