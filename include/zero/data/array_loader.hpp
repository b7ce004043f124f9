#pragma once
// ArrayLoader: micro-batches of named in-memory arrays (features, labels, masks, images of any
// element type), split over data-parallel ranks by DataLoader's rules. Every array has the same
// number of samples along dimension 0. Step s consumes one global batch of B samples fixed by
// (samples, B, shuffle, seed) alone; rank r of W owns global rows [r*B/W, (r+1)*B/W), cut into
// M micro-batches of B/(W*M) rows, so the ranks' micro-batches concatenated in rank order are
// the global batch and training at any world size sees the single-process reference's data.
// The position (step, micro-batch) saves and restores as JSON, at any world size once a step is
// complete.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/micro_batch_cursor.hpp>
#include <zero/data/permutation.hpp>
#include <zero/data/token_file.hpp>
#include <zero/nn/inputs.hpp>

namespace zero::data {

/// How an ArrayLoader splits its samples (the same rules as LoaderConfig).
struct ArrayLoaderConfig {
  std::int64_t global_batch = 0;  ///< B: samples per optimizer step over all ranks.
  int world_size = 1;             ///< W: data-parallel ranks.
  int rank = 0;                   ///< This rank, in [0, W).
  int micro_batches = 1;          ///< M: gradient-accumulation micro-batches per step.
  bool shuffle = false;           ///< Visit samples in a seeded pseudo-random order per epoch.
  std::uint64_t seed = 0;         ///< Shuffle seed.
};

/// One named array's rows for one micro-batch (owned bytes, typed at run time).
struct ArrayColumn {
  std::string name;              ///< the input name
  DType dtype = DType::f32;      ///< element type
  Shape shape;                   ///< [rows, ...]
  std::vector<std::byte> bytes;  ///< rows * row elements of dtype
};

/// One micro-batch of one rank: the selected rows of every array.
struct ArrayBatch {
  std::int64_t rows = 0;             ///< Rows in this micro-batch.
  std::int64_t step = 0;             ///< Optimizer step it belongs to.
  int micro = 0;                     ///< Micro-batch index within the step.
  std::int64_t first_row = 0;        ///< Global row (within the step's batch) of row 0.
  std::vector<ArrayColumn> columns;  ///< One per array, in the order they were added.

  /// Views of the columns by name (valid while this batch lives).
  nn::Inputs inputs() const {
    nn::Inputs in;
    for (const ArrayColumn& c : columns) in.set_raw(c.name, c.bytes.data(), c.shape, c.dtype);
    return in;
  }
  /// The rows of array name as U; throws nn::InputError when absent or of another dtype.
  template <class U>
  Tensor<const U> get(const std::string& name) const {
    for (const ArrayColumn& c : columns) {
      if (c.name == name) {
        nn::Inputs one;
        one.set_raw(c.name, c.bytes.data(), c.shape, c.dtype);
        return one.get<U>(name);
      }
    }
    return inputs().get<U>(name);  // absent: the error lists what is there
  }
};

/// The position of an ArrayLoader plus what a restore must match (JSON-serialisable).
struct ArrayLoaderState {
  std::int64_t step = 0;          ///< Next step to produce.
  int micro = 0;                  ///< Next micro-batch within that step.
  std::int64_t global_batch = 0;  ///< B when saved.
  std::int64_t samples = 0;       ///< Samples when saved.
  bool shuffle = false;           ///< shuffle when saved.
  std::uint64_t seed = 0;         ///< seed when saved.
  int world_size = 1;             ///< W when saved (matters only mid-step).
  int micro_batches = 1;          ///< M when saved (matters only mid-step).
  /// The arrays when saved, "name:dtype[sample shape]" joined by ';' (empty in a state written
  /// before it was kept: then not checked).
  std::string arrays;

  /// The state as a JSON object.
  nlohmann::json to_json() const {
    return {{"step", step},
            {"micro", micro},
            {"global_batch", global_batch},
            {"samples", samples},
            {"shuffle", shuffle},
            {"seed", seed},
            {"world_size", world_size},
            {"micro_batches", micro_batches},
            {"arrays", arrays}};
  }
  /// Parses a state written by to_json; throws DataError naming a missing or mistyped key.
  static ArrayLoaderState from_json(const nlohmann::json& json) {
    ArrayLoaderState s;
    const auto get = [&](const char* key, auto& field) {
      read_state_key(json, "array loader state", key, field);
    };
    get("step", s.step);
    get("micro", s.micro);
    get("global_batch", s.global_batch);
    get("samples", s.samples);
    get("shuffle", s.shuffle);
    get("seed", s.seed);
    get("world_size", s.world_size);
    get("micro_batches", s.micro_batches);
    if (json.is_object() && json.contains("arrays")) get("arrays", s.arrays);
    return s;
  }
  friend bool operator==(const ArrayLoaderState&, const ArrayLoaderState&) = default;
};

/// Produces this rank's micro-batches of the deterministic global batches of named arrays.
class ArrayLoader : public MicroBatchCursor<ArrayLoader, ArrayBatch> {
 public:
  /// Names the loader in messages.
  static constexpr const char* loader_name = "ArrayLoader";

