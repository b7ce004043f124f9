#pragma once
// zero-requires: cuda
// Linear layer kernels on the GPU, PyTorch layout (weight [OC, C], bias [OC]); the twin of
// zero/ops/cpu/linear.hpp:
//   forward:  out[n, o] = sum_c inp[n, c] * weight[o, c] + bias[o]     (bias in the epilogue)
//   backward: dinp += dout @ weight, dweight += dout^T @ inp, dbias += column sums of dout
//   forward_add: out = skip + forward (a residual's sum, skip as the GEMM's beta = 1 addend)
//   gelu_aux_forward: pre = forward, out = gelu(pre) (cuBLASLt's GELU_AUX epilogue)
//   backward_gelu: the input gradient through a GELU before the layer (cuBLASLt's DGELU)
// Gradients accumulate (+=, GEMM beta = 1) like the host's. The bias gradient is a column sum in
// a fixed order (no atomics): 32 columns per block, 8 row slices added in slice order.
// An OC that is not a whole number of 16-byte packs (GPT-2's vocabulary, 50257) ran the LM head's
// GEMMs at 95-145 TFLOP/s on an H200 against 870 for the same shapes at OC = 50264, whatever the
// leading dimensions (measured: an odd OC keeps cuBLASLt off its fast tensor-core kernels, as
// llm.c and Megatron avoid by padding the vocabulary). Such a layer runs its GEMMs at OC padded to
// whole packs (padded_row) on scratch copies: the weight (and bias) with zero rows after OC, the
// output and dout with zero columns after OC, and in the backward the weight gradient, copied in
// and out around a beta = 1 GEMM. The zero rows and columns add exact zeros to every sum, so the
// values are those of the GEMM on the unpadded shapes; the copies cost a few passes over the
// weight and the output per call.
#if !defined(__CUDACC__)
#error "zero/ops/cuda/linear.cuh needs nvcc; host-only code includes zero/ops/cpu/linear.hpp"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/ops/cuda/column_sum.cuh>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/elementwise.cuh>
#include <zero/ops/cuda/gelu.cuh>
#include <zero/ops/cuda/gemm.cuh>

namespace zero::ops::cuda {

/// A linear layer's bias-gradient term of row n, column o: dout[n, o].
template <class T>
struct BiasGradTerm {
  const T* dout;
  int OC;
  __device__ void operator()(int n, int o, float (&v)[1]) const {
    v[0] = load(dout[static_cast<std::int64_t>(n) * OC + o]);
  }
};

/// Elements in a row of cols elements padded to a whole number of 16 bytes.
template <class T>
std::int64_t padded_row(std::int64_t cols) {
  return (cols + pack_size<T> - 1) / pack_size<T> * pack_size<T>;
}

/// dense [rows, cols] (contiguous, rows anywhere) = padded [rows, ld] (ld = padded_row(cols)):
/// each thread stores 16 bytes of dense (16-byte aligned) from cols-long pieces of padded rows.
template <class T>
__global__ void pack_rows_kernel(T* dense, const T* padded, std::int64_t rows, std::int64_t cols,
                                 std::int64_t ld) {
  constexpr int P = pack_size<T>;
  const std::int64_t total = rows * cols, packs = total / P;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < packs + P; i += stride) {
    if (i < packs) {
      Pack<T> out;
      std::int64_t n = i * P / cols, c = i * P - n * cols;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        out.v[k] = padded[n * ld + c];
        if (++c == cols) {
          c = 0;
          ++n;
        }
      }
      reinterpret_cast<Pack<T>*>(dense)[i] = out;
    } else {  // the last total % P elements, one per thread
      const std::int64_t e = packs * P + (i - packs);
      if (e < total) dense[e] = padded[e / cols * ld + e % cols];
    }
  }
}

/// padded [rows, ld] = dense [rows, cols], the pad zeroed: each thread writes one 16-byte pack of
/// a padded row.
template <class T>
__global__ void pad_rows_kernel(T* padded, const T* dense, std::int64_t rows, std::int64_t cols,
                                std::int64_t ld) {
  constexpr int P = pack_size<T>;
  const std::int64_t row_packs = ld / P, packs = rows * row_packs;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < packs;
       i += stride) {
    const std::int64_t n = i / row_packs, c0 = (i - n * row_packs) * P;
    const T* src = dense + n * cols;
    Pack<T> out;
#pragma unroll
    for (int k = 0; k < P; ++k) out.v[k] = c0 + k < cols ? src[c0 + k] : store<T>(0.0f);
    reinterpret_cast<Pack<T>*>(padded)[i] = out;
  }
}

/// True when OC is not a whole number of 16-byte packs and so the GEMMs run on padded copies
/// (see the file comment).
template <class T>
bool linear_pads_rows(std::int64_t OC) {
  return OC % pack_size<T> != 0;
}

