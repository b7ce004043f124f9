#pragma once
// The bridge from the engine's flat unit shards (engine/partition.hpp) to checkpoint segments.
// Rank r's shard of a unit holds pieces of several parameters (UnitPartition::segments); each
// piece is one checkpoint Segment of the logical tensor "<parameter name><suffix>": suffix ""
// for the fp32 master, "/exp_avg" and "/exp_avg_sq" for Adam's states, and so on. Loading fills
// a shard of any other partition (world size, alignment) from the logical tensors and zeroes
// its padding, which is what makes a resume at another world size or stage work.
// A parameter that is a tensor-parallel part of a logical tensor (ParamSpec::split) is stored as
// the runs of the logical tensor it covers, so a checkpoint is the same logical tensors whatever
// the tensor-parallel size, and loads at any other. A parameter whose rows past rows_in_use are
// padding (a token table padded for a tensor-parallel size) loads from a stored tensor with
// another number of rows when the checkpoint recorded the same rows in use (the engine state's
// rows_in_use_key, written by the save): the rows both hold are read and the parameter's rows
// past the stored ones are zero, so a table padded for tp 2 resumes at tp 4. A recorded count
// that differs is another vocabulary, refused whatever the shapes; a checkpoint without the
// record loads only the same shape.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/checkpoint/export_safetensors.hpp>
#include <zero/checkpoint/reader.hpp>
#include <zero/checkpoint/segment.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/partition.hpp>
#include <zero/io/element_conversion.hpp>
#include <zero/io/safetensors_header.hpp>
#include <zero/nn/param.hpp>

namespace zero::checkpoint {

/// The logical tensors "<name><suffix>" of a unit's parameters, stored as T.
template <class T>
std::vector<TensorSpec> unit_tensor_specs(const std::vector<nn::ParamSpec>& params,
                                          std::string_view suffix = "") {
  std::vector<TensorSpec> out;
  for (const nn::ParamSpec& p : params) {
    out.push_back({p.name + std::string(suffix), dtype_of<T>, io::extents_of(p.logical_shape())});
  }
  return out;
}

namespace detail {

/// fn(tensor name, first logical element, position in the shard, count) for each contiguous run
/// of a logical tensor in rank's shard of a unit, in shard order (see unit_segments).
template <class Fn>
void for_each_shard_run(const std::vector<nn::ParamSpec>& params,
                        const engine::UnitPartition& partition, int rank, std::string_view suffix,
                        bool whole_params, Fn&& fn) {
  for (const engine::ShardSegment& s : partition.segments(rank)) {
    const nn::ParamSpec& p = params[static_cast<std::size_t>(s.param)];
    if (!whole_params && !p.split.is_split()) continue;
    const std::string name = p.name + std::string(suffix);
    p.for_each_run(s.param_offset, s.count,
                   [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
                     fn(name, logical, s.shard_offset + held - s.param_offset, count);
                   });
  }
}

}  // namespace detail

/// The segments of rank's shard (shard_numel elements of partition) of a unit, one per
/// contiguous run of a logical tensor, viewing shard's memory (which must outlive the save).
/// whole_params false leaves out the parameters that are not split (a tensor-parallel rank
/// other than 0: tp rank 0 saves the copies every tp rank holds).
template <class T>
std::vector<Segment> unit_segments(const std::vector<nn::ParamSpec>& params,
                                   const engine::UnitPartition& partition, int rank,
                                   std::span<const T> shard, std::string_view suffix = "",
                                   bool whole_params = true) {
  expect<ShapeError>(static_cast<std::int64_t>(shard.size()) == partition.shard_numel(),
                     "unit_segments: the shard holds ", shard.size(),
                     " elements but the partition's shards hold ", partition.shard_numel());
  std::vector<Segment> out;
  detail::for_each_shard_run(
      params, partition, rank, suffix, whole_params,
      [&](const std::string& name, std::int64_t logical, std::int64_t at, std::int64_t count) {
        out.push_back(segment_of(
            name, logical,
            shard.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(count))));
      });
  return out;
}

/// The shapes of unit_segments' segments (T elements), without a shard: what a streamed save
/// declares before the shard's data is read.
template <class T>
std::vector<SegmentShape> unit_segment_shapes(const std::vector<nn::ParamSpec>& params,
                                              const engine::UnitPartition& partition, int rank,
                                              std::string_view suffix = "",
                                              bool whole_params = true) {
  std::vector<SegmentShape> out;
  detail::for_each_shard_run(
      params, partition, rank, suffix, whole_params,
      [&](const std::string& name, std::int64_t logical, std::int64_t, std::int64_t count) {
        out.push_back({name, logical, dtype_of<T>, count});
      });
  return out;
}

/// The engine-state key under which a save records the rows in use of its parameters that
/// declare them ({"<parameter name>": rows}; see the file comment).
inline constexpr const char* rows_in_use_key = "rows_in_use";

/// {"<name>": rows_in_use} for the parameters of specs that declare their rows in use.
inline nlohmann::json rows_in_use_record(const std::vector<nn::ParamSpec>& specs) {
  nlohmann::json out = nlohmann::json::object();
  for (const nn::ParamSpec& p : specs) {
    if (p.rows_in_use > 0) out[p.name] = p.rows_in_use;
  }
  return out;
}

/// The parameter a checkpoint tensor belongs to: its name up to the first '/' (the master is
/// "<parameter name>", its optimizer states "<parameter name>/exp_avg" and so on).
inline std::string_view parameter_of(std::string_view tensor_name) {
  return tensor_name.substr(0, tensor_name.find('/'));
}

