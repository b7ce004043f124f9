#pragma once
// SequenceParallel: the group of a DeepSpeed-Ulysses sequence-parallel model. Each of its sp ranks
// holds T/sp consecutive positions of every sequence of the micro-batch (rank r positions
// [r*T/sp, (r+1)*T/sp)); attention alone needs whole sequences, and gets them for nh/sp heads
// through an all-to-all (parallel::UlyssesAttention). Layers keep a copy (it shares one
// type-erased communicator), so a model is built once per rank from the rank's sp group, the
// grid's cp axis:
//
//   parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.cp = 2, .dp = 2}));
//   nn::GPT<float> model(cfg, {}, parallel::SequenceParallel(groups.cp()));
//   engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, groups, config);  // ZeRO over dp x sp
//
// The default (no group) is sp = 1: no collectives. sequence_slice() cuts a rank's part out of a
// [batch, seq_len] micro-batch.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/communicator.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// A Ulysses sequence-parallel group (possibly of one rank).
class SequenceParallel {
 public:
  /// sp = 1: no group, no collectives.
  SequenceParallel() = default;
  /// Sequences split over group, rank r holding the r-th block of T/sp positions.
  template <Communicator C>
  explicit SequenceParallel(C& group) : comm_(std::make_shared<AnyComm>(group)) {}

  /// Ranks in the group (1 without one).
  int size() const { return comm_ ? comm_->size() : 1; }
  /// This rank in the group: which block of positions it holds.
  int rank() const { return comm_ ? comm_->rank() : 0; }
  /// True when sequences are split over more than one rank.
  bool active() const { return size() > 1; }
  /// The group's communicator; Error without one.
  AnyComm& comm() const {
    expect<Error>(comm_ != nullptr, "SequenceParallel: no sequence-parallel group (sp = 1)");
    return *comm_;
  }
  /// The weight of this rank's mean loss over its `counted` positions that makes the group's
  /// mean of the ranks' losses the mean over every position the group counts: counted * sp /
  /// (the group's sum of counted), 1 when the group counts none (or without a group). Equal
  /// counts give exactly 1. Collective over the group (one all-reduce of one integer).
  double token_share(std::int64_t counted) const {
    if (!active()) return 1.0;
    std::int64_t total = counted;
    comm().all_reduce(std::span<std::int64_t>(&total, 1), ReduceOp::sum);
    if (total == 0) return 1.0;
    return static_cast<double>(counted) * static_cast<double>(size()) / static_cast<double>(total);
  }

 private:
  std::shared_ptr<AnyComm> comm_;
};

/// Throws ConfigError unless seq_len divides by the sequence-parallel size sp.
inline void check_sequence_split(std::int64_t seq_len, int sp) {
  expect<ConfigError>(sp >= 1 && seq_len > 0 && seq_len % sp == 0, "sequence parallelism: seq_len ",
                      seq_len, " is not divisible by the sequence-parallel size sp = ", sp,
                      "; every rank holds seq_len / sp positions");
}

/// Rank `rank` of sp's part of a row-major [batch, seq_len] array (token ids, targets, a mask):
/// positions [rank*seq_len/sp, (rank+1)*seq_len/sp) of every row, as [batch, seq_len/sp].
template <class U>
std::vector<U> sequence_slice(std::span<const U> whole, std::int64_t batch, std::int64_t seq_len,
                              int sp, int rank) {
  check_sequence_split(seq_len, sp);
  expect<ShapeError>(batch >= 0 && static_cast<std::int64_t>(whole.size()) == batch * seq_len,
                     "sequence_slice: ", whole.size(),
                     " elements, but batch * seq_len = ", batch * seq_len);
  expect<ConfigError>(rank >= 0 && rank < sp, "sequence_slice: rank ", rank,
                      " outside the sequence-parallel group of ", sp);
  const std::int64_t local = seq_len / sp;
  std::vector<U> out;
  out.reserve(static_cast<std::size_t>(batch * local));
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto first = whole.begin() + (b * seq_len + rank * local);
    out.insert(out.end(), first, first + local);
  }
  return out;
}

/// A sequence-parallel rank's part of a language-model micro-batch: tokens and targets
/// [batch, seq_len] with seq_len = the whole length / sp (build the engine's MicroBatch from it:
/// {tokens.data(), targets.data(), batch, seq_len}).
struct SequenceSlice {
  std::vector<std::int32_t> tokens;   ///< [batch, seq_len] this rank's token ids
  std::vector<std::int32_t> targets;  ///< [batch, seq_len] their labels (empty without targets)
  std::int64_t batch = 0;             ///< rows (sequences), as in the whole micro-batch
  std::int64_t seq_len = 0;           ///< positions this rank holds: the whole length / sp

  /// sp's rank's part of tokens and targets [batch, seq_len] (targets may be null).
  SequenceSlice(const std::int32_t* whole_tokens, const std::int32_t* whole_targets,
                std::int64_t whole_batch, std::int64_t whole_seq_len, const SequenceParallel& sp)
      : batch(whole_batch), seq_len(whole_seq_len / sp.size()) {
    expect<ShapeError>(whole_tokens != nullptr, "SequenceSlice: no tokens");
    const auto n = static_cast<std::size_t>(whole_batch * whole_seq_len);
    tokens = sequence_slice<std::int32_t>({whole_tokens, n}, whole_batch, whole_seq_len, sp.size(),
                                          sp.rank());
    if (whole_targets != nullptr) {
      targets = sequence_slice<std::int32_t>({whole_targets, n}, whole_batch, whole_seq_len,
                                             sp.size(), sp.rank());
    }
  }
};

}  // namespace zero::parallel
