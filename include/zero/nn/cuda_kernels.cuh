#pragma once
// zero-requires: cuda
// nn::CudaKernels<T>: the layers' kernel set (nn/kernels.hpp) on one CUDA stream, running
// zero::ops::cuda. Put it in a StepContext (ctx.kernels) with an arena of the same device's
// memory (Arena<Cuda>) and parameters bound to device buffers, and the layers that have device
// kernels run on the GPU: Linear, TiedLinear, LayerNorm, RMSNorm, GELU, SwiGLU, Dropout,
// Residual, CausalSelfAttention, RotaryEmbedding, RepeatKv, TokenEmbedding, PositionEmbedding,
// SoftmaxCrossEntropy, LinearCrossEntropy, Flatten, Reshape and Sequential itself, so all of
// nn::GPT (LayerGPT) and nn::LayerLlama without tensor, sequence or expert parallelism. The
// others refuse with a message naming them.
//
// Element types f32, bf16 and f16 (arithmetic in float; f64 stays on the host). Every call is
// ordered on the stream and none synchronises the host. Differences from the host set:
// - attention is the flash kernel: it saves each row's log-sum-exp (float [B, NH, T]) instead of
//   the probabilities, and takes head sizes up to 128 (ShapeError otherwise);
// - the device kernels of the linear input gradient, LayerNorm, GELU and attention add into dx;
//   where the layer asks for dx to be written (overwrite_dx), the linear GEMM runs with beta = 0
//   and the others write dx without reading it (no memset first, no read of zeros); a residual
//   branch's first LayerNorm writes dx = skip gradient + its own (layer_norm_backward_from)
//   instead of adding into a copy of the skip gradient;
// - linear_forward_add (a residual branch's last linear layer) adds the skip path inside its GEMM
//   (beta = 1 from the skip): each sum rounded once, where the host rounds the product first;
// - linear_gelu_forward (a linear layer followed by GELU) applies GELU in the GEMM's epilogue in
//   bf16/f16, to the unrounded sum (cuBLASLt's tanh approximation), storing pre beside it; and
//   the linear layer after a GELU takes its input gradient through GELU's derivative in its
//   input-gradient GEMM (fuses_gelu_backward, linear_backward_gelu: cuBLASLt's DGELU);
// - copy stages overlapping ranges through scratch (cudaMemcpyAsync requires disjoint ones);
// - the loss: count_valid_targets and cross_entropy_mean return host values, so a loss layer's
//   forward waits for the stream twice (as PyTorch's loss.item()); the backward reads each
//   row's softmax max and sum from the forward's row_stats (device memory) when the layer kept
//   them, as the host does; a loss layer that takes its gradients in its forward runs both in
//   one kernel that reads each row once (cross_entropy_forward_backward), summing in another
//   order than the two kernels (float rounding apart); count_valid_targets, which the loss
//   layers call before any loss kernel, throws the host's ShapeError for a target outside the
//   vocabulary;
// - Llama's kernels compute each element with the host's expression in float: RMSNorm's row
//   sums and its weight gradient's column sums run in another order and SwiGLU takes expf, so
//   they agree within float rounding; the rotary embedding writes out the host's operations and
//   repeat_kv's sums run in the host's order (both the host's bits). The rotary embedding reads the
//   host's angle table (double, rounded to float), which the layer copies to the device once per
//   shape;
// - a linear layer whose output rows are not a whole number of 16 bytes (a vocabulary of 50257)
//   runs its GEMMs on rows padded in scratch (ops/cuda/linear.cuh), which the tensor-core GEMMs
//   need.
#if !defined(__CUDACC__)
#error \
    "zero/nn/cuda_kernels.cuh needs nvcc; host-only code uses nn::HostKernels (zero/nn/kernels.hpp)"
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <cuda_runtime.h>