/// The rows in use the checkpoint recorded for parameter `name`; 0 when it recorded none (a
/// checkpoint saved before the record, or a parameter that declares none).
inline std::int64_t stored_rows_in_use(const Reader& reader, const std::string& name) {
  const nlohmann::json& engine = reader.engine_state();
  if (!engine.is_object()) return 0;
  const auto record = engine.find(rows_in_use_key);
  if (record == engine.end() || !record->is_object()) return 0;
  const auto rows = record->find(name);
  return rows != record->end() && rows->is_number_integer() ? rows->get<std::int64_t>() : 0;
}

/// The export's row limit (ExportOptions::leading_rows) that drops a table's padding: every
/// tensor of a parameter whose rows in use the checkpoint recorded (the master and its optimizer
/// states) keeps those rows; the others keep all theirs. A table padded for tensor parallelism
/// (GPT-2's 50257 tokens stored as 50258 rows at tp 2) is written as its vocabulary's rows.
/// The limit reads `reader`, which must outlive it.
inline RowLimit recorded_rows_limit(const Reader& reader) {
  return [&reader](std::string_view name) -> std::optional<std::int64_t> {
    const std::int64_t rows = stored_rows_in_use(reader, std::string(parameter_of(name)));
    if (rows <= 0) return std::nullopt;
    return rows;
  };
}

namespace detail {

/// CheckpointError naming tensor `name` (parameter p's, or one of its states) of the checkpoint
/// read when stored tensor t does not fill p: another shape, unless p's rows past rows_in_use
/// are padding and the checkpoint recorded the same rows in use (then only the columns must
/// agree, and the stored rows cover those in use); or another recorded count of rows in use.
inline void expect_stored_shape(const Reader& reader, const TensorRecord& t, const nn::ParamSpec& p,
                                const std::string& name) {
  const std::int64_t stored_rows = stored_rows_in_use(reader, p.name);
  expect<CheckpointError>(p.rows_in_use <= 0 || stored_rows <= 0 || stored_rows == p.rows_in_use,
                          "checkpoint '", reader.path().string(), "', tensor '", name,
                          "' comes from a table with ", stored_rows,
                          " rows in use (its vocabulary) but the model's has ", p.rows_in_use,
                          ": saved from another model?");
  const std::vector<std::int64_t> want = io::extents_of(p.logical_shape());
  if (t.shape == want) return;
  const bool same_columns = !want.empty() && t.shape.size() == want.size() &&
                            std::equal(want.begin() + 1, want.end(), t.shape.begin() + 1);
  if (p.rows_in_use > 0 && stored_rows == p.rows_in_use && same_columns &&
      t.shape[0] >= p.rows_in_use) {
    return;  // another padding of the same vocabulary
  }
  const bool unrecorded = p.rows_in_use > 0 && stored_rows <= 0 && same_columns;
  raise<CheckpointError>(
      "checkpoint '", reader.path().string(), "', tensor '", name, "' has shape ", t.describe(),
      " but the model's parameter has ",
      io::TensorInfo{"", t.dtype, io::extents_of(p.logical_shape()), 0, 0}.shape_string(),
      unrecorded ? " (the checkpoint does not record the table's rows in use, so another "
                   "padding of it cannot be told from another vocabulary)"
                 : "");
}

}  // namespace detail

/// Checks, from the index alone (no data read), that the checkpoint holds "<name><suffix>" for
/// every parameter in a shape that fills it (the parameter's logical shape, or another padding
/// of its rows: see the file comment); CheckpointError naming the first that does not
/// (missing_hint follows a missing name's message).
inline void expect_unit_tensors(const Reader& reader, const std::vector<nn::ParamSpec>& params,
                                std::string_view suffix, std::string_view missing_hint = "") {
  for (const nn::ParamSpec& p : params) {
    const std::string name = p.name + std::string(suffix);
    expect<CheckpointError>(reader.contains(name), "checkpoint '", reader.path().string(),
                            "' has no tensor '", name, "'", missing_hint);
    detail::expect_stored_shape(reader, reader.tensor(name), p, name);
  }
}

/// Fills rank's shard of a unit under partition (any world size) from the checkpoint's
/// logical tensors "<name><suffix>", converting dtypes as rule allows; padding is zeroed, and so
/// are a parameter's rows past those of a stored tensor padded otherwise (see the file comment).
template <class T>
void read_unit_shard(const Reader& reader, const std::vector<nn::ParamSpec>& params,
                     const engine::UnitPartition& partition, int rank, std::span<T> shard,
                     std::string_view suffix = "", io::DTypeRule rule = io::DTypeRule::exact) {
  expect<ShapeError>(static_cast<std::int64_t>(shard.size()) == partition.shard_numel(),
                     "read_unit_shard: the shard holds ", shard.size(),
                     " elements but the partition's shards hold ", partition.shard_numel());
  std::fill(shard.begin(), shard.end(), convert<T>(0.0));
  for (const engine::ShardSegment& s : partition.segments(rank)) {
    const nn::ParamSpec& p = params[static_cast<std::size_t>(s.param)];
    const std::string name = p.name + std::string(suffix);
    const TensorRecord& t = reader.tensor(name);
    detail::expect_stored_shape(reader, t, p, name);
    const std::int64_t stored = t.numel();  // rows past the stored ones stay zero
    p.for_each_run(
        s.param_offset, s.count, [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
          const std::int64_t n = std::clamp<std::int64_t>(stored - logical, 0, count);
          if (n == 0) return;
          reader.read(
              name, logical,
              shard.subspan(static_cast<std::size_t>(s.shard_offset + held - s.param_offset),
                            static_cast<std::size_t>(n)),
              rule);
        });
  }
}

}  // namespace zero::checkpoint
