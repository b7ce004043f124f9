#pragma once
// Llama weights in the Hugging Face layout (LlamaForCausalLM's safetensors files). nn::LayerLlama
// keeps Hugging Face's names and [out, in] weights but packs two pairs of projections
// (nn/layer_llama.hpp):
//   model.layers.N.self_attn.qkv_proj.weight  <- q_proj, k_proj, v_proj: for each key/value head
//       j, q_proj's rows of its group's query heads [j g hs, (j+1) g hs), then k_proj's rows
//       [j hs, (j+1) hs), then v_proj's (g = num_heads / num_kv_heads, hs the head size);
//   model.layers.N.mlp.gate_up_proj.weight    <- gate_proj's rows, then up_proj's.
// Every other parameter is the file's tensor of the same name and shape. The rotary embedding is
// Hugging Face's "rotate half" form, so q_proj and k_proj go in unpermuted. A file without
// lm_head.weight (tie_word_embeddings, as Llama 3.2's small models) gives the untied head a copy
// of model.embed_tokens.weight.
//
// A parameter is a list of file tensors (FilePart), each made of blocks of whole rows (RowBlock):
// zero rows [zero_row, zero_row + rows) are the file tensor's rows [file_row, file_row + rows).
// So an element range of a parameter (a rank's master slice, a tensor-parallel rank's run) is
// read as contiguous ranges of the file's tensors, and an export appends each file tensor's
// blocks in its row order without a copy.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_writer.hpp>

namespace zero::io::llama {

/// Rows [zero_row, zero_row + rows) of a parameter are rows [file_row, file_row + rows) of a file
/// tensor.
struct RowBlock {
  std::int64_t zero_row = 0, file_row = 0, rows = 0;
};

/// One file tensor of a parameter: its name, extents and the parameter's blocks in it, in the
/// file tensor's row order (together they cover it).
struct FilePart {
  std::string name;
  std::vector<std::int64_t> extents;
  std::vector<RowBlock> blocks;
};

/// Where LayerLlama's parameters lie in a Hugging Face Llama file (see the file comment).
class Layout {
 public:
  /// The attention's head counts and head size, as LlamaConfig's num_heads, num_kv_heads and
  /// head_size().
  Layout(std::int64_t num_heads, std::int64_t num_kv_heads, std::int64_t head_size)
      : heads_(num_heads), kv_heads_(num_kv_heads), hs_(head_size) {
    expect<ConfigError>(heads_ > 0 && kv_heads_ > 0 && hs_ > 0 && heads_ % kv_heads_ == 0,
                        "llama::Layout: num_heads ", heads_, ", num_kv_heads ", kv_heads_,
                        ", head size ", hs_,
                        "; expected positive sizes, num_heads a multiple of num_kv_heads");
  }

  /// For messages: the model family.
  static std::string_view model() { return "Llama"; }

  /// The file tensors of parameter name, whose (logical) shape is shape, in declaration order.
  std::vector<FilePart> parts(std::string_view name, const Shape& shape) const {
    const std::vector<std::int64_t> extents = extents_of(shape);
    const std::int64_t rows = extents.empty() ? 1 : extents[0];
    if (name.ends_with(".self_attn.qkv_proj.weight")) {
      const std::int64_t g = heads_ / kv_heads_;
      expect<ShapeError>(extents.size() == 2 && rows == kv_heads_ * (g + 2) * hs_, "Llama '", name,
                         "' has shape ", shape, "; a grouped qkv projection of ", heads_,
                         " query heads over ", kv_heads_, " key/value heads of ", hs_,
                         " channels has ", kv_heads_ * (g + 2) * hs_, " rows");
      const std::string stem(
          name.substr(0, name.size() - std::string_view("qkv_proj.weight").size()));
      const std::int64_t in = extents[1];
      FilePart q{stem + "q_proj.weight", {heads_ * hs_, in}, {}};
      FilePart k{stem + "k_proj.weight", {kv_heads_ * hs_, in}, {}};
      FilePart v{stem + "v_proj.weight", {kv_heads_ * hs_, in}, {}};
      for (std::int64_t j = 0; j < kv_heads_; ++j) {
        const std::int64_t group_row = j * (g + 2) * hs_;
        q.blocks.push_back({group_row, j * g * hs_, g * hs_});
        k.blocks.push_back({group_row + g * hs_, j * hs_, hs_});
        v.blocks.push_back({group_row + (g + 1) * hs_, j * hs_, hs_});
      }
      return {q, k, v};
    }
    if (name.ends_with(".mlp.gate_up_proj.weight")) {
      expect<ShapeError>(extents.size() == 2 && rows % 2 == 0, "Llama '", name, "' has shape ",
                         shape, "; [gate | up] rows are 2 F x C");
      const std::string stem(
          name.substr(0, name.size() - std::string_view("gate_up_proj.weight").size()));
      const std::int64_t F = rows / 2;
      return {FilePart{stem + "gate_proj.weight", {F, extents[1]}, {{0, 0, F}}},
              FilePart{stem + "up_proj.weight", {F, extents[1]}, {{F, 0, F}}}};
    }
    return {FilePart{std::string(name), extents, {{0, 0, rows}}}};
  }

