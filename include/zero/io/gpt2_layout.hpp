#pragma once
// GPT-2 weights in the Hugging Face layout. Hugging Face's GPT-2 stores its attention and MLP
// projections as Conv1D, whose weight is [in, out]; zero's Linear keeps [out, in] (one output
// row per feature, as torch.nn.Linear), so those four weights per block are transposed on
// import and export. Everything else (embeddings, LayerNorms, biases) has the same layout.
// Files saved from GPT2Model name tensors without the "transformer." prefix that
// GPT2LMHeadModel uses; the lookups below accept both. lm_head.weight is tied to
// transformer.wte.weight and is never a separate parameter in zero.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_writer.hpp>

namespace zero::io::gpt2 {

/// The prefix of every GPT-2 parameter name in zero (and in GPT2LMHeadModel files).
inline constexpr std::string_view prefix = "transformer.";

/// Name endings of the weights that Hugging Face stores as Conv1D [in, out].
inline constexpr std::string_view conv1d_weight_suffixes[] = {
    ".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"};

/// True for a GPT-2 weight stored as Conv1D [in, out] in Hugging Face files.
constexpr bool is_conv1d_weight(std::string_view name) {
  for (std::string_view suffix : conv1d_weight_suffixes) {
    if (name.ends_with(suffix)) return true;
  }
  return false;
}

/// Writes the transpose of the 2-D host tensor in ([rows, cols]) into out ([cols, rows]).
template <class T>
void transpose(Tensor<const std::type_identity_t<T>> in, Tensor<T> out) {
  expect<ShapeError>(
      in.rank() == 2 && out.rank() == 2 && in.dim(0) == out.dim(1) && in.dim(1) == out.dim(0),
      "gpt2::transpose: cannot transpose ", in.shape(), " into ", out.shape());
  const std::int64_t rows = in.dim(0), cols = in.dim(1);
  const T* src = in.span().data();
  T* dst = out.span().data();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

/// Hugging Face Conv1D weight [in, out] to zero's Linear weight [out, in].
template <class T>
void conv1d_to_linear(Tensor<const std::type_identity_t<T>> conv1d, Tensor<T> linear) {
  transpose<T>(conv1d, linear);
}

/// zero's Linear weight [out, in] to a Hugging Face Conv1D weight [in, out].
template <class T>
void linear_to_conv1d(Tensor<const std::type_identity_t<T>> linear, Tensor<T> conv1d) {
  transpose<T>(linear, conv1d);
}

/// The extents a parameter of zero extents has in a Hugging Face file (Conv1D weights swapped).
inline std::vector<std::int64_t> file_extents(std::string_view name, const Shape& zero_shape) {
  std::vector<std::int64_t> extents = extents_of(zero_shape);
  if (is_conv1d_weight(name)) {
    expect<ShapeError>(extents.size() == 2, "GPT-2 Conv1D weight '", name, "' must be 2-D, not ",
                       zero_shape);
    std::swap(extents[0], extents[1]);
  }
  return extents;
}

/// zero's name for a tensor found in a Hugging Face GPT-2 file, or nullopt for tensors that are
/// not parameters in zero: the tied lm_head.weight and the attention-mask buffers
/// (h.N.attn.bias, h.N.attn.masked_bias) that older files carry.
inline std::optional<std::string> zero_name_of(std::string_view file_name) {
  if (file_name == "lm_head.weight") return std::nullopt;
  if (file_name.ends_with(".attn.bias") || file_name.ends_with(".attn.masked_bias")) {
    return std::nullopt;
  }
  if (file_name.starts_with(prefix)) return std::string(file_name);
  return std::string(prefix).append(file_name);
}

/// The name under which reader stores zero parameter name: name itself, or name without the
/// "transformer." prefix. Throws CheckpointError naming the file and both spellings.
template <class Reader>
std::string stored_name(const Reader& reader, std::string_view name) {
  if (reader.contains(name)) return std::string(name);
  if (name.starts_with(prefix)) {
    const std::string_view bare = name.substr(prefix.size());
    if (reader.contains(bare)) return std::string(bare);
  }
  raise<CheckpointError>("safetensors file '", reader.path().string(), "' has no GPT-2 tensor '",
                         name, "' (looked for it with and without the \"transformer.\" prefix)");
}

/// Reads elements [first, first + out.numel()) of zero parameter name, whose zero shape is
/// zero_shape, from a Hugging Face GPT-2 file: a plain range read for most tensors; for Conv1D
/// weights the stored [in, out] tensor is read whole and the range taken from its transpose
/// (the largest, mlp.c_fc, is 4*C*C elements: one tensor, never the model).
template <class Reader, class T>
void import_range(const Reader& reader, std::string_view name, const Shape& zero_shape,
                  std::int64_t first, Tensor<T> out, DTypeRule rule = DTypeRule::exact) {
  const std::string stored = stored_name(reader, name);
  const std::vector<std::int64_t> expected = file_extents(name, zero_shape);
  const TensorInfo& info = reader.info(stored);
  expect<CheckpointError>(info.shape == expected, "safetensors file '", reader.path().string(),
                          "', tensor '", stored, "' has shape ", info.shape_string(),
                          " but GPT-2 parameter '", name, "' of shape ", zero_shape,
                          " needs it stored as ",
                          TensorInfo{"", info.dtype, expected, 0, 0}.shape_string());
  if (!is_conv1d_weight(name)) {
    reader.read_elements(stored, first, out, rule);
    return;
  }
  const std::int64_t n = out.numel();
  expect<CheckpointError>(first >= 0 && n >= 0 && first + n <= zero_shape.numel(),
                          "GPT-2 parameter '", name, "': element range [", first, ", ", first + n,
                          ") is outside its ", zero_shape.numel(), " elements");
  const std::vector<T> whole = reader.template read_vector<T>(stored, rule);  // [in, out]
  const std::int64_t out_features = zero_shape[0], in_features = zero_shape[1];
  T* dst = out.span().data();
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t row = (first + k) / in_features;  // output feature
    const std::int64_t col = (first + k) % in_features;  // input feature
    dst[k] = whole[static_cast<std::size_t>(col * out_features + row)];
  }
}

/// The declaration of zero parameter name (zero shape zero_shape) for a Hugging Face file.
inline TensorDecl export_decl(std::string_view name, DType dtype, const Shape& zero_shape) {
  return TensorDecl(std::string(name), dtype, file_extents(name, zero_shape));
}

/// Writes the whole zero parameter name (zero layout, host memory) into writer, transposing
/// Conv1D weights to [in, out] and converting to the declared dtype as rule allows.
template <class Writer, class T>
void export_tensor(Writer& writer, std::string_view name, Tensor<T> value,
                   DTypeRule rule = DTypeRule::exact) {
  using Elem = std::remove_const_t<T>;
  if (!is_conv1d_weight(name)) {
    writer.write(name, value, rule);
    return;
  }
  expect<ShapeError>(value.rank() == 2, "GPT-2 Conv1D weight '", name, "' must be 2-D, not ",
                     value.shape());
  std::vector<Elem> conv1d(static_cast<std::size_t>(value.numel()));
  const Tensor<Elem> conv1d_view(conv1d.data(), Shape{value.dim(1), value.dim(0)});
  linear_to_conv1d<Elem>(value, conv1d_view);
  writer.write(name, conv1d_view, rule);
}

/// The functions above as a layout object, the form engine::load_hf_weights and
/// engine::save_hf_weights take (io::llama::Layout is the other).
struct Layout {
  /// For messages: the model family.
  static std::string_view model() { return "GPT-2"; }
  /// True for Conv1D weights: a range of one is read from the whole stored tensor.
  static bool reads_whole(std::string_view name) { return is_conv1d_weight(name); }
  /// True for the token table, whose rows are the vocabulary (transformer.wte.weight).
  static bool is_vocabulary_table(std::string_view name) {
    return name == "transformer.wte.weight";
  }
  /// The one declaration of parameter name.
  static std::vector<TensorDecl> export_decls(std::string_view name, DType dtype,
                                              const Shape& zero_shape) {
    return {export_decl(name, dtype, zero_shape)};
  }
  template <class Reader, class T>
  static void import_range(const Reader& reader, std::string_view name, const Shape& zero_shape,
                           std::int64_t first, Tensor<T> out, DTypeRule rule = DTypeRule::exact) {
    gpt2::import_range(reader, name, zero_shape, first, out, rule);
  }
  template <class Writer, class T>
  static void export_tensor(Writer& writer, std::string_view name, Tensor<T> value,
                            DTypeRule rule = DTypeRule::exact) {
    gpt2::export_tensor(writer, name, value, rule);
  }
};

}  // namespace zero::io::gpt2
