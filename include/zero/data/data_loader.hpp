#pragma once
// DataLoader: language-model batches from a token file, split over data-parallel ranks.
// The unit of data is a sample: sample k is tokens [k*T, k*T + T + 1), giving inputs
// [k*T, k*T + T) and targets shifted by one (llm.c's windows). Step s of training consumes one
// global batch of B samples, fixed by (file, B, T, shuffle, seed) alone: the world size only
// decides who reads which rows. Rank r of W owns global rows [r*B/W, (r+1)*B/W), cut into M
// micro-batches of B/(W*M) rows for gradient accumulation, so the ranks' micro-batches
// concatenated in rank order are the global batch, and training at any world size sees the same
// data as the single-process reference. The position is (step, micro-batch): a small state that
// restores at any world size once a step is complete.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/data/micro_batch_cursor.hpp>
#include <zero/data/permutation.hpp>
#include <zero/data/token_file.hpp>
#include <zero/nn/inputs.hpp>

namespace zero::data {

/// What a DataLoader produces and how it splits it.
struct LoaderConfig {
  std::int64_t global_batch =
      0;                        ///< B: samples per optimizer step over all ranks and micro-batches.
  std::int64_t seq_len = 0;     ///< T: tokens per sample.
  int world_size = 1;           ///< W: data-parallel ranks.
  int rank = 0;                 ///< This rank, in [0, W).
  int micro_batches = 1;        ///< M: gradient-accumulation micro-batches per step.
  bool shuffle = false;         ///< Visit samples in a seeded pseudo-random order per epoch.
  std::uint64_t seed = 0;       ///< Shuffle seed.
  std::int64_t vocab_size = 0;  ///< When positive, tokens outside [0, vocab_size) are errors.
};

/// One micro-batch of one rank: inputs and targets [rows, seq_len] of int32 token ids.
struct Batch {
  std::int64_t rows = 0;              ///< Rows in this micro-batch.
  std::int64_t seq_len = 0;           ///< T.
  std::int64_t step = 0;              ///< Optimizer step it belongs to.
  int micro = 0;                      ///< Micro-batch index within the step, in [0, M).
  std::int64_t first_row = 0;         ///< Global row (within the step's global batch) of row 0.
  std::vector<std::int32_t> inputs;   ///< rows * seq_len tokens, row-major.
  std::vector<std::int32_t> targets;  ///< inputs shifted left by one token.

  /// inputs as a [rows, seq_len] tensor.
  Tensor<const std::int32_t> input_tensor() const { return {inputs.data(), Shape{rows, seq_len}}; }
  /// targets as a [rows, seq_len] tensor.
  Tensor<const std::int32_t> target_tensor() const {
    return {targets.data(), Shape{rows, seq_len}};
  }
  /// The batch as named micro-batch inputs "tokens" and "targets" ([rows, seq_len] i32 views,
  /// valid while this batch lives), for layer models that read them by name.
  nn::Inputs named_inputs() const {
    nn::Inputs in;
    in.set("tokens", input_tensor()).set("targets", target_tensor());
    return in;
  }
};

/// A 64-bit digest of a token file: its size and its first and last 1024 tokens (so it costs
/// the same for any file size). Never 0, which marks a state saved without one.
inline std::uint64_t token_fingerprint(const TokenFile& tokens) {
  const std::int64_t n = tokens.size(), edge = std::min<std::int64_t>(n, 1024);
  std::vector<std::int32_t> buffer(static_cast<std::size_t>(edge));
  std::uint64_t h = CounterRng::mix(static_cast<std::uint64_t>(n));
  for (const std::int64_t first : {std::int64_t{0}, n - edge}) {
    tokens.copy(first, buffer);
    for (const std::int32_t t : buffer) {
      h = CounterRng::mix(h ^ static_cast<std::uint32_t>(t));
    }
  }
  return h == 0 ? 1 : h;
}

/// A loader's position plus what it must match on restore (a JSON-serialisable struct).
struct LoaderState {
  std::int64_t step = 0;          ///< Next step to produce.
  int micro = 0;                  ///< Next micro-batch within that step.
  std::int64_t global_batch = 0;  ///< B when saved.
  std::int64_t seq_len = 0;       ///< T when saved.
  bool shuffle = false;           ///< shuffle when saved.
  std::uint64_t seed = 0;         ///< seed when saved.
  std::int64_t num_tokens = 0;    ///< Tokens in the file when saved.
  /// token_fingerprint of the file when saved; 0 in a state written before it was kept.
  std::uint64_t fingerprint = 0;
  int world_size = 1;     ///< W when saved (matters only mid-step).
  int micro_batches = 1;  ///< M when saved (matters only mid-step).