/// padded [ld] = v [n] and zeros after it, in scratch ordered on stream (ld >= n): a weight
/// [OC, C] padded to [padded_row(OC), C] is its OC * C elements and zero rows.
template <class T>
DeviceScratch padded_copy(const T* v, std::int64_t n, std::int64_t ld, cudaStream_t stream) {
  DeviceScratch out(static_cast<std::size_t>(ld) * sizeof(T), stream);
  if (ld == 0) return out;
  ZERO_CUDA_CHECK(cudaMemcpyAsync(out.as<T>(), v, static_cast<std::size_t>(n) * sizeof(T),
                                  cudaMemcpyDeviceToDevice, stream));
  ZERO_CUDA_CHECK(
      cudaMemsetAsync(out.as<T>() + n, 0, static_cast<std::size_t>(ld - n) * sizeof(T), stream));
  return out;
}

// ---- launchers ----------------------------------------------------------------------------------

/// out[N, OC] = inp[N, C] @ weight[OC, C]^T + bias[OC] (bias may be null).
template <class T>
void linear_forward(GemmContext& ctx, T* out, const T* inp, const T* weight, const T* bias,
                    std::int64_t N, std::int64_t C, std::int64_t OC, cudaStream_t stream) {
  const Epilogue epilogue = bias != nullptr ? Epilogue::bias : Epilogue::none;
  if (!linear_pads_rows<T>(OC) || N == 0 || !aligned16({out})) {
    gemm<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC, epilogue,
            bias, stream);
    return;
  }
  const std::int64_t ld = padded_row<T>(OC);
  const DeviceScratch w = padded_copy(weight, OC * C, ld * C, stream);
  const DeviceScratch b =
      padded_copy(bias, bias != nullptr ? OC : 0, bias != nullptr ? ld : 0, stream);
  DeviceScratch padded(static_cast<std::size_t>(N * ld) * sizeof(T), stream);
  gemm<T>(ctx, Trans::no, Trans::yes, N, ld, C, 1.0f, inp, C, w.as<T>(), C, 0.0f, padded.as<T>(),
          ld, epilogue, b.as<T>(), stream);
  pack_rows_kernel<T>
      <<<grid_for(N * OC / pack_size<T> + pack_size<T>), elementwise_threads, 0, stream>>>(
          out, padded.as<T>(), N, OC, ld);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// out = skip + (inp @ weight^T + bias): a residual branch's last linear layer with the skip path
/// as the GEMM's addend (beta = 1 from skip, out written once, each element rounded once; the
/// host twin rounds the product, then the sum). A layer whose rows are padded (linear_pads_rows)
/// runs linear_forward, then add. out and skip must not overlap.
template <class T>
void linear_forward_add(GemmContext& ctx, T* out, const T* skip, const T* inp, const T* weight,
                        const T* bias, std::int64_t N, std::int64_t C, std::int64_t OC,
                        cudaStream_t stream) {
  if (linear_pads_rows<T>(OC)) {
    linear_forward<T>(ctx, out, inp, weight, bias, N, C, OC, stream);
    add<T>(out, skip, out, N * OC, stream);
    return;
  }
  gemm_from<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 1.0f, skip, out, OC,
               bias != nullptr ? Epilogue::bias : Epilogue::none, bias, stream);
}

/// pre = inp @ weight^T + bias and out = gelu(pre) in one cuBLASLt call (its GELU_AUX epilogues:
/// pre stored as the GELU's input beside out): a linear layer followed by GELU in training, whose
/// backward reads pre. out is cuBLASLt's GELU (tanh approximation) of the unrounded sum, where
/// the host twin (linear_forward, then gelu_forward) takes it of pre rounded. f32, an OC that is
/// not a multiple of 8 (cuBLASLt's aux rows), rows that are padded, and a call cuBLASLt has no
/// GELU_AUX algorithm for run the two calls instead.
template <class T>
void linear_gelu_aux_forward(GemmContext& ctx, T* pre, T* out, const T* inp, const T* weight,
                             const T* bias, std::int64_t N, std::int64_t C, std::int64_t OC,
                             cudaStream_t stream) {
  if (!std::is_same_v<T, float> && OC % 8 == 0 && !linear_pads_rows<T>(OC) &&
      aligned16({pre, out}) &&
      try_gemm_from<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out,
                       out, OC, bias != nullptr ? Epilogue::gelu_aux_bias : Epilogue::gelu_aux,
                       bias, pre, OC, stream)) {
    return;
  }
  linear_forward<T>(ctx, pre, inp, weight, bias, N, C, OC, stream);
  gelu_forward<T>(out, pre, N * OC, stream);
}

