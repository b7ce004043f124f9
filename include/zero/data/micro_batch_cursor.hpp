#pragma once
// MicroBatchCursor: the split of a step's global batch over ranks and micro-batches, and the
// step/micro-batch position, shared by every loader. Rank r of W takes rows [r B/W, (r+1) B/W)
// of step s's global batch, in M micro-batches of B/(W M) rows, so the global batch of a step is
// the same at any world size and one process on it is the reference the ranks must equal.
//
// Which sample a global row of a step reads is shared too: an epoch visits the samples in order,
// or (shuffle) in a permutation keyed by seed and epoch only, never by rank or world size.
//
// A Loader derives from MicroBatchCursor<Loader, Batch> and provides
//   config_                            with global_batch, world_size, rank, micro_batches,
//                                      shuffle, seed
//   samples()                          samples per epoch's source
//   rows_of(step, first_row, rows)     -> Batch (global rows [first_row, first_row + rows))
//   static constexpr const char* loader_name  ("DataLoader", ...) for messages
// (config_ and rows_of may be private: the cursor is a friend).

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/data/permutation.hpp>
#include <zero/data/token_file.hpp>  // DataError

namespace zero::data {

/// Reads json[key] into field for a loader state's from_json; DataError naming what and the key
/// when it is missing or of the wrong type. An integer field takes only a JSON integer that it
/// can hold (2.5 became 2, and a seed of -1 became 2^64 - 1, without a word).
template <class Field>
void read_state_key(const nlohmann::json& json, const char* what, const char* key, Field& field) {
  expect<DataError>(json.is_object() && json.contains(key), what, ": missing key '", key, "'");
  const nlohmann::json& v = json.at(key);
  if constexpr (std::is_integral_v<Field> && !std::is_same_v<Field, bool>) {
    using Limits = std::numeric_limits<Field>;
    bool fits = false;
    if (v.is_number_unsigned()) {
      fits = v.get<std::uint64_t>() <= static_cast<std::uint64_t>(Limits::max());
    } else if (v.is_number_integer()) {
      const auto x = v.get<std::int64_t>();
      fits = std::is_signed_v<Field> && x >= static_cast<std::int64_t>(Limits::min()) &&
             x <= static_cast<std::int64_t>(Limits::max());
    }
    expect<DataError>(fits, what, ": key '", key, "' must be an integer in [", +Limits::min(), ", ",
                      +Limits::max(), "], got ", v.dump());
    field = v.get<Field>();
  } else {
    try {
      v.get_to(field);
    } catch (const nlohmann::json::exception& e) {
      raise<DataError>(what, ": key '", key, "' has the wrong type: ", e.what());
    }
  }
}

/// The rank/micro-batch split and position of a loader (see the file comment).
template <class Loader, class Batch>
class MicroBatchCursor {
 public:
  /// Whole global batches per epoch; the remaining samples of an epoch are skipped.
  std::int64_t steps_per_epoch() const {
    return loader().samples() / loader().config_.global_batch;
  }
  /// The sample that global row row (in [0, B)) of step uses.
  std::int64_t sample_index(std::int64_t step, std::int64_t row) const {
    const auto& c = loader().config_;
    expect<ConfigError>(steps_per_epoch() > 0, Loader::loader_name, ": ", loader().samples(),
                        " samples, fewer than one global batch of ", c.global_batch);
    expect<ConfigError>(step >= 0, Loader::loader_name, "::sample_index: step ", step,
                        " is negative");
    expect<ConfigError>(row >= 0 && row < c.global_batch, Loader::loader_name,
                        "::sample_index: row ", row, " is outside [0, global_batch ",
                        c.global_batch, ")");
    const std::int64_t epoch = step / steps_per_epoch();
    const std::int64_t position = (step % steps_per_epoch()) * c.global_batch + row;
    if (!c.shuffle) return position;
    const std::uint64_t key = CounterRng::mix(CounterRng::key_for(c.seed, "zero.data.shuffle") ^
                                              CounterRng::mix(static_cast<std::uint64_t>(epoch)));
    const CounterPermutation permutation(static_cast<std::uint64_t>(loader().samples()), key);
    return static_cast<std::int64_t>(permutation(static_cast<std::uint64_t>(position)));
  }
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
  /// Throws ConfigError naming the field when the split does not work: B and M positive, the
  /// rank inside W, B divisible by W and B/W by M.
  void check_split() const {
    const auto& c = loader().config_;
    const char* name = Loader::loader_name;
    expect<ConfigError>(c.global_batch > 0, name, ": global_batch = ", c.global_batch,
                        "; expected > 0");
    expect<ConfigError>(c.world_size > 0 && c.rank >= 0 && c.rank < c.world_size, name, ": rank ",
                        c.rank, " is outside world_size ", c.world_size);
    expect<ConfigError>(c.micro_batches > 0, name, ": micro_batches = ", c.micro_batches,
                        "; expected > 0");
    expect<ConfigError>(c.global_batch % c.world_size == 0, name, ": global_batch ", c.global_batch,
                        " is not divisible by world_size ", c.world_size,
                        "; every rank must get the same number of rows");
    expect<ConfigError>((c.global_batch / c.world_size) % c.micro_batches == 0, name, ": the ",
                        c.global_batch / c.world_size, " rows per rank (global_batch ",
                        c.global_batch, " / world_size ", c.world_size,
                        ") are not divisible by micro_batches ", c.micro_batches);
  }
  /// Continues at (step, micro) of a state saved with world_size and micro_batches: those may
  /// differ from this loader's only at a step boundary (DataError otherwise).
  void restore_position(std::int64_t step, int micro, int world_size, int micro_batches) {
    const auto& c = loader().config_;
    expect<DataError>(step >= 0 && micro >= 0, Loader::loader_name, "::restore: negative position");
    if (micro != 0) {  // mid-step positions count this rank's micro-batches
      expect_same("world_size (mid-step)", world_size, c.world_size);
      expect_same("micro_batches (mid-step)", micro_batches, c.micro_batches);
      expect<DataError>(micro < c.micro_batches, Loader::loader_name, "::restore: micro-batch ",
                        micro, " is outside [0, ", c.micro_batches, ")");
    }
    step_ = step;
    micro_ = micro;
  }
  /// DataError naming key when a saved setting differs from this loader's.
  template <class V>
  static void expect_same(const char* key, const V& saved, const V& now) {
    expect<DataError>(saved == now, Loader::loader_name, "::restore: the state was saved with ",
                      key, " = ", saved, " but this loader has ", key, " = ", now);
  }

  std::int64_t step_ = 0;  ///< the step of the next micro-batch
  int micro_ = 0;          ///< its micro-batch index

 private:
  const Loader& loader() const { return static_cast<const Loader&>(*this); }
};

}  // namespace zero::data
