#pragma once
// StageModel: the part of a model one pipeline rank trains, as an nn::Model of its own, so an
// ordinary Engine shards, reduces and steps exactly that part. Its units are the rank's chunks
// in chunk order (chunk c = virtual stage c * pp + s of the Partition), each chunk a contiguous
// range of local units. A unit of the chunk that reads the parameters of a unit on another
// stage (a GPT's LM head reading the token table of unit 0) gets a replica of that unit at the
// front of its chunk: the replica binds the full model's unit (so the reader sees its values
// and accumulates into its gradient) and runs nothing itself. The pipeline keeps replica and
// owner equal by adding their gradients before each step (Megatron's embedding group), and the
// engine leaves replicas out of the gradient norm and of checkpoints.
// The full model object exists on every rank, but it holds no parameter memory of its own (its
// layers bind views the engine owns), so a rank stores only its stage's parameters.

#include <any>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <parallel/pipeline/partition.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/micro_step.hpp>
#include <zero/nn/model.hpp>

namespace zero::parallel::pipeline {

/// One pipeline rank's units of a model M (see the file comment).
template <nn::Model M>
class StageModel {
 public:
  using value_type = typename M::value_type;

  /// Rank `stage` of pp, holding chunks c = 0..v-1 (virtual stages c * pp + stage) of partition.
  StageModel(M& model, const Partition& partition, int stage, int pp) : model_(model) {
    const int v = static_cast<int>(partition.parts.size()) / pp;
    expect<ConfigError>(v >= 1 && v * pp == static_cast<int>(partition.parts.size()),
                        "StageModel: a partition of ", partition.parts.size(),
                        " parts does not fit pp = ", pp);
    expect<ConfigError>(0 <= stage && stage < pp, "StageModel: stage ", stage, " is outside [0, ",
                        pp, ")");
    for (int c = 0; c < v; ++c) {
      const engine::UnitRange g = partition.chunk(stage, c, pp);
      const int first = static_cast<int>(global_.size());
      // Units this chunk reads that no chunk of this rank owns: a replica each, in front.
      for (int u = g.first; u < g.last; ++u) {
        for (int used : model_.unit_uses(u)) {
          const int owner = partition.virtual_stage_of(used) % pp;
          if (owner == stage || contains_replica(first, used)) continue;
          // One replica per unit and rank: its gradient is complete after its chunk's backward,
          // which a reader in another chunk of this rank would not wait for.
          expect<ConfigError>(!contains_replica(0, used), "StageModel: unit ", u,
                              " on pipeline rank ", stage, " reads unit ", used,
                              ", which another chunk of this rank already replicates; tied "
                              "readers of one unit must sit in one chunk per rank");
          global_.push_back(used);
          replica_.push_back(true);
        }
      }
      for (int u = g.first; u < g.last; ++u) {
        global_.push_back(u);
        replica_.push_back(false);
      }
      chunks_.push_back({first, static_cast<int>(global_.size())});
    }
  }

  /// Number of local units (chunks' units and replicas).
  int num_units() const { return static_cast<int>(global_.size()); }
  /// Local units of chunk c.
  engine::UnitRange chunk_units(int c) const { return chunks_.at(static_cast<std::size_t>(c)); }
  /// Number of chunks (virtual stages on this rank).
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  /// The full model's index of local unit u.
  int global_unit(int u) const { return global_.at(static_cast<std::size_t>(u)); }
  /// True when local unit u is a replica of a unit another stage owns.
  bool unit_is_replica(int u) const { return replica_.at(static_cast<std::size_t>(u)); }
  /// Local index of the full model's unit g (its owned copy, else its replica); -1 if absent.
  int local_unit(int g) const {
    int found = -1;
    for (int u = 0; u < num_units(); ++u) {
      if (global_[static_cast<std::size_t>(u)] != g) continue;
      if (!replica_[static_cast<std::size_t>(u)]) return u;
      found = u;
    }
    return found;
  }

  /// Parameters of local unit u (the full model's unit).
  std::vector<nn::ParamSpec> unit_params(int u) const { return model_.unit_params(global_unit(u)); }
  /// The local units u reads (owned or replicated on this rank).
  std::vector<int> unit_uses(int u) const {
    std::vector<int> out;
    if (unit_is_replica(u)) return out;
    for (int used : model_.unit_uses(global_unit(u))) {
      const int local = local_unit(used);
      expect<Error>(local >= 0, "StageModel: unit ", global_unit(u), " reads unit ", used,
                    ", which this stage neither owns nor replicates");
      out.push_back(local);
    }
    return out;
  }
  /// Binds the full model's unit.
  void bind_unit(int u, std::span<const nn::ParamView<value_type>> views) {
    model_.bind_unit(global_unit(u), views);
  }
  /// Runs the full model's unit forward (a replica runs nothing).
  void forward_unit(int u, nn::StepContext<value_type>& ctx) {
    if (!unit_is_replica(u)) model_.forward_unit(global_unit(u), ctx);
  }
  /// Runs the full model's unit backward (a replica runs nothing).
  void backward_unit(int u, nn::StepContext<value_type>& ctx) {
    if (!unit_is_replica(u)) model_.backward_unit(global_unit(u), ctx);
  }
  /// Whether local unit u parks (nn::ParksPasses; when the full model does): a replica keeps
  /// nothing, so it always does.
  bool parks_unit(int u) const requires nn::ParksPasses<M> {
    return unit_is_replica(u) || model_.parks_unit(global_unit(u));
  }
  /// Moves out what the full model's unit kept for its backward (nothing for a replica).
  std::any park_unit(int u) requires nn::ParksPasses<M> {
    return unit_is_replica(u) ? std::any() : model_.park_unit(global_unit(u));
  }
  /// Puts back what park_unit(u) moved out.
  void resume_unit(int u, std::any saved) requires nn::ParksPasses<M> {
    if (!unit_is_replica(u)) model_.resume_unit(global_unit(u), std::move(saved));
  }
  /// The tensor-parallel group the full model is split over (when it has one).
  decltype(auto) tensor_parallel() const requires requires(const M& m) { m.tensor_parallel(); }
  { return model_.tensor_parallel(); }
  /// The expert- and sequence-parallel groups of the full model (when it has them), so the
  /// engine checks them against its grid as it does for a whole model.
  decltype(auto) expert_parallel() const requires requires(const M& m) { m.expert_parallel(); }
  { return model_.expert_parallel(); }
  decltype(auto) sequence_parallel() const requires requires(const M& m) { m.sequence_parallel(); }
  { return model_.sequence_parallel(); }
  /// True when local unit u is one of the full model's expert units (a replica too).
  bool unit_is_expert(int u) const requires nn::HasExpertUnits<M> {
    return model_.unit_is_expert(global_unit(u));
  }
  /// The full model's flop count of local unit u's last forward (replicas count nothing).
  auto unit_forward_flops(int u) const requires requires(const M& m) { m.unit_forward_flops(0); }
  {
    using R = decltype(model_.unit_forward_flops(0));
    return unit_is_replica(u) ? R(std::in_place) : model_.unit_forward_flops(global_unit(u));
  }
  /// The model this stage is part of.
  M& full_model() { return model_; }

 private:
  bool contains_replica(int from, int g) const {
    for (int u = from; u < num_units(); ++u) {
      if (replica_[static_cast<std::size_t>(u)] && global_[static_cast<std::size_t>(u)] == g) {
        return true;
      }
    }
    return false;
  }

  M& model_;
  std::vector<int> global_;
  std::vector<bool> replica_;
  std::vector<engine::UnitRange> chunks_;
};

}  // namespace zero::parallel::pipeline
