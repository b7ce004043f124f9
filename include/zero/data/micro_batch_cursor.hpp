#pragma once
// MicroBatchCursor: the split of a step's global batch over ranks and micro-batches, and the
// step/micro-batch position, shared by every loader. Rank r of W takes rows [r B/W, (r+1) B/W)
// of step s's global batch, in M micro-batches of B/(W M) rows, so the global batch of a step is
// the same at any world size and one process on it is the reference the ranks must equal.
//
// A Loader derives from MicroBatchCursor<Loader, Batch> and provides
//   config_                            with global_batch, world_size, rank, micro_batches
//   rows_of(step, first_row, rows)     -> Batch (global rows [first_row, first_row + rows))
//   static constexpr const char* loader_name  ("DataLoader", ...) for messages
// (config_ and rows_of may be private: the cursor is a friend).

#include <cstdint>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::data {

/// The rank/micro-batch split and position of a loader (see the file comment).
template <class Loader, class Batch>
class MicroBatchCursor {
 public:
  /// Rows of one rank's micro-batch: B / (W * M).
  std::int64_t micro_rows() const {
    const auto& c = loader().config_;
    return c.global_batch / c.world_size / c.micro_batches;
  }
  /// The whole global batch of step: the single-process reference the ranks' rows add up to.
  Batch global_batch(std::int64_t step) const {
    return loader().rows_of(step, 0, loader().config_.global_batch);
  }
  /// This rank's micro-batch micro of step.
  Batch micro_batch(std::int64_t step, int micro) const {
    const auto& c = loader().config_;
    expect<ConfigError>(micro >= 0 && micro < c.micro_batches, Loader::loader_name,
                        ": micro-batch ", micro, " is outside [0, ", c.micro_batches, ")");
    const std::int64_t per_rank = c.global_batch / c.world_size;
    Batch b = loader().rows_of(step, c.rank * per_rank + micro * micro_rows(), micro_rows());
    b.micro = micro;
    return b;
  }
  /// The next micro-batch of this rank; advances the position.
  Batch next() {
    Batch b = micro_batch(step_, micro_);
    if (++micro_ == loader().config_.micro_batches) {
      micro_ = 0;
      ++step_;
    }
    return b;
  }
  /// The M micro-batches of the next step (the position must be at a step boundary).
  std::vector<Batch> next_step() {
    expect<ConfigError>(micro_ == 0, Loader::loader_name, "::next_step: ", micro_,
                        " micro-batches of step ", step_, " were already taken with next()");
    std::vector<Batch> batches;
    for (int m = 0; m < loader().config_.micro_batches; ++m) batches.push_back(next());
    return batches;
  }

 protected:
  std::int64_t step_ = 0;  ///< the step of the next micro-batch
  int micro_ = 0;          ///< its micro-batch index

 private:
  const Loader& loader() const { return static_cast<const Loader&>(*this); }
};

}  // namespace zero::data