/// out = gelu(inp @ weight^T + bias) in one cuBLASLt call (GELU-tanh epilogue; bias required),
/// keeping no pre-activation: for inference and the benchmark (training uses
/// linear_gelu_aux_forward).
template <class T>
void linear_gelu_forward(GemmContext& ctx, T* out, const T* inp, const T* weight, const T* bias,
                         std::int64_t N, std::int64_t C, std::int64_t OC, cudaStream_t stream) {
  gemm<T>(ctx, Trans::no, Trans::yes, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC,
          Epilogue::gelu_bias, bias, stream);
}

/// Accumulates the gradients of linear_forward; dinp, dweight, dbias may each be null.
/// overwrite_dinp writes dinp instead (GEMM beta 0), as the host twin's flag does.
template <class T>
void linear_backward(GemmContext& ctx, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, std::int64_t N, std::int64_t C, std::int64_t OC,
                     bool overwrite_dinp, cudaStream_t stream) {
  const bool pads = linear_pads_rows<T>(OC) && N > 0 && (dinp != nullptr || dweight != nullptr);
  // Padded, the GEMMs run at OP = padded_row(OC) on dout with zero columns after OC, the weight
  // with zero rows after OC, and a copy of dweight with zero rows (copied back after).
  const std::int64_t OP = pads ? padded_row<T>(OC) : OC;
  DeviceScratch padded(pads ? static_cast<std::size_t>(N * OP) * sizeof(T) : 0, stream);
  const T* dy = dout;
  if (pads) {
    pad_rows_kernel<T><<<grid_for(N * OP / pack_size<T>), elementwise_threads, 0, stream>>>(
        padded.as<T>(), dout, N, OC, OP);
    ZERO_CUDA_CHECK(cudaGetLastError());
    dy = padded.as<T>();
  }
  if (dinp != nullptr) {
    const DeviceScratch w = padded_copy(weight, pads ? OC * C : 0, pads ? OP * C : 0, stream);
    gemm<T>(ctx, Trans::no, Trans::no, N, C, OP, 1.0f, dy, OP, pads ? w.as<T>() : weight, C,
            overwrite_dinp ? 0.0f : 1.0f, dinp, C, stream);
  }
  if (dweight != nullptr) {
    const DeviceScratch dw = padded_copy(dweight, pads ? OC * C : 0, pads ? OP * C : 0, stream);
    gemm<T>(ctx, Trans::yes, Trans::no, OP, C, N, 1.0f, dy, OP, inp, C, 1.0f,
            pads ? dw.as<T>() : dweight, C, stream);
    if (pads) {
      ZERO_CUDA_CHECK(cudaMemcpyAsync(dweight, dw.as<T>(),
                                      static_cast<std::size_t>(OC * C) * sizeof(T),
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
  if (dbias != nullptr && OC > 0) {
    column_sums<T, 1>({{dbias}}, BiasGradTerm<T>{dout, static_cast<int>(OC)}, N, OC,
                      "linear_backward", stream);
  }
}

/// A linear layer's backward through the GELU before it (inp = gelu(pre)): dpre = gelu'(pre) *
/// (dout @ weight), written; dweight and dbias as linear_backward's (either may be null). In
/// bf16/f16 the input-gradient GEMM applies GELU's derivative in its epilogue (cuBLASLt's DGELU,
/// pre as its aux input: one rounding, where the host twin rounds dout @ weight first); f32, a C
/// that is not a multiple of 8, padded rows and a call cuBLASLt has no DGELU algorithm for run
/// linear_backward into scratch and gelu_backward.
template <class T>
void linear_backward_gelu(GemmContext& ctx, T* dpre, T* dweight, T* dbias, const T* dout,
                          const T* inp, const T* weight, const T* pre, std::int64_t N,
                          std::int64_t C, std::int64_t OC, cudaStream_t stream) {
  // aux is only read under dgelu.
  if (!std::is_same_v<T, float> && C % 8 == 0 && !linear_pads_rows<T>(OC) &&
      aligned16({dpre, pre}) &&
      try_gemm_from<T>(ctx, Trans::no, Trans::no, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dpre,
                       dpre, C, Epilogue::dgelu, nullptr, const_cast<T*>(pre), C, stream)) {
    linear_backward<T>(ctx, nullptr, dweight, dbias, dout, inp, weight, N, C, OC, false, stream);
    return;
  }
  const DeviceScratch dinp(static_cast<std::size_t>(N * C) * sizeof(T), stream);
  linear_backward<T>(ctx, dinp.as<T>(), dweight, dbias, dout, inp, weight, N, C, OC, true, stream);
  gelu_backward<T>(dpre, pre, dinp.as<T>(), N * C, true, stream);
}

/// linear_backward accumulating into dinp.
template <class T>
void linear_backward(GemmContext& ctx, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, std::int64_t N, std::int64_t C, std::int64_t OC,
                     cudaStream_t stream) {
  linear_backward<T>(ctx, dinp, dweight, dbias, dout, inp, weight, N, C, OC, false, stream);
}

}  // namespace zero::ops::cuda
