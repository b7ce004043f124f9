#pragma once
// TensorParallel: the tensor-parallel group a model's layers split over, and whether Megatron's
// sequence parallelism is on. Layers keep a copy (it shares one type-erased communicator), so a
// model is built once per rank from the rank's tp group:
//
//   parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .dp = 2}));
//   nn::GPT<float> model(cfg, parallel::TensorParallel(groups.tp(), /*sequence_parallel=*/true));
//
// The default (no group) is tp = 1: every layer runs whole and issues no collective.
// TensorParallel::shape_only(size, rank) is a group's shape without a communicator: a model built
// over it has rank `rank`'s parameters (what a memory estimate needs) but cannot run.

#include <memory>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// A tensor-parallel group (possibly of one rank) and the sequence-parallel switch.
class TensorParallel {
 public:
  /// tp = 1: no group, no collectives.
  TensorParallel() = default;
  /// Layers split over group; sequence_parallel keeps the residual stream, LayerNorms and
  /// dropouts on 1/tp of the rows (all-gather before column-parallel layers, reduce-scatter after
  /// row-parallel ones).
  template <Communicator C>
  explicit TensorParallel(C& group, bool sequence_parallel = false)
      : comm_(std::make_shared<AnyComm>(group)),
        size_(comm_->size()),
        rank_(comm_->rank()),
        sequence_parallel_(sequence_parallel) {}
  /// Rank `rank` of a group of `size` ranks without a communicator: layers built over it take
  /// that rank's part of every split tensor, and any collective raises (comm()). For sizing a
  /// rank's model without its group (engine/model_memory_estimate.hpp).
  static TensorParallel shape_only(int size, int rank, bool sequence_parallel = false) {
    expect<ConfigError>(size >= 1 && 0 <= rank && rank < size, "TensorParallel: rank ", rank,
                        " of a group of ", size, " ranks");
    TensorParallel t;
    t.size_ = size;
    t.rank_ = rank;
    t.sequence_parallel_ = sequence_parallel;
    return t;
  }

  /// Ranks in the group (1 without one).
  int size() const { return size_; }
  /// This rank in the group.
  int rank() const { return rank_; }
  /// True when layers split over more than one rank.
  bool active() const { return size() > 1; }
  /// True when sequence parallelism is on (and tp > 1: with one rank it changes nothing).
  bool sequence_parallel() const { return sequence_parallel_ && active(); }
  /// The group's communicator; Error without one.
  AnyComm& comm() const {
    expect<Error>(comm_ != nullptr, "TensorParallel: no tensor-parallel communicator (tp = ", size_,
                  size_ > 1 ? ", a shape-only group: its model sizes a rank and cannot run)" : ")");
    return *comm_;
  }

 private:
  std::shared_ptr<AnyComm> comm_;
  int size_ = 1, rank_ = 0;
  bool sequence_parallel_ = false;
};

}  // namespace zero::parallel
