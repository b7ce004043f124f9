#pragma once
// Model weights between a live engine and a Hugging Face safetensors file, in the layout of a
// model family: io::gpt2::Layout (GPT-2: Conv1D weights transposed) or io::llama::Layout
// (Llama: q/k/v and gate/up projections packed into nn::LayerLlama's qkv_proj and gate_up_proj).
// load_gpt2_weights/save_gpt2_weights and load_llama_weights/save_llama_weights are
// load_hf_weights/save_hf_weights with their family's layout.
//
// load_hf_weights starts training from a file, empty-then-shard: each rank reads only the
// element ranges of the parameters its master slice holds (a layout that must read a tensor
// whole for any range of it, GPT-2's Conv1D weights, reads one tensor at a time), so at stage 3
// no rank ever holds the whole model. The optimizer states stay fresh; counters are untouched.
//
// save_hf_weights exports the master weights, streamed unit by unit: the ranks all-gather one
// unit's master values at a time and rank 0 appends that unit's tensors (as the layout stores
// them: Conv1D weights transposed to [in, out], packed projections as their file tensors; values
// converted to the file's dtype) to a safetensors file whose header was written first. Memory on
// every rank: one unit's master values (the largest unit; for GPT-2 the embedding unit, wte +
// wpe) plus, on rank 0, one Conv1D weight's transpose and a conversion staging buffer; never the
// whole model. The file appears only when complete (temporary name, fsync, rename); any failure
// on rank 0 is raised on every rank.
//
// With tensor parallelism (ParamSpec::split) a rank imports only the runs of the logical tensors
// its parts cover (a tensor the layout reads whole is read once per piece, then its runs
// picked), and the export all-gathers each unit's parts over the tensor-parallel group and
// writes whole tensors.
//
// A model whose vocabulary tables are padded past the vocabulary (Megatron pads them to a
// multiple of the tensor-parallel size, so every rank holds an equal slice) passes vocab_size,
// the real tokens: the file's tables (the layout's is_vocabulary_table: GPT-2's
// transformer.wte.weight) have vocab_size rows, the import leaves the padding rows zero and the
// export writes the first vocab_size rows, so the file is the family's whatever the padding (and
// loads at another tp). Without vocab_size a table's own count is used: its rows in use
// (ParamSpec::rows_in_use, nn::GPT's vocabulary), else all its rows.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zero/engine/engine_checkpoint.hpp>
#include <zero/engine/engine_groups.hpp>
#include <zero/io/gpt2_layout.hpp>
#include <zero/io/llama_layout.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_shards.hpp>
#include <zero/io/safetensors_writer.hpp>
#include <zero/nn/llama_config.hpp>

