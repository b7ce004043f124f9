#pragma once
// Model FLOP utilisation: the FLOPs a training step must do for the model, whatever the
// implementation (recomputation, padding and communication do not count), against a rate the
// hardware can reach. Per token of a GPT (Kaplan et al. 2020; PaLM's MFU, Chowdhery et al. 2022,
// appendix B): 6N for the forward and backward of the N parameters' matrix products, plus 6LCT
// for attention's two T x T products over L layers of C channels at context T.
//
// The peaks are datasheet dense (no sparsity) bf16 tensor-core rates; programs also measure a
// large cuBLASLt GEMM in the same run, the rate a step can actually approach.

#include <cstdint>
#include <string_view>

namespace zero::profile {

/// Training FLOPs per token of a GPT with params parameters, layers layers of channels channels,
/// at sequence length seq: 6N + 6LCT.
inline double gpt_flops_per_token(std::int64_t params, std::int64_t layers, std::int64_t channels,
                                  std::int64_t seq) {
  return 6.0 * static_cast<double>(params) + 6.0 * static_cast<double>(layers) *
                                                 static_cast<double>(channels) *
                                                 static_cast<double>(seq);
}

/// The datasheet dense bf16 peak of the GPU called name (cudaDeviceProp::name) in TFLOP/s, or 0
/// when the card is not listed.
inline double datasheet_bf16_tflops(std::string_view name) {
  const auto has = [&](std::string_view s) { return name.find(s) != std::string_view::npos; };
  if (has("H100") && has("PCIe")) return 756.0;
  if (has("H100") && has("NVL")) return 835.0;
  if (has("H100") || has("H200") || has("H800")) return 989.4;
  if (has("A100")) return 312.0;
  return 0.0;
}

}  // namespace zero::profile
