#pragma once
// TensorParallel: the tensor-parallel group a model's layers split over, and whether Megatron's
// sequence parallelism is on. Layers keep a copy (it shares one type-erased communicator), so a
// model is built once per rank from the rank's tp group:
//
//   parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = 2, .dp = 2}));
//   nn::GPT<float> model(cfg, parallel::TensorParallel(groups.tp(), /*sequence_parallel=*/true));
//
// The default (no group) is tp = 1: every layer runs whole and issues no collective.

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
      : comm_(std::make_shared<AnyComm>(group)), sequence_parallel_(sequence_parallel) {}

  /// Ranks in the group (1 without one).
  int size() const { return comm_ ? comm_->size() : 1; }
  /// This rank in the group.
  int rank() const { return comm_ ? comm_->rank() : 0; }
  /// True when layers split over more than one rank.
  bool active() const { return size() > 1; }
  /// True when sequence parallelism is on (and tp > 1: with one rank it changes nothing).
  bool sequence_parallel() const { return sequence_parallel_ && active(); }
  /// The group's communicator; Error without one.
  AnyComm& comm() const {
    expect<Error>(comm_ != nullptr, "TensorParallel: no tensor-parallel group (tp = 1)");
    return *comm_;
  }

 private:
  std::shared_ptr<AnyComm> comm_;
  bool sequence_parallel_ = false;
};

}  // namespace zero::parallel