  /// The state as a JSON object.
  nlohmann::json to_json() const {
    return {{"step", step},
            {"micro", micro},
            {"global_batch", global_batch},
            {"seq_len", seq_len},
            {"shuffle", shuffle},
            {"seed", seed},
            {"num_tokens", num_tokens},
            {"fingerprint", fingerprint},
            {"world_size", world_size},
            {"micro_batches", micro_batches}};
  }
  /// Parses a state written by to_json; throws DataError naming a missing or mistyped key.
  static LoaderState from_json(const nlohmann::json& json) {
    LoaderState s;
    const auto get = [&](const char* key, auto& field) {
      read_state_key(json, "loader state", key, field);
    };
    get("step", s.step);
    get("micro", s.micro);
    get("global_batch", s.global_batch);
    get("seq_len", s.seq_len);
    get("shuffle", s.shuffle);
    get("seed", s.seed);
    get("num_tokens", s.num_tokens);
    if (json.is_object() && json.contains("fingerprint")) get("fingerprint", s.fingerprint);
    get("world_size", s.world_size);
    get("micro_batches", s.micro_batches);
    return s;
  }
  friend bool operator==(const LoaderState&, const LoaderState&) = default;
};

/// Produces this rank's micro-batches of the deterministic global batches of a token file.
class DataLoader : public MicroBatchCursor<DataLoader, Batch> {
 public:
  /// Names the loader in messages.
  static constexpr const char* loader_name = "DataLoader";

  /// Checks config against tokens; throws ConfigError naming the field (B % W, B/W % M, rank)
  /// or DataError when the file holds less than one global batch.
  DataLoader(std::shared_ptr<const TokenFile> tokens, LoaderConfig config)
      : tokens_(std::move(tokens)), config_(config) {
    expect<ConfigError>(tokens_ != nullptr, "DataLoader: no token file");
    const auto& c = config_;
    expect<ConfigError>(c.seq_len > 0, "DataLoader: seq_len = ", c.seq_len, "; expected > 0");
    check_split();
    samples_ = tokens_->size() > 0 ? (tokens_->size() - 1) / c.seq_len : 0;
    expect<DataError>(samples_ >= c.global_batch, "DataLoader: token file '", tokens_->name(),
                      "' has ", tokens_->size(), " tokens, i.e. ", samples_,
                      " samples of seq_len + 1 = ", c.seq_len + 1,
                      " tokens (consecutive samples share one: (tokens - 1) / seq_len), fewer "
                      "than one global batch of ",
                      c.global_batch);
  }

  /// The configuration.
  const LoaderConfig& config() const { return config_; }
  /// The token source.
  const TokenFile& tokens() const { return *tokens_; }
  /// Number of samples in the file: (tokens - 1) / seq_len.
  std::int64_t samples() const { return samples_; }
  /// Global rows [first_row, first_row + rows) of step as a batch.
  Batch rows_of(std::int64_t step, std::int64_t first_row, std::int64_t rows) const {
    const std::int64_t T = config_.seq_len;
    Batch b;
    b.rows = rows;
    b.seq_len = T;
    b.step = step;
    b.first_row = first_row;
    b.inputs.resize(static_cast<std::size_t>(rows * T));
    b.targets.resize(static_cast<std::size_t>(rows * T));
    std::vector<std::int32_t> window(static_cast<std::size_t>(T + 1));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t sample = sample_index(step, first_row + r);
      tokens_->copy(sample * T, window);
      if (config_.vocab_size > 0) check_vocab(window, sample * T);
      std::copy(window.begin(), window.end() - 1, b.inputs.begin() + r * T);
      std::copy(window.begin() + 1, window.end(), b.targets.begin() + r * T);
    }
    return b;
  }

  /// The current position and the settings a restore must match.
  LoaderState state() const {
    LoaderState s;
    s.step = step_;
    s.micro = micro_;
    s.global_batch = config_.global_batch;
    s.seq_len = config_.seq_len;
    s.shuffle = config_.shuffle;
    s.seed = config_.seed;
    s.num_tokens = tokens_->size();
    s.fingerprint = token_fingerprint(*tokens_);
    s.world_size = config_.world_size;
    s.micro_batches = config_.micro_batches;
    return s;
  }

  /// Continues from state. The data settings (B, T, shuffle, seed, token count and fingerprint)
  /// must match; world size and micro-batches may differ when the state is at a step boundary.
  /// Throws DataError naming the first setting that differs.
  void restore(const LoaderState& s) {
    expect_same("global_batch", s.global_batch, config_.global_batch);
    expect_same("seq_len", s.seq_len, config_.seq_len);
    expect_same("shuffle", s.shuffle, config_.shuffle);
    expect_same("seed", s.seed, config_.seed);
    expect_same("num_tokens", s.num_tokens, tokens_->size());
    // Shards of one corpus often have the same size (llm.c's FineWeb shards do): the tokens at
    // the file's ends tell them apart.
    if (s.fingerprint != 0) expect_same("fingerprint", s.fingerprint, token_fingerprint(*tokens_));
    restore_position(s.step, s.micro, s.world_size, s.micro_batches);
  }

 private:
  friend class MicroBatchCursor<DataLoader, Batch>;
  void check_vocab(std::span<const std::int32_t> window, std::int64_t first) const {
    for (std::size_t i = 0; i < window.size(); ++i) {
      expect<DataError>(window[i] >= 0 && window[i] < config_.vocab_size, "token file '",
                        tokens_->name(), "': token ", first + static_cast<std::int64_t>(i), " = ",
                        window[i], " is outside the vocabulary [0, ", config_.vocab_size, ")");
    }
  }

  std::shared_ptr<const TokenFile> tokens_;
  LoaderConfig config_;
  std::int64_t samples_ = 0;
};

}  // namespace zero::data