namespace zero::engine {

namespace detail {

/// The shape parameter p has in a file of layout when the model's vocabulary is vocab_size tokens
/// (0: the table's rows in use, else its rows): a vocabulary table's first vocab_size rows, else
/// p's logical shape. Throws ConfigError when vocab_size is more than the table's rows.
template <class Layout>
Shape hf_file_shape(const Layout& layout, const nn::ParamSpec& p, std::int64_t vocab_size,
                    std::string_view who) {
  const Shape whole = p.logical_shape();
  if (!layout.is_vocabulary_table(p.name)) return whole;
  if (vocab_size <= 0) vocab_size = p.rows_in_use;
  if (vocab_size <= 0) return whole;
  expect<ConfigError>(vocab_size <= whole[0], who, ": vocab_size ", vocab_size,
                      " is more than the ", whole[0], " rows of '", p.name, "'");
  return Shape{vocab_size, whole[1]};
}

/// load_hf_weights' pass over the master slices: each rank fills its own from reader (a
/// vocabulary table's rows from vocab_size on, padding, stay zero).
template <class State, class Layout>
void import_hf_masters(State& state, const Layout& layout, const io::SafetensorsShards& reader,
                       std::int64_t vocab_size, std::string_view who) {
  using MasterT = typename State::MasterT;
  state.for_each_master(StateAccess::update, [&](int u, std::span<MasterT> slice) {
    const auto& specs = state.unit_specs(u);
    std::fill(slice.begin(), slice.end(), MasterT{});
    state.for_each_owned_shard(u, slice, ShardUse::fill, [&](int r, std::span<MasterT> shard) {
      for (const ShardSegment& s : state.partition(u).segments(r)) {
        const nn::ParamSpec& p = specs[static_cast<std::size_t>(s.param)];
        MasterT* base = shard.data() + s.shard_offset - s.param_offset;
        if (p.split.is_split() && layout.reads_whole(p.name)) {
          const Shape whole = p.logical_shape();
          std::vector<MasterT> values(static_cast<std::size_t>(whole.numel()));
          layout.import_range(reader, p.name, whole, 0,
                              Tensor<MasterT>(values.data(), Shape{whole.numel()}),
                              io::DTypeRule::convert);
          p.for_each_run(s.param_offset, s.count,
                         [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
                           std::copy_n(values.begin() + logical, count, base + held);
                         });
          continue;
        }
        const Shape stored = hf_file_shape(layout, p, vocab_size, who);
        const std::int64_t in_file = stored.numel();  // the logical elements the file holds
        p.for_each_run(
            s.param_offset, s.count,
            [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
              const std::int64_t n = std::clamp<std::int64_t>(in_file - logical, 0, count);
              if (n == 0) return;  // padding rows: zero
              layout.import_range(reader, p.name, stored, logical,
                                  Tensor<MasterT>(base + held, Shape{n}), io::DTypeRule::convert);
            });
      }
    });
  });
}
}  // namespace detail

/// Overwrites eng's master slices with the weights of a Hugging Face safetensors file (any
/// float dtype) in layout's form; who names the call in messages. file is one safetensors file,
/// the index of a sharded checkpoint ("model.safetensors.index.json": each rank opens every
/// shard and reads its ranges from the files that hold them), or a directory holding either
/// (io::SafetensorsShards). A collective: every rank calls
/// it between steps, and a failure on any rank (a file it cannot read, a missing or malformed
/// tensor) is thrown on every rank, as load_checkpoint does; one after any rank changed a slice
/// leaves the engine refusing to train until a checkpoint loads. It replaces the masters only, so
/// an engine already inconsistent (a step that stopped part-way) stays so. vocab_size (0: a
/// table's rows in use, else its rows) is the vocabulary of a model whose vocabulary tables are
/// padded past it (see the file comment).
template <class Eng, class Layout>
void load_hf_weights(Eng& eng, const std::filesystem::path& file, const Layout& layout,
                     std::int64_t vocab_size = 0, std::string_view who = "load_hf_weights") {
  auto state = eng.state();
  state.require_between_steps(std::string(who));
  state.synchronize();
  load_agreed(state, std::string(who), file.string(), false, [&](bool& touched) {
    const io::SafetensorsShards reader(file);
    touched = true;
    detail::import_hf_masters(state, layout, reader, vocab_size, who);
  });
}

/// load_hf_weights from a Hugging Face GPT-2 file (io::gpt2::Layout).
template <class Eng>
void load_gpt2_weights(Eng& eng, const std::filesystem::path& file, std::int64_t vocab_size = 0) {
  load_hf_weights(eng, file, io::gpt2::Layout{}, vocab_size, "load_gpt2_weights");
}

/// load_hf_weights from a Hugging Face Llama file (LlamaForCausalLM; io::llama::Layout of cfg's
/// heads) into an engine over nn::LayerLlama(cfg).
template <class Eng>
void load_llama_weights(Eng& eng, const std::filesystem::path& file, const nn::LlamaConfig& cfg) {
  load_hf_weights(eng, file, io::llama::Layout(cfg.num_heads, cfg.num_kv_heads, cfg.head_size()), 0,
                  "load_llama_weights");
}

/// What save_hf_weights wrote.
struct WeightsExport {
  std::uint64_t bytes = 0;          ///< size of the files, index included (0 where this rank
                                    ///< cannot see them)
  std::size_t files = 0;            ///< safetensors files: 1, or the shards of an index
  std::size_t tensors = 0;          ///< tensors written (the file's: a packed parameter's parts)
  std::size_t peak_unit_bytes = 0;  ///< the largest unit's gathered master values, per rank
};

/// Writes eng's master weights to a Hugging Face safetensors file in layout's form, in dtype
/// f32, bf16 or f16, streamed unit by unit as the file comment says; who names the call in
/// messages. A collective: every rank calls it between steps. Throws CheckpointError on every
/// rank when the file cannot be written (and no file appears). vocab_size (0: a table's rows in
/// use, else its rows) is the vocabulary of a model whose vocabulary tables are padded past it:
/// only its rows are written. max_shard_bytes (0: no limit) splits the tensors into files of at
/// most that much data, as save_pretrained's max_shard_size: file "model.safetensors" becomes
/// model-00001-of-0000N.safetensors ... beside model.safetensors.index.json
/// (io::SafetensorsShardWriter), which load_hf_weights reads back.
template <class Eng, class Layout>
WeightsExport save_hf_weights(Eng& eng, const std::filesystem::path& file, const Layout& layout,
                              DType dtype = DType::f32, std::int64_t vocab_size = 0,
                              std::string_view who = "save_hf_weights",
                              std::uint64_t max_shard_bytes = 0) {
  using MasterT = typename Eng::MasterT;
  eng.state().require_between_steps(std::string(who) + "('" + file.string() + "')");
  expect<CheckpointError>(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, who,
                          "('", file.string(), "'): dtype must be f32, bf16 ", "or f16, not ",
                          name_of(dtype));
  eng.synchronize();
  WeightsExport result;
  std::optional<io::SafetensorsShardWriter> writer;
  std::string error;  // rank 0's first failure; the gathers still run so no rank is left waiting
  auto attempt = [&](auto&& fn) {
    if (!error.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  auto& groups = eng.groups();
  expect<CheckpointError>(groups.ep == 1, who, "('", file.string(),
                          "'): the experts are split over ", groups.ep,
                          " expert-parallel ranks; save a checkpoint and convert it with "
                          "zero_to_safetensors instead");
  // Each pipeline stage holds its own units (rank 0 of every stage would write the same file
  // with its stage's tensors only, and the last rename would win).
  expect<CheckpointError>(!groups.pp, who, "('", file.string(), "'): the units are split over ",
                          groups.pp ? groups.pp->size() : 1,
                          " pipeline stages; save a checkpoint and convert it with "
                          "zero_to_safetensors instead");
  for (int u = 0; u < eng.num_units(); ++u) {  // every rank refuses a bad vocab_size alike
    for (const nn::ParamSpec& p : eng.unit_specs(u)) {
      (void)detail::hf_file_shape(layout, p, vocab_size, who);
    }
  }
  const bool writes = eng.rank() == 0 && groups.tp_rank() == 0;
  if (writes) {
    attempt([&] {
      std::vector<io::TensorDecl> decls;
      for (int u = 0; u < eng.num_units(); ++u) {
        for (const nn::ParamSpec& p : eng.unit_specs(u)) {
          for (io::TensorDecl& d : layout.export_decls(
                   p.name, dtype, detail::hf_file_shape(layout, p, vocab_size, who))) {
            decls.push_back(std::move(d));
          }
        }
      }
      writer.emplace(file, decls, std::map<std::string, std::string>{{"format", "pt"}},
                     max_shard_bytes);
    });
  }
  for (int u = 0; u < eng.num_units(); ++u) {
    std::vector<MasterT> values = eng.gather_unit_values(u);
    const int tp = groups.tp_size();
    if (tp > 1) {  // every tensor-parallel rank's parts of the unit, rank-major
      std::vector<MasterT> parts(values.size() * static_cast<std::size_t>(tp));
      eng.state()
          .host_values(*groups.tp)
          .all_gather(std::span<const MasterT>(values), std::span<MasterT>(parts));
      values = std::move(parts);
    }
    result.peak_unit_bytes = std::max(result.peak_unit_bytes, values.size() * sizeof(MasterT));
    if (!writes) continue;
    attempt([&] {
      const std::size_t part_numel = values.size() / static_cast<std::size_t>(tp);
      std::size_t offset = 0;
      std::vector<MasterT> whole;
      for (const nn::ParamSpec& p : eng.unit_specs(u)) {
        const MasterT* data = values.data() + offset;
        if (p.split.is_split()) {  // assemble the logical tensor from the ranks' parts
          whole.assign(static_cast<std::size_t>(p.logical_shape().numel()), MasterT{});
          for (int q = 0; q < tp; ++q) {
            nn::TensorSplit split = p.split;
            split.index = q;
            const MasterT* part = values.data() + static_cast<std::size_t>(q) * part_numel + offset;
            split.for_each_run(0, p.numel(),
                               [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
                                 std::copy_n(part + held, count, whole.begin() + logical);
                               });
          }
          data = whole.data();
        }
        // A padded table's first vocab_size rows: the start of its row-major values.
        layout.export_tensor(
            *writer, p.name,
            Tensor<const MasterT>(data, detail::hf_file_shape(layout, p, vocab_size, who)),
            io::DTypeRule::convert);
        offset += static_cast<std::size_t>(p.numel());
      }
    });
  }
  if (writes) {
    attempt([&] {
      writer->commit();
      result.tensors = writer->tensors().size();  // every declared tensor, now complete
      result.files = static_cast<std::size_t>(writer->num_files());
      for (const auto& path : writer->paths()) result.bytes += std::filesystem::file_size(path);
    });
  }
  writer.reset();  // uncommitted files are removed here
  // Rank 0 tells the others whether the files exist and what they hold.
  std::vector<MasterT> outcome{error.empty() ? MasterT{1} : MasterT{0},
                               static_cast<MasterT>(result.tensors),
                               static_cast<MasterT>(result.files)};
  eng.state().state_comm().broadcast(std::span<MasterT>(outcome), 0);
  if (writes) expect<CheckpointError>(error.empty(), who, ": ", error);
  expect<CheckpointError>(outcome[0] == MasterT{1}, who, "('", file.string(),
                          "'): rank 0 could not write the file (its error says why)");
  result.tensors = static_cast<std::size_t>(outcome[1]);
  result.files = static_cast<std::size_t>(outcome[2]);
  if (!writes) {  // the files' sizes where this rank sees them (a shared file system), else 0
    for (const auto& path : io::weights_files(file, static_cast<int>(result.files))) {
      std::error_code ec;
      const auto bytes = std::filesystem::file_size(path, ec);  // uintmax_t(-1) on an error
      if (ec) {
        result.bytes = 0;
        break;
      }
      result.bytes += bytes;
    }
  }
  return result;
}

/// save_hf_weights to a Hugging Face GPT-2 file (io::gpt2::Layout: Conv1D weights as [in, out]).
template <class Eng>
WeightsExport save_gpt2_weights(Eng& eng, const std::filesystem::path& file,
                                DType dtype = DType::f32, std::int64_t vocab_size = 0,
                                std::uint64_t max_shard_bytes = 0) {
  return save_hf_weights(eng, file, io::gpt2::Layout{}, dtype, vocab_size, "save_gpt2_weights",
                         max_shard_bytes);
}

/// save_hf_weights to a Hugging Face Llama file (io::llama::Layout of cfg's heads: q_proj,
/// k_proj, v_proj, gate_proj and up_proj written apart) from an engine over nn::LayerLlama(cfg).
template <class Eng>
WeightsExport save_llama_weights(Eng& eng, const std::filesystem::path& file,
                                 const nn::LlamaConfig& cfg, DType dtype = DType::f32,
                                 std::uint64_t max_shard_bytes = 0) {
  return save_hf_weights(eng, file,
                         io::llama::Layout(cfg.num_heads, cfg.num_kv_heads, cfg.head_size()), dtype,
                         0, "save_llama_weights", max_shard_bytes);
}

}  // namespace zero::engine
