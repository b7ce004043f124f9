#pragma once
// How a unit's parameters are laid out and sharded (FSDP-style flat parameters): the unit's
// parameters are concatenated in declaration order into one flat buffer, padded at the end so it
// splits evenly over the data-parallel ranks (and each shard is a multiple of align_elems), and
// rank r owns the contiguous slice [r * shard, (r + 1) * shard). A parameter may straddle shards;
// segments(r) lists the pieces rank r holds, which is what sharded initialisation, checkpoints
// and optimizer masks need.

#include <cstdint>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/core/tensor.hpp>
#include <zero/nn/param.hpp>

namespace zero::engine {

/// A parameter's place in its unit's flat buffer.
struct ParamSlot {
  std::int64_t offset = 0;  ///< first element in the flat buffer
  std::int64_t numel = 0;
};

/// The part of one parameter inside one rank's shard.
struct ShardSegment {
  int param = 0;                  ///< index in the unit's parameter list
  std::int64_t param_offset = 0;  ///< first element within the parameter
  std::int64_t shard_offset = 0;  ///< first element within the shard
  std::int64_t count = 0;
};

/// The flat layout and sharding of one unit over world_size ranks.
class UnitPartition {
 public:
  /// Lays out specs; every shard's size is a multiple of align_elems (>= 1).
  UnitPartition(const std::vector<nn::ParamSpec>& specs, int world_size,
                std::int64_t align_elems = 1)
      : world_size_(world_size) {
    expect<Error>(world_size > 0, "UnitPartition: world size ", world_size, " must be positive");
    expect<Error>(align_elems > 0, "UnitPartition: alignment ", align_elems, " must be positive");
    for (const auto& s : specs) {
      slots_.push_back({numel_, s.numel()});
      numel_ += s.numel();
    }
    const std::int64_t per_rank = (numel_ + world_size - 1) / world_size;
    shard_numel_ = (per_rank + align_elems - 1) / align_elems * align_elems;
  }

  int world_size() const { return world_size_; }
  int num_params() const { return static_cast<int>(slots_.size()); }
  /// Elements of all parameters (without padding).
  std::int64_t numel() const { return numel_; }
  /// Elements of the padded flat buffer: world_size * shard_numel.
  std::int64_t padded_numel() const { return shard_numel_ * world_size_; }
  /// Elements each rank owns.
  std::int64_t shard_numel() const { return shard_numel_; }
  const ParamSlot& slot(int param) const { return slots_.at(static_cast<std::size_t>(param)); }
  /// First flat element rank owns.
  std::int64_t shard_begin(int rank) const {
    check_rank(rank);
    return static_cast<std::int64_t>(rank) * shard_numel_;
  }

  /// The pieces of parameters in rank's shard, in flat order (padding is not listed).
  std::vector<ShardSegment> segments(int rank) const {
    const std::int64_t begin = shard_begin(rank), end = begin + shard_numel_;
    std::vector<ShardSegment> out;
    for (int p = 0; p < num_params(); ++p) {
      const ParamSlot& s = slots_[static_cast<std::size_t>(p)];
      const std::int64_t lo = s.offset > begin ? s.offset : begin;
      const std::int64_t hi = s.offset + s.numel < end ? s.offset + s.numel : end;
      if (lo < hi) out.push_back({p, lo - s.offset, lo - begin, hi - lo});
    }
    return out;
  }

 private:
  void check_rank(int rank) const {
    expect<Error>(rank >= 0 && rank < world_size_, "UnitPartition: rank ", rank,
                  " out of range for world size ", world_size_);
  }

  int world_size_;
  std::vector<ParamSlot> slots_;
  std::int64_t numel_ = 0;
  std::int64_t shard_numel_ = 0;
};

/// Initialises rank's shard of a unit from (seed, parameter name, element index) alone, so no
/// rank ever materialises the whole unit, yet the union of shards equals a single-process
/// initialisation. Padding is zeroed.
template <class T>
void initialise_shard(const std::vector<nn::ParamSpec>& specs, const UnitPartition& partition,
                      int rank, Tensor<T> shard, std::uint64_t seed) {
  expect<ShapeError>(shard.numel() == partition.shard_numel(), "initialise_shard: shard holds ",
                     shard.numel(), " elements, the partition's shards hold ",
                     partition.shard_numel());
  for (T& v : shard) v = convert<T>(0.0);
  for (const ShardSegment& seg : partition.segments(rank)) {
    nn::initialise(specs[static_cast<std::size_t>(seg.param)],
                   shard.slice(seg.shard_offset, seg.count), seg.param_offset, seed);
  }
}

}  // namespace zero::engine