  /// False: every element range is read as ranges of the file's tensors.
  static bool reads_whole(std::string_view) { return false; }

  /// True for the tables whose rows are the vocabulary (a padded vocabulary keeps the file's
  /// rows).
  static bool is_vocabulary_table(std::string_view name) {
    return name == "model.embed_tokens.weight" || name == "lm_head.weight";
  }

  /// The declarations of parameter name (shape shape) in a file of dtype.
  std::vector<TensorDecl> export_decls(std::string_view name, DType dtype,
                                       const Shape& shape) const {
    std::vector<TensorDecl> decls;
    for (const FilePart& part : parts(name, shape))
      decls.emplace_back(part.name, dtype, part.extents);
    return decls;
  }

  /// Reads elements [first, first + out.numel()) of parameter name (shape shape) from reader:
  /// for each block the range overlaps, one contiguous read of its file tensor. CheckpointError
  /// naming the file and the tensor for one missing or of another shape.
  template <class Reader, class T>
  void import_range(const Reader& reader, std::string_view name, const Shape& shape,
                    std::int64_t first, Tensor<T> out, DTypeRule rule = DTypeRule::exact) const {
    const std::int64_t n = out.numel();
    expect<CheckpointError>(first >= 0 && n >= 0 && first + n <= shape.numel(), "Llama parameter '",
                            name, "': element range [", first, ", ", first + n, ") is outside its ",
                            shape.numel(), " elements");
    const std::int64_t cols = shape.rank() == 0 ? 1 : shape.numel() / shape[0];
    for (const FilePart& part : parts(name, shape)) {
      const std::string stored = stored_name(reader, part);
      for (const RowBlock& b : part.blocks) {
        const std::int64_t lo = std::max(first, b.zero_row * cols);
        const std::int64_t hi = std::min(first + n, (b.zero_row + b.rows) * cols);
        if (lo >= hi) continue;
        reader.read_elements(stored, b.file_row * cols + (lo - b.zero_row * cols),
                             Tensor<T>(out.data() + (lo - first), Shape{hi - lo}), rule);
      }
    }
  }

  /// Writes the whole parameter name (host memory, its logical shape) into writer as its file
  /// tensors, converting to the declared dtype as rule allows.
  template <class Writer, class T>
  void export_tensor(Writer& writer, std::string_view name, Tensor<T> value,
                     DTypeRule rule = DTypeRule::exact) const {
    const Shape& shape = value.shape();
    const std::int64_t cols = shape.rank() == 0 ? 1 : shape.numel() / shape[0];
    for (const FilePart& part : parts(name, shape)) {
      for (const RowBlock& b : part.blocks) {
        writer.write(part.name, Tensor<T>(value.data() + b.zero_row * cols, Shape{b.rows * cols}),
                     rule);
      }
    }
  }

 private:
  /// The file's name for part: its own, or for a missing lm_head.weight the token table (a file
  /// of tied embeddings). Checks the tensor's shape; CheckpointError naming file and tensor.
  template <class Reader>
  static std::string stored_name(const Reader& reader, const FilePart& part) {
    std::string stored = part.name;
    if (!reader.contains(stored) && stored == "lm_head.weight" &&
        reader.contains("model.embed_tokens.weight")) {
      stored = "model.embed_tokens.weight";
    }
    expect<CheckpointError>(reader.contains(stored), "safetensors file '", reader.path().string(),
                            "' has no Llama tensor '", part.name, "'");
    const TensorInfo& info = reader.info(stored);
    expect<CheckpointError>(info.shape == part.extents, "safetensors file '",
                            reader.path().string(), "', tensor '", stored, "' has shape ",
                            info.shape_string(), " but Llama needs ",
                            TensorInfo{"", info.dtype, part.extents, 0, 0}.shape_string());
    return stored;
  }

  std::int64_t heads_, kv_heads_, hs_;
};

}  // namespace zero::io::llama