#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/nn/kernels.hpp>
#include <zero/ops/cuda/activation.cuh>
#include <zero/ops/cuda/attention.cuh>
#include <zero/ops/cuda/common.cuh>
#include <zero/ops/cuda/cross_entropy.cuh>
#include <zero/ops/cuda/dropout.cuh>
#include <zero/ops/cuda/elementwise.cuh>
#include <zero/ops/cuda/embedding.cuh>
#include <zero/ops/cuda/gelu.cuh>
#include <zero/ops/cuda/gemm.cuh>
#include <zero/ops/cuda/grouped_qkv.cuh>
#include <zero/ops/cuda/layer_norm.cuh>
#include <zero/ops/cuda/linear.cuh>
#include <zero/ops/cuda/rms_norm.cuh>
#include <zero/ops/cuda/rotary.cuh>

namespace zero::nn {

/// The layers' kernels on one CUDA stream (see the file comment).
template <class T>
class CudaKernels final : public Kernels<T> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>,
                "nn::CudaKernels: element types are float, bf16 and f16 (f64 runs on the host)");

 public:
  using Stat = typename Kernels<T>::Stat;

  /// Kernels on stream (which must outlive this set); the GEMMs' handles, workspace and
  /// algorithm cache are this set's own. A ZERO_ATTENTION_BACKWARD the attention backward would
  /// refuse is a ConfigError here, so an engine refuses it when it is made rather than break at
  /// its first backward (the launcher still reads the variable at each call).
  explicit CudaKernels(cudaStream_t stream)
      : stream_(stream), gemm_(stream), free_on_(std::make_shared<FreeStream>(stream)) {
    (void)ops::cuda::attention_backward_fuses_dq();
    Cuda::keep_pool_memory();  // the layers' buffers and the kernels' scratch come from the pool
  }
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;
  /// Waits for the stream's work, then tells the memory this set handed out that its stream is
  /// no longer known to be alive (a layer's buffers usually outlive the engine that made them).
  ~CudaKernels() override {
    cudaStreamSynchronize(stream_);
    free_on_->orphaned.store(true);
  }

  /// The stream every kernel runs on.
  cudaStream_t stream() const { return stream_; }

  DeviceKind device() const override { return DeviceKind::cuda; }
  /// Memory from the device's pool, ordered on the stream; freed on the stream while this set
  /// lives, and after the device's work on the legacy stream once it is gone.
  KernelMemory allocate(std::size_t bytes) override {
    void* p = ops::cuda::allocate_async(bytes, stream_, "nn::CudaKernels");
    return {std::shared_ptr<std::byte>(static_cast<std::byte*>(p),
                                       [free_on = free_on_](std::byte* q) {
                                         if (q == nullptr) return;
                                         // Once the set is gone its stream's work is done (the
                                         // destructor waited) and the stream may be too: the legacy
                                         // stream, which always exists, frees it. A layer may have
                                         // gone on using the memory through another set (another
                                         // engine over the same model) on a stream the legacy
                                         // stream does not wait for, so the device finishes its
                                         // work first.
                                         if (free_on->orphaned.load()) {
                                           cudaDeviceSynchronize();
                                           cudaFreeAsync(q, cudaStream_t{});
                                         } else {
                                           cudaFreeAsync(q, free_on->stream);
                                         }
                                       }),
            bytes, DeviceKind::cuda};
  }

  void fill_zero(T* x, std::int64_t n) override {
    if (n > 0) ZERO_CUDA_CHECK(cudaMemsetAsync(x, 0, bytes_of(n), stream_));
  }
  void copy(T* dst, const T* src, std::int64_t n) override {
    if (n <= 0 || dst == src) return;
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    const auto s = reinterpret_cast<std::uintptr_t>(src);
    const std::size_t bytes = bytes_of(n);
    if (d < s + bytes && s < d + bytes) {  // overlapping: through scratch
      ops::cuda::DeviceScratch staged(bytes, stream_);
      ZERO_CUDA_CHECK(
          cudaMemcpyAsync(staged.as<T>(), src, bytes, cudaMemcpyDeviceToDevice, stream_));
      ZERO_CUDA_CHECK(
          cudaMemcpyAsync(dst, staged.as<T>(), bytes, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  /// src may be reused on return: from pageable memory the copy is staged before it returns;
  /// from page-locked memory (cudaHostAlloc, cudaHostRegister) it is a DMA still running, so the
  /// call waits for the stream.
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    cudaPointerAttributes where{};
    if (cudaPointerGetAttributes(&where, src) != cudaSuccess) {
      (void)cudaGetLastError();  // an unknown pointer is pageable memory: nothing to wait for
      return;
    }
    if (where.type == cudaMemoryTypeHost) ZERO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void add(T* y, const T* a, const T* b, std::int64_t n) override {
    ops::cuda::add(y, a, b, n, stream_);
  }
  void accumulate(T* y, const T* x, std::int64_t n) override {
    ops::cuda::accumulate(y, x, n, stream_);
  }
  void add_periodic_rows(T* y, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                         std::int64_t C) override {
    ops::cuda::add_periodic_rows(y, x, rows, N, R, C, stream_);
  }

  void embedding_forward(T* y, const std::int32_t* tokens, const T* wte, const T* wpe,
                         std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) override {
    ops::cuda::embedding_forward<T>(y, tokens, wte, wpe, B, Tn, C, V, stream_);
  }
  void embedding_backward(T* dwte, T* dwpe, const T* dy, const std::int32_t* tokens, std::int64_t B,
                          std::int64_t Tn, std::int64_t C, std::int64_t V) override {
    ops::cuda::embedding_backward<T>(dwte, dwpe, dy, tokens, B, Tn, C, V, stream_);
  }

  void linear_forward(T* y, const T* x, const T* w, const T* b, std::int64_t N, std::int64_t in,
                      std::int64_t out) override {
    ops::cuda::linear_forward<T>(gemm_, y, x, w, b, N, in, out, stream_);
  }
  /// One GEMM with skip as its addend (ops::cuda::linear_forward_add): one rounding per element
  /// where the host rounds twice.
  void linear_forward_add(T* y, const T* skip, const T* x, const T* w, const T* b, std::int64_t N,
                          std::int64_t in, std::int64_t out) override {
    ops::cuda::linear_forward_add<T>(gemm_, y, skip, x, w, b, N, in, out, stream_);
  }
  /// One GEMM with cuBLASLt's GELU_AUX epilogue in bf16/f16 (ops::cuda::linear_gelu_aux_forward):
  /// GELU of the unrounded sum, where the host takes it of pre rounded.
  void linear_gelu_forward(T* pre, T* y, const T* x, const T* w, const T* b, std::int64_t N,
                           std::int64_t in, std::int64_t out) override {
    ops::cuda::linear_gelu_aux_forward<T>(gemm_, pre, y, x, w, b, N, in, out, stream_);
  }
  /// The input-gradient GEMM with cuBLASLt's DGELU epilogue in bf16/f16
  /// (ops::cuda::linear_backward_gelu): GELU's derivative of the unrounded product.
  bool fuses_gelu_backward() const override { return true; }
  void linear_backward_gelu(T* dpre, T* dw, T* db, const T* dy, const T* x, const T* w,
                            const T* pre, std::int64_t N, std::int64_t in,
                            std::int64_t out) override {
    ops::cuda::linear_backward_gelu<T>(gemm_, dpre, dw, db, dy, x, w, pre, N, in, out, stream_);
  }
  void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, std::int64_t N,
                       std::int64_t in, std::int64_t out, bool overwrite_dx) override {
    ops::cuda::linear_backward<T>(gemm_, dx, dw, db, dy, x, w, N, in, out, overwrite_dx, stream_);
  }
  void layer_norm_forward(T* y, Stat* mean, Stat* rstd, const T* x, const T* w, const T* b,
                          std::int64_t N, std::int64_t C) override {
    ops::cuda::layer_norm_forward<T>(y, mean, rstd, x, w, b, N, C, stream_);
  }
  void layer_norm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                           const Stat* mean, const Stat* rstd, std::int64_t N, std::int64_t C,
                           bool overwrite_dx) override {
    ops::cuda::layer_norm_backward<T>(dx, dw, db, dy, x, w, mean, rstd, N, C, overwrite_dx,
                                      stream_);
  }
  /// One kernel reading start where it would read dx (ops::cuda::layer_norm_backward_from).
  void layer_norm_backward_from(T* dx, const T* start, T* dw, T* db, const T* dy, const T* x,
                                const T* w, const Stat* mean, const Stat* rstd, std::int64_t N,
                                std::int64_t C) override {
    ops::cuda::layer_norm_backward_from<T>(dx, start, dw, db, dy, x, w, mean, rstd, N, C, stream_);
  }
  void gelu_forward(T* y, const T* x, std::int64_t n) override {
    ops::cuda::gelu_forward(y, x, n, stream_);
  }
  void gelu_backward(T* dx, const T* x, const T* dy, std::int64_t n, bool overwrite_dx) override {
    ops::cuda::gelu_backward(dx, x, dy, n, overwrite_dx, stream_);
  }
  void dropout_forward(T* y, const T* x, std::int64_t n,
                       const ops::cpu::DropoutMask& mask) override {
    ops::cuda::dropout_forward(y, x, n, mask, stream_);
  }
  void dropout_backward(T* dx, const T* dy, std::int64_t n,
                        const ops::cpu::DropoutMask& mask) override {
    ops::cuda::dropout_backward(dx, dy, n, mask, stream_);
  }

  void rms_norm_forward(T* y, Stat* rstd, const T* x, const T* w, std::int64_t N, std::int64_t C,
                        Stat eps) override {
    ops::cuda::rms_norm_forward<T>(y, rstd, x, w, N, C, eps, stream_);
  }
  void rms_norm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const Stat* rstd,
                         std::int64_t N, std::int64_t C) override {
    ops::cuda::rms_norm_backward<T>(dx, dw, dy, x, w, rstd, N, C, stream_);
  }
  void rotary_forward(T* y, const T* x, const Stat* cos, const Stat* sin, std::int64_t N,
                      std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                      std::int64_t head_size) override {
    ops::cuda::rotary_forward<T>(y, x, cos, sin, N, seq_len, kv_heads, group, head_size, stream_);
  }
  void rotary_backward(T* dx, const T* dy, const Stat* cos, const Stat* sin, std::int64_t N,
                       std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                       std::int64_t head_size, bool overwrite_dx) override {
    ops::cuda::rotary_backward<T>(dx, dy, cos, sin, N, seq_len, kv_heads, group, head_size,
                                  overwrite_dx, stream_);
  }
  void repeat_kv_forward(T* y, const T* x, std::int64_t N, std::int64_t kv_heads,
                         std::int64_t group, std::int64_t head_size) override {
    ops::cuda::repeat_kv_forward<T>(y, x, N, kv_heads, group, head_size, stream_);
  }
  void repeat_kv_backward(T* dx, const T* dy, std::int64_t N, std::int64_t kv_heads,
                          std::int64_t group, std::int64_t head_size, bool overwrite_dx) override {
    ops::cuda::repeat_kv_backward<T>(dx, dy, N, kv_heads, group, head_size, overwrite_dx, stream_);
  }
  void swiglu_forward(T* y, const T* x, std::int64_t N, std::int64_t F) override {
    ops::cuda::swiglu_forward<T>(y, x, N, F, stream_);
  }
  void swiglu_backward(T* dx, const T* x, const T* dy, std::int64_t N, std::int64_t F,
                       bool overwrite_dx) override {
    ops::cuda::swiglu_backward<T>(dx, x, dy, N, F, overwrite_dx, stream_);
  }

  std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                   std::int64_t V) override {
    return ops::cuda::count_valid_targets(targets, N, V, stream_);
  }
  /// Rows of whole 16-byte packs (ops::cuda::padded_row): the GEMMs that write and read the
  /// logits then run on their fast kernels without padded copies (linear.cuh), and every row
  /// starts aligned for the cross-entropy kernels' 16-byte accesses.
  std::int64_t logits_row_stride(std::int64_t V) const override {
    return ops::cuda::padded_row<T>(V);
  }
  /// row_stats, when given, is device memory the backward reads instead of two passes per row.
  void cross_entropy_forward(Stat* losses, const T* logits, const std::int32_t* targets,
                             std::int64_t N, std::int64_t V, std::int64_t ld,
                             Stat* row_stats) override {
    ops::cuda::cross_entropy_forward<T>(losses, nullptr, row_stats, logits, targets, N, V, ld,
                                        stream_);
  }
  Stat cross_entropy_mean(const Stat* losses, const std::int32_t* targets, std::int64_t N,
                          std::int64_t valid) override {
    return ops::cuda::cross_entropy_mean(losses, targets, N, valid, stream_);
  }
  void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                              std::int64_t N, std::int64_t V, std::int64_t ld, Stat dloss,
                              std::int64_t valid, const Stat* row_stats) override {
    ops::cuda::cross_entropy_backward<T>(dlogits, logits, targets, N, V, dloss, valid, row_stats,
                                         ld, stream_);
  }

  /// One pass over each row for both where the row fits the fused kernel's registers
  /// (ops::cuda::cross_entropy_forward_backward; GPT-2's vocabulary does).
  void cross_entropy_forward_backward(Stat* losses, T* dlogits, const T* logits,
                                      const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                      std::int64_t ld, Stat* row_stats, Stat dloss,
                                      std::int64_t valid) override {
    ops::cuda::cross_entropy_forward_backward<T>(losses, row_stats, dlogits, logits, targets, N, V,
                                                 ld, dloss, valid, stream_);
  }

  /// Flash attention keeps each row's log-sum-exp: float [B, NH, Tn].
  std::size_t attention_saved_bytes(std::int64_t B, std::int64_t Tn,
                                    std::int64_t NH) const override {
    return static_cast<std::size_t>(B * NH * Tn) * sizeof(float);
  }
  void attention_forward(T* y, std::byte* saved, const T* qkv, std::int64_t B, std::int64_t Tn,
                         std::int64_t C, std::int64_t NH,
                         const ops::cpu::DropoutMask& mask) override {
    ops::cuda::attention_forward(y, reinterpret_cast<float*>(saved), qkv, B, Tn, C, NH, mask,
                                 stream_);
  }
  /// Written, when overwrite_dx, by the kernels themselves (no zeroing, no read of dqkv).
  void attention_backward(T* dqkv, const T* dy, const T* qkv, const T* y, const std::byte* saved,
                          std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                          const ops::cpu::DropoutMask& mask, bool overwrite_dx) override {
    ops::cuda::attention_backward<T>(dqkv, dy, qkv, y, reinterpret_cast<const float*>(saved), B, Tn,
                                     C, NH, mask, overwrite_dx, stream_);
  }

 private:
  static std::size_t bytes_of(std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(T); }

  /// What the memory handed out needs to free itself: the stream, and whether this set (and so
  /// perhaps the stream) is gone.
  struct FreeStream {
    explicit FreeStream(cudaStream_t s) : stream(s) {}
    cudaStream_t stream;
    std::atomic<bool> orphaned{false};
  };

  cudaStream_t stream_;
  ops::cuda::GemmContext gemm_;
  std::shared_ptr<FreeStream> free_on_;
};

}  // namespace zero::nn
