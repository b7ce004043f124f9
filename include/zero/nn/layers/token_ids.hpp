#pragma once
// TokenIds: the integer ids a lookup layer reads. A layer names its ids input; the name "tokens"
// falls back to the micro-batch's ctx.tokens [B, T] when the batch has no named input of that
// name, so a language model needs no Inputs at all. TokenEmbedding and the tensor-parallel
// VocabParallelEmbedding share this rule.

#include <cstdint>
#include <string>

#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/inputs.hpp>
#include <zero/nn/kernels.hpp>

namespace zero::nn {

/// A view of the ids of one micro-batch.
struct TokenIds {
  const std::int32_t* data = nullptr;
  Shape shape;  ///< [B, T] for ctx.tokens; the named input's shape otherwise
};

/// The ids named `name` for the layer `who` (its describe(), for the error). Throws InputError
/// when neither the named input nor (for "tokens") ctx.tokens is there.
template <class T>
TokenIds token_ids(const StepContext<T>& ctx, const std::string& name, const std::string& who) {
  if (name == "tokens" && !ctx.inputs.contains(name)) {
    expect<InputError>(ctx.tokens != nullptr, who,
                       ": the micro-batch has neither tokens nor an input named 'tokens'");
    return {ctx.tokens, Shape{ctx.batch, ctx.seq_len}};
  }
  const Tensor<const std::int32_t> ids = ctx.template input<std::int32_t>(name);
  expect_input_on_kernels_device(ctx, ids, name, who);
  return {ids.data(), ids.shape()};
}

}  // namespace zero::nn
