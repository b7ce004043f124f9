#pragma once
// Model FLOP utilisation: the FLOPs a training step must do for the model, whatever the
// implementation (recomputation, padding and communication do not count), against a rate the
// hardware can reach. Per token of a GPT: 6N for the forward and backward of the N parameters'
// matrix products (Kaplan et al. 2020), plus attention's two T x T products over L layers of C
// channels at context T. PaLM's MFU (Chowdhery et al. 2022, appendix B) counts those products
// whole, 12LCT; a causal mask needs the half on and below the diagonal only, so zero counts
// 6LCT (as llm.c and the project's MFU targets do), which gives a lower MFU than PaLM's.
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
  // The PCIe and NVL boards of a generation run at lower clocks than its SXM module.
  const bool hopper = has("H100") || has("H200") || has("H800");
  if (hopper && has("PCIe")) return 756.0;  // H100 PCIe, H800 PCIe
  if (hopper && has("NVL")) return 835.0;   // H100 NVL, H200 NVL
  if (hopper) return 989.4;                 // SXM (and GH200)
  if (has("A100")) return 312.0;
  return 0.0;
}

}  // namespace zero::profile