  /// Checks config; throws ConfigError naming the field (B % W, B/W % M, rank).
  explicit ArrayLoader(ArrayLoaderConfig config) : config_(config) { check_split(); }

  /// Adds the array name: data holds shape.numel() elements, dimension 0 the samples. The first
  /// array fixes the sample count; later ones must match it (DataError otherwise), and the
  /// samples must fill at least one global batch.
  template <class U>
  ArrayLoader& add(std::string name, std::vector<U> data, Shape shape) {
    expect<DataError>(shape.rank() >= 1, "ArrayLoader::add('", name,
                      "'): the shape needs a sample dimension first");
    expect<DataError>(static_cast<std::int64_t>(data.size()) == shape.numel(), "ArrayLoader::add('",
                      name, "'): ", data.size(), " elements do not fill the shape's ",
                      shape.numel());
    for (const Array& a : arrays_) {
      expect<DataError>(a.name != name, "ArrayLoader::add: an array named '", name,
                        "' was already added");
    }
    if (!arrays_.empty()) {
      expect<DataError>(shape[0] == samples_, "ArrayLoader::add('", name, "'): ", shape[0],
                        " samples, but '", arrays_.front().name, "' has ", samples_);
    }
    samples_ = shape[0];
    expect<DataError>(samples_ >= config_.global_batch, "ArrayLoader: '", name, "' has ", samples_,
                      " samples, fewer than one global batch of ", config_.global_batch);
    Array a;
    a.name = std::move(name);
    a.dtype = dtype_of<U>;
    a.shape = shape;
    a.row_bytes = static_cast<std::size_t>(shape.numel() / shape[0]) * sizeof(U);
    a.bytes.resize(data.size() * sizeof(U));
    std::memcpy(a.bytes.data(), data.data(), a.bytes.size());
    arrays_.push_back(std::move(a));
    return *this;
  }

  /// The configuration.
  const ArrayLoaderConfig& config() const { return config_; }
  /// Samples per array.
  std::int64_t samples() const { return samples_; }
  /// Global rows [first_row, first_row + rows) of step.
  ArrayBatch rows_of(std::int64_t step, std::int64_t first_row, std::int64_t rows) const {
    ArrayBatch b;
    b.rows = rows;
    b.step = step;
    b.first_row = first_row;
    std::vector<std::int64_t> samples(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r)
      samples[static_cast<std::size_t>(r)] = sample_index(step, first_row + r);
    for (const Array& a : arrays_) {
      ArrayColumn c;
      c.name = a.name;
      c.dtype = a.dtype;
      c.shape = a.shape.with_extent(0, rows);
      c.bytes.resize(static_cast<std::size_t>(rows) * a.row_bytes);
      for (std::int64_t r = 0; r < rows; ++r) {
        std::memcpy(
            c.bytes.data() + static_cast<std::size_t>(r) * a.row_bytes,
            a.bytes.data() +
                static_cast<std::size_t>(samples[static_cast<std::size_t>(r)]) * a.row_bytes,
            a.row_bytes);
      }
      b.columns.push_back(std::move(c));
    }
    return b;
  }

  /// The current position and the settings a restore must match.
  ArrayLoaderState state() const {
    return {step_,           micro_,       config_.global_batch, samples_,
            config_.shuffle, config_.seed, config_.world_size,   config_.micro_batches,
            arrays_text()};
  }

  /// Continues from s. B, the sample count, the arrays (names, dtypes, sample shapes), shuffle
  /// and seed must match; world size and micro-batches may differ when s is at a step boundary.
  /// Throws DataError naming the first setting that differs.
  void restore(const ArrayLoaderState& s) {
    expect_same("global_batch", s.global_batch, config_.global_batch);
    expect_same("samples", s.samples, samples_);
    if (!s.arrays.empty()) expect_same("arrays", s.arrays, arrays_text());
    expect_same("shuffle", s.shuffle, config_.shuffle);
    expect_same("seed", s.seed, config_.seed);
    restore_position(s.step, s.micro, s.world_size, s.micro_batches);
  }

 private:
  friend class MicroBatchCursor<ArrayLoader, ArrayBatch>;
  struct Array {
    std::string name;
    DType dtype = DType::f32;
    Shape shape;
    std::size_t row_bytes = 0;
    std::vector<std::byte> bytes;
  };

  // Each array as "name:dtype[sample shape]", joined by ';'.
  std::string arrays_text() const {
    std::string text;
    for (const Array& a : arrays_) {
      text += (text.empty() ? "" : ";") + a.name + ":" + std::string(name_of(a.dtype)) +
              a.shape.drop_front().to_string();
    }
    return text;
  }

  ArrayLoaderConfig config_;
  std::vector<Array> arrays_;
  std::int64_t samples_ = 0;
};

}  // namespace zero::data
