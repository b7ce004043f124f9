#pragma once
// nn::GPT: GPT-2 (learned positions, pre-LN blocks, GELU-tanh MLP, LM head tied to the token
// embedding) as an ordered list of units: 0 = embedding, 1..L = transformer blocks, L+1 = head.
// It is built from the layer library (nn::LayerGPT, layer_gpt.hpp), the same building blocks
// users compose their own models from; parameter names follow Hugging Face GPT-2, so weights
// import from and export to safetensors. Its numbers equal the hand-written units it replaced
// (nn::HandWrittenGPT) bit for bit.

#include <zero/core/dtype.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/model.hpp>

namespace zero::nn {

/// GPT-2 over element type T: f64 for reference tests, f32 for training on the host, bf16/f16
/// for 16-bit storage with float arithmetic.
template <class T>
using GPT = LayerGPT<T>;

static_assert(Model<GPT<double>> && Model<GPT<float>> && Model<GPT<bf16>>);

}  // namespace zero::nn
