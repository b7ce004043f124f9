#pragma once
// ExpertParallel: the expert-parallel group a model's mixture-of-experts layers split their
// experts over (DeepSpeed's ep_size). Rank r of a group of ep ranks holds experts
// [r * E/ep, (r + 1) * E/ep) of every MoE layer; tokens travel to their experts and back through
// all-to-alls over the group (token_exchange.hpp). Layers keep a copy (one shared type-erased
// communicator), so a model is built once per rank from the rank's ep group:
//
//   parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.ep = 2, .dp = 2}));
//   nn::MoEBlocks moe;  // router settings, every k-th block
//   moe.router.num_experts = 8;
//   moe.ep = parallel::ExpertParallel(groups.ep());
//   nn::LayerGPT<float> model(cfg, {}, {}, moe);
//
// The default (no group) is ep = 1: every expert on this rank, no collective.

#include <memory>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// An expert-parallel group (possibly of one rank).
class ExpertParallel {
 public:
  /// ep = 1: no group, no collectives.
  ExpertParallel() = default;
  /// Experts split over group.
  template <Communicator C>
  explicit ExpertParallel(C& group)
      : comm_(std::make_shared<AnyComm>(group)), size_(comm_->size()), rank_(comm_->rank()) {}
  /// Rank `rank` of a group of `size` ranks without a communicator: an ExpertStack built over it
  /// holds that rank's experts, and any exchange raises (comm()). For sizing a rank's model
  /// without its group (engine/model_memory_estimate.hpp).
  static ExpertParallel shape_only(int size, int rank) {
    expect<ConfigError>(size >= 1 && 0 <= rank && rank < size, "ExpertParallel: rank ", rank,
                        " of a group of ", size, " ranks");
    ExpertParallel e;
    e.size_ = size;
    e.rank_ = rank;
    return e;
  }

  /// Ranks in the group (1 without one).
  int size() const { return size_; }
  /// This rank in the group.
  int rank() const { return rank_; }
  /// True when experts split over more than one rank.
  bool active() const { return size() > 1; }
  /// The group's communicator; Error without one.
  AnyComm& comm() const {
    expect<Error>(comm_ != nullptr, "ExpertParallel: no expert-parallel communicator (ep = ", size_,
                  size_ > 1 ? ", a shape-only group: its model sizes a rank and cannot run)" : ")");
    return *comm_;
  }

 private:
  std::shared_ptr<AnyComm> comm_;
  int size_ = 1, rank_ = 0;
};

}  // namespace zero::parallel
