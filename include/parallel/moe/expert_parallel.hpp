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
  explicit ExpertParallel(C& group) : comm_(std::make_shared<AnyComm>(group)) {}

  /// Ranks in the group (1 without one).
  int size() const { return comm_ ? comm_->size() : 1; }
  /// This rank in the group.
  int rank() const { return comm_ ? comm_->rank() : 0; }
  /// True when experts split over more than one rank.
  bool active() const { return size() > 1; }
  /// The group's communicator; Error without one.
  AnyComm& comm() const {
    expect<Error>(comm_ != nullptr, "ExpertParallel: no expert-parallel group (ep = 1)");
    return *comm_;
  }

 private:
  std::shared_ptr<AnyComm> comm_;
};

}  // namespace zero::parallel
