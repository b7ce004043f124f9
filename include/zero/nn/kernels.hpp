#pragma once
// nn::Kernels<T>: the kernels a layer runs, chosen at run time by the StepContext
// (ctx.kernels). The layers are written once against this interface; HostKernels (here) runs
// zero::ops::cpu on host memory, nn::CudaKernels (zero/nn/cuda_kernels.cuh, nvcc only) runs
// zero::ops::cuda on one device stream. The engine hands its units the set of its backend
// (Compute<Host> or Compute<Cuda>), with an arena of the same device's memory.
//
// Every pointer is memory of device(); calls are ordered on the set's stream (immediate on the
// host). The arguments are ops::cpu's, kernel for kernel; where a device kernel saves something
// else for its backward (flash attention keeps each row's log-sum-exp instead of the
// probabilities), the layer asks the set how many bytes to save and passes them back untyped.
// A layer whose kernels are host-only (tensor- and sequence-parallel layers, experts, ReLU and
// SiLU, the MSE loss, the hand-written GPT's units, for now) calls expect_host_kernels() first, so
// it refuses device memory with a message naming itself instead of faulting.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/tensor.hpp>
#include <zero/nn/context.hpp>
#include <zero/ops/cpu/activation.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/embedding.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/grouped_qkv.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>
#include <zero/ops/cpu/rms_norm.hpp>
#include <zero/ops/cpu/rotary.hpp>

namespace zero::nn {

/// Memory a kernel set handed out (Kernels::allocate), freed in its device's order when the
/// last copy is dropped.
struct KernelMemory {
  std::shared_ptr<std::byte> bytes;
  std::size_t size = 0;
  DeviceKind device = DeviceKind::host;

  /// The first n elements as a T view of shape (n = shape.numel() <= size / sizeof(T)).
  template <class T>
  Tensor<T> view(Shape shape) const {
    return Tensor<T>(reinterpret_cast<T*>(bytes.get()), shape, device);
  }
};

/// The kernels layers call, on one device (see the file comment).
template <class T>
class Kernels {
 public:
  /// LayerNorm's saved statistics: float for f32 and the 16-bit types, double for f64.
  using Stat = compute_type_t<T>;

  Kernels() = default;
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;
  virtual ~Kernels() = default;

  /// A number no other kernel set of this process had before: what a layer that keeps memory
  /// for one set compares (a new set may be made at a freed set's address).
  std::uint64_t id() const { return id_; }

  /// Where every pointer passed to these kernels lives.
  virtual DeviceKind device() const = 0;
  /// bytes of this device's memory (not filled) that a layer keeps across micro-steps.
  virtual KernelMemory allocate(std::size_t bytes) = 0;

  /// x[0, n) = 0.
  virtual void fill_zero(T* x, std::int64_t n) = 0;
  /// dst[0, n) = src[0, n); the ranges may overlap.
  virtual void copy(T* dst, const T* src, std::int64_t n) = 0;
  /// bytes from host memory src to dst (memory of device()); src may be reused on return.
  virtual void copy_from_host(void* dst, const void* src, std::size_t bytes) = 0;
  /// y = a + b (y may alias a or b).
  virtual void add(T* y, const T* a, const T* b, std::int64_t n) = 0;
  /// y += x.
  virtual void accumulate(T* y, const T* x, std::int64_t n) = 0;
  /// y[n, c] = x[n, c] + rows[n % R, c] for N rows of C (y may alias x): positions added to B
  /// sequences of R = T rows.
  virtual void add_periodic_rows(T* y, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                                 std::int64_t C) = 0;

  /// y [B*Tn, C] = wte[tokens] (+ wpe[position] when wpe is not null); tokens are memory of
  /// device().
  virtual void embedding_forward(T* y, const std::int32_t* tokens, const T* wte, const T* wpe,
                                 std::int64_t B, std::int64_t Tn, std::int64_t C,
                                 std::int64_t V) = 0;
  /// dwte[token] += dy rows, dwpe[position] += dy rows (either may be null), in the host's order;
  /// dwte has V rows. A token outside [0, V) adds nothing (the host's forward refuses it; the
  /// device's gives its row NaN and cannot throw).
  virtual void embedding_backward(T* dwte, T* dwpe, const T* dy, const std::int32_t* tokens,
                                  std::int64_t B, std::int64_t Tn, std::int64_t C,
                                  std::int64_t V) = 0;

  /// y [N, out] = x [N, in] w^T + b (b may be null).
  virtual void linear_forward(T* y, const T* x, const T* w, const T* b, std::int64_t N,
                              std::int64_t in, std::int64_t out) = 0;
  /// y [N, out] = skip + (x w^T + b): a residual branch's last linear layer with the skip path
  /// added (y and skip distinct). By default linear_forward then add, each element rounded as
  /// the two calls round it (the host's bits); a device set may add inside its GEMM instead.
  virtual void linear_forward_add(T* y, const T* skip, const T* x, const T* w, const T* b,
                                  std::int64_t N, std::int64_t in, std::int64_t out) {
    linear_forward(y, x, w, b, N, in, out);
    add(y, skip, y, N * out);
  }
  /// pre [N, out] = x w^T + b and y = gelu(pre): a linear layer and the GELU after it, pre kept
  /// for GELU's backward. By default linear_forward then gelu_forward (the host's bits); a device
  /// set may apply GELU as its GEMM writes.
  virtual void linear_gelu_forward(T* pre, T* y, const T* x, const T* w, const T* b, std::int64_t N,
                                   std::int64_t in, std::int64_t out) {
    linear_forward(pre, x, w, b, N, in, out);
    gelu_forward(y, pre, N * out);
  }
  /// True when linear_backward_gelu is one kernel call, so Sequential runs a linear layer's
  /// backward through the GELU before it with it (false here: the host set runs them apart).
  virtual bool fuses_gelu_backward() const { return false; }
  /// A linear layer's backward through the GELU before it: dpre [N, in] = gelu'(pre) * (dy w)
  /// (written), dw += dy^T x, db += column sums of dy (either may be null); x = gelu(pre) is the
  /// linear layer's input. By default linear_backward into scratch, then gelu_backward (the bits
  /// of the two layers apart).
  virtual void linear_backward_gelu(T* dpre, T* dw, T* db, const T* dy, const T* x, const T* w,
                                    const T* pre, std::int64_t N, std::int64_t in,
                                    std::int64_t out) {
    KernelMemory scratch = allocate(static_cast<std::size_t>(N * in) * sizeof(T));
    T* dx = scratch.template view<T>({N, in}).data();
    linear_backward(dx, dw, db, dy, x, w, N, in, out, true);
    gelu_backward(dpre, pre, dx, N * in, true);
  }
  /// dx (+)= dy w, dw += dy^T x, db += column sums of dy (each may be null); dx is written, not
  /// added into, when overwrite_dx.
  virtual void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                               std::int64_t N, std::int64_t in, std::int64_t out,
                               bool overwrite_dx) = 0;
  /// LayerNorm of N rows of C (eps 1e-5); saves each row's mean and rstd.
  virtual void layer_norm_forward(T* y, Stat* mean, Stat* rstd, const T* x, const T* w, const T* b,
                                  std::int64_t N, std::int64_t C) = 0;
  /// LayerNorm's gradients (dx written when overwrite_dx, else added into; dw, db added into).
  virtual void layer_norm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                                   const Stat* mean, const Stat* rstd, std::int64_t N,
                                   std::int64_t C, bool overwrite_dx) = 0;
  /// LayerNorm's gradients with dx = start + the input gradient (start [N, C], a residual's skip
  /// gradient, distinct from dx; dw, db added into): the first layer of a residual's branch
  /// (Layer::starts_input_grad). By default copy, then layer_norm_backward adding into dx (the
  /// host's bits); a device set reads start where it would read dx, without the copy.
  virtual void layer_norm_backward_from(T* dx, const T* start, T* dw, T* db, const T* dy,
                                        const T* x, const T* w, const Stat* mean, const Stat* rstd,
                                        std::int64_t N, std::int64_t C) {
    copy(dx, start, N * C);
    layer_norm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, false);
  }
  /// GELU (tanh approximation) of n elements.
  virtual void gelu_forward(T* y, const T* x, std::int64_t n) = 0;
  /// GELU's input gradient (written when overwrite_dx, else added into dx).
  virtual void gelu_backward(T* dx, const T* x, const T* dy, std::int64_t n, bool overwrite_dx) = 0;
  /// Inverted dropout with mask (element i decided at mask.first + i): the host's mask on every
  /// device.
  virtual void dropout_forward(T* y, const T* x, std::int64_t n,
                               const ops::cpu::DropoutMask& mask) = 0;
  /// dx += dy * mask / (1 - p), the mask redrawn as the forward's.
  virtual void dropout_backward(T* dx, const T* dy, std::int64_t n,
                                const ops::cpu::DropoutMask& mask) = 0;

  // Llama's kernels (RMSNorm, the rotary embedding, repeat_kv, SwiGLU): ops/cpu's arguments.
  /// RMSNorm of N rows of C: y = x * rstd * w, rstd [N] = 1 / sqrt(mean(x^2) + eps) saved.
  virtual void rms_norm_forward(T* y, Stat* rstd, const T* x, const T* w, std::int64_t N,
                                std::int64_t C, Stat eps) = 0;
  /// RMSNorm's gradients from the saved rstd, added into dx and dw.
  virtual void rms_norm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w,
                                 const Stat* rstd, std::int64_t N, std::int64_t C) = 0;
  /// y = x's N grouped-qkv rows (kv_heads groups of group query heads, a key and a value head,
  /// head_size channels each) with every query and key head turned by its position's angles;
  /// cos, sin: ops::cpu::rotary_table's [seq_len, head_size / 2], memory of device().
  virtual void rotary_forward(T* y, const T* x, const Stat* cos, const Stat* sin, std::int64_t N,
                              std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                              std::int64_t head_size) = 0;
  /// dx (+=, or = when overwrite_dx) rotary_forward's gradient: dy turned back.
  virtual void rotary_backward(T* dx, const T* dy, const Stat* cos, const Stat* sin, std::int64_t N,
                               std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                               std::int64_t head_size, bool overwrite_dx) = 0;
  /// y [N, 3 * kv_heads * group * head_size] = N grouped-qkv rows as packed q|k|v, each key and
  /// value head repeated over its group.
  virtual void repeat_kv_forward(T* y, const T* x, std::int64_t N, std::int64_t kv_heads,
                                 std::int64_t group, std::int64_t head_size) = 0;
  /// dx (+=, or = when overwrite_dx) repeat_kv_forward's gradient: each key's and value's summed
  /// over its group in head order.
  virtual void repeat_kv_backward(T* dx, const T* dy, std::int64_t N, std::int64_t kv_heads,
                                  std::int64_t group, std::int64_t head_size,
                                  bool overwrite_dx) = 0;
  /// y [N, F] = silu(gate) * up of x [N, 2F] = [gate | up].
  virtual void swiglu_forward(T* y, const T* x, std::int64_t N, std::int64_t F) = 0;
  /// dx [N, 2F] (+=, or = when overwrite_dx) swiglu_forward's gradient given dy [N, F].
  virtual void swiglu_backward(T* dx, const T* x, const T* dy, std::int64_t N, std::int64_t F,
                               bool overwrite_dx) = 0;

  /// Targets of N rows that count (not ops::cpu::ignore_index), as a host value (a device set
  /// waits for its stream).
  virtual std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                           std::int64_t V) = 0;
  /// Elements between the rows of a logits buffer of V classes that a loss layer asks this set's
  /// linear_forward to fill and its cross_entropy kernels to read (>= V): V on the host; the
  /// device's GEMMs run far faster at a whole number of 16-byte packs, so a set may pad the row
  /// (the loss layer then gives the GEMMs a weight with ld - V zero rows after its V).
  virtual std::int64_t logits_row_stride(std::int64_t V) const { return V; }
  /// Per-row softmax cross-entropy losses of N rows of V logits, ld >= V apart (0 where
  /// ignored); row_stats ([N, 2], may be null) keeps what the backward may reuse.
  virtual void cross_entropy_forward(Stat* losses, const T* logits, const std::int32_t* targets,
                                     std::int64_t N, std::int64_t V, std::int64_t ld,
                                     Stat* row_stats) = 0;
  /// The mean of N rows' losses over valid targets, as a host value (a device set waits for its
  /// stream).
  virtual Stat cross_entropy_mean(const Stat* losses, const std::int32_t* targets, std::int64_t N,
                                  std::int64_t valid) = 0;
  /// Writes dlogits (may be logits; rows ld apart in both, zeros in [V, ld)) for the mean loss
  /// over valid targets scaled by dloss; the N rows may be a chunk of the batch valid counts;
  /// row_stats is the forward's (may be null).
  virtual void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                                      std::int64_t N, std::int64_t V, std::int64_t ld, Stat dloss,
                                      std::int64_t valid, const Stat* row_stats) = 0;

  /// cross_entropy_forward, then cross_entropy_backward of the same rows from its row_stats
  /// (dlogits may be logits): a loss layer that takes its gradients in its forward. By default
  /// the two calls (the host's bits); a device set may read each row once for both.
  virtual void cross_entropy_forward_backward(Stat* losses, T* dlogits, const T* logits,
                                              const std::int32_t* targets, std::int64_t N,
                                              std::int64_t V, std::int64_t ld, Stat* row_stats,
                                              Stat dloss, std::int64_t valid) {
    cross_entropy_forward(losses, logits, targets, N, V, ld, row_stats);
    cross_entropy_backward(dlogits, logits, targets, N, V, ld, dloss, valid, row_stats);
  }

  /// Bytes attention_forward saves for its backward at B sequences of Tn positions and NH heads.
  virtual std::size_t attention_saved_bytes(std::int64_t B, std::int64_t Tn,
                                            std::int64_t NH) const = 0;
  /// Causal attention: y [B*Tn, C] from packed qkv [B*Tn, 3C]; saved holds
  /// attention_saved_bytes(B, Tn, NH) bytes for the backward.
  virtual void attention_forward(T* y, std::byte* saved, const T* qkv, std::int64_t B,
                                 std::int64_t Tn, std::int64_t C, std::int64_t NH,
                                 const ops::cpu::DropoutMask& mask) = 0;
  /// dqkv += the gradient of attention_forward given dy, its output y and what it saved (a set
  /// may use y: the device's tensor-core kernels take their row sums of dy * y from it); dqkv
  /// is written, not added into, when overwrite_dx.
  virtual void attention_backward(T* dqkv, const T* dy, const T* qkv, const T* y,
                                  const std::byte* saved, std::int64_t B, std::int64_t Tn,
                                  std::int64_t C, std::int64_t NH,
                                  const ops::cpu::DropoutMask& mask, bool overwrite_dx) = 0;

 private:
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> made{0};
    return ++made;
  }
  const std::uint64_t id_ = next_id();
};

/// zero::ops::cpu on host memory; stateless, so one instance per element type serves every
/// context (host_kernels<T>()).
template <class T>
class HostKernels final : public Kernels<T> {
 public:
  using Stat = typename Kernels<T>::Stat;

  DeviceKind device() const override { return DeviceKind::host; }
  KernelMemory allocate(std::size_t bytes) override {
    HostStream stream;
    auto* p = static_cast<std::byte*>(Host::allocate(bytes, Host::default_alignment, stream));
    return {std::shared_ptr<std::byte>(p, [](std::byte* q) { std::free(q); }), bytes,
            DeviceKind::host};
  }

  void fill_zero(T* x, std::int64_t n) override {
    static_assert(std::is_trivially_copyable_v<T>);  // zero is all-bits-zero in every dtype
    if (n > 0) std::memset(static_cast<void*>(x), 0, static_cast<std::size_t>(n) * sizeof(T));
  }
  void copy(T* dst, const T* src, std::int64_t n) override {
    if (n > 0) {
      std::memmove(static_cast<void*>(dst), static_cast<const void*>(src),
                   static_cast<std::size_t>(n) * sizeof(T));
    }
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }
  void add(T* y, const T* a, const T* b, std::int64_t n) override { ops::cpu::add(y, a, b, n); }
  void accumulate(T* y, const T* x, std::int64_t n) override { ops::cpu::accumulate(y, x, n); }
  void add_periodic_rows(T* y, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                         std::int64_t C) override {
    ops::cpu::add_periodic_rows(y, x, rows, N, R, C);
  }

  void embedding_forward(T* y, const std::int32_t* tokens, const T* wte, const T* wpe,
                         std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) override {
    ops::cpu::embedding_forward<T>(y, tokens, wte, wpe, B, Tn, C, V);
  }
  void embedding_backward(T* dwte, T* dwpe, const T* dy, const std::int32_t* tokens, std::int64_t B,
                          std::int64_t Tn, std::int64_t C, std::int64_t /*V*/) override {
    ops::cpu::embedding_backward<T>(dwte, dwpe, dy, tokens, B, Tn, C);
  }

  void linear_forward(T* y, const T* x, const T* w, const T* b, std::int64_t N, std::int64_t in,
                      std::int64_t out) override {
    ops::cpu::linear_forward<T>(y, x, w, b, N, in, out);
  }
  void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, std::int64_t N,
                       std::int64_t in, std::int64_t out, bool overwrite_dx) override {
    ops::cpu::linear_backward<T>(dx, dw, db, dy, x, w, N, in, out, overwrite_dx);
  }
  void layer_norm_forward(T* y, Stat* mean, Stat* rstd, const T* x, const T* w, const T* b,
                          std::int64_t N, std::int64_t C) override {
    ops::cpu::layer_norm_forward(y, mean, rstd, x, w, b, N, C);
  }
  void layer_norm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                           const Stat* mean, const Stat* rstd, std::int64_t N, std::int64_t C,
                           bool overwrite_dx) override {
    ops::cpu::layer_norm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, overwrite_dx);
  }
  void gelu_forward(T* y, const T* x, std::int64_t n) override { ops::cpu::gelu_forward(y, x, n); }
  void gelu_backward(T* dx, const T* x, const T* dy, std::int64_t n, bool overwrite_dx) override {
    ops::cpu::gelu_backward(dx, x, dy, n, overwrite_dx);
  }
  void dropout_forward(T* y, const T* x, std::int64_t n,
                       const ops::cpu::DropoutMask& mask) override {
    ops::cpu::dropout_forward(y, x, n, mask);
  }
  void dropout_backward(T* dx, const T* dy, std::int64_t n,
                        const ops::cpu::DropoutMask& mask) override {
    ops::cpu::dropout_backward(dx, dy, n, mask);
  }

  void rms_norm_forward(T* y, Stat* rstd, const T* x, const T* w, std::int64_t N, std::int64_t C,
                        Stat eps) override {
    ops::cpu::rms_norm_forward(y, rstd, x, w, N, C, eps);
  }
  void rms_norm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const Stat* rstd,
                         std::int64_t N, std::int64_t C) override {
    ops::cpu::rms_norm_backward(dx, dw, dy, x, w, rstd, N, C);
  }
  void rotary_forward(T* y, const T* x, const Stat* cos, const Stat* sin, std::int64_t N,
                      std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                      std::int64_t head_size) override {
    ops::cpu::rotary_forward(y, x, cos, sin, N, seq_len, kv_heads, group, head_size);
  }
  void rotary_backward(T* dx, const T* dy, const Stat* cos, const Stat* sin, std::int64_t N,
                       std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                       std::int64_t head_size, bool overwrite_dx) override {
    ops::cpu::rotary_backward(dx, dy, cos, sin, N, seq_len, kv_heads, group, head_size,
                              overwrite_dx);
  }
  void repeat_kv_forward(T* y, const T* x, std::int64_t N, std::int64_t kv_heads,
                         std::int64_t group, std::int64_t head_size) override {
    ops::cpu::repeat_kv_forward(y, x, N, kv_heads, group, head_size);
  }
  void repeat_kv_backward(T* dx, const T* dy, std::int64_t N, std::int64_t kv_heads,
                          std::int64_t group, std::int64_t head_size, bool overwrite_dx) override {
    ops::cpu::repeat_kv_backward(dx, dy, N, kv_heads, group, head_size, overwrite_dx);
  }
  void swiglu_forward(T* y, const T* x, std::int64_t N, std::int64_t F) override {
    ops::cpu::swiglu_forward(y, x, N, F);
  }
  void swiglu_backward(T* dx, const T* x, const T* dy, std::int64_t N, std::int64_t F,
                       bool overwrite_dx) override {
    ops::cpu::swiglu_backward(dx, x, dy, N, F, overwrite_dx);
  }

  std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                   std::int64_t V) override {
    return ops::cpu::count_valid_targets(targets, N, V);
  }
  void cross_entropy_forward(Stat* losses, const T* logits, const std::int32_t* targets,
                             std::int64_t N, std::int64_t V, std::int64_t ld,
                             Stat* row_stats) override {
    ops::cpu::cross_entropy_forward(losses, logits, targets, N, V, row_stats, ld);
  }
  Stat cross_entropy_mean(const Stat* losses, const std::int32_t* targets, std::int64_t N,
                          std::int64_t valid) override {
    (void)targets;  // ignored rows' losses are zeros
    return ops::cpu::cross_entropy_mean(losses, N, valid);
  }
  void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                              std::int64_t N, std::int64_t V, std::int64_t ld, Stat dloss,
                              std::int64_t valid, const Stat* row_stats) override {
    ops::cpu::cross_entropy_backward(dlogits, logits, targets, N, V, dloss, valid, row_stats, ld);
  }

  /// The host keeps the probabilities [B, NH, Tn, Tn] in T.
  std::size_t attention_saved_bytes(std::int64_t B, std::int64_t Tn,
                                    std::int64_t NH) const override {
    return static_cast<std::size_t>(B * NH * Tn * Tn) * sizeof(T);
  }
  void attention_forward(T* y, std::byte* saved, const T* qkv, std::int64_t B, std::int64_t Tn,
                         std::int64_t C, std::int64_t NH,
                         const ops::cpu::DropoutMask& mask) override {
    ops::cpu::attention_forward(y, reinterpret_cast<T*>(saved), qkv, B, Tn, C, NH, mask);
  }
  /// y is not used: the host's backward sums att * datt from the probabilities it saved. It
  /// adds, so overwrite_dx zeroes dqkv first (the bits of a zeroed buffer).
  void attention_backward(T* dqkv, const T* dy, const T* qkv, const T* y, const std::byte* saved,
                          std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                          const ops::cpu::DropoutMask& mask, bool overwrite_dx) override {
    (void)y;
    if (overwrite_dx) fill_zero(dqkv, B * Tn * 3 * C);
    ops::cpu::attention_backward(dqkv, dy, qkv, reinterpret_cast<const T*>(saved), B, Tn, C, NH,
                                 mask);
  }
};

/// The host kernel set of element type T (one shared, stateless instance).
template <class T>
HostKernels<T>& host_kernels() {
  static HostKernels<T> kernels;
  return kernels;
}

/// The kernel set of a pass: ctx.kernels, or the host's when none was set.
template <class T>
Kernels<T>& kernels_of(const StepContext<T>& ctx) {
  return ctx.kernels != nullptr ? *ctx.kernels : host_kernels<T>();
}

/// Throws Error naming layer when the pass's kernels run on another device than the host: for
/// layers whose kernels exist only in ops::cpu.
template <class T>
void expect_host_kernels(const StepContext<T>& ctx, const std::string& layer) {
  const DeviceKind device = kernels_of(ctx).device();
  expect<Error>(device == DeviceKind::host, layer, " has host kernels only, and this pass runs on ",
                "the ", name_of(device), " device: keep the model on Compute<Host>, or use ",
                "layers with device kernels (docs/cuda.md lists them)");
}

/// Throws InputError naming layer when the micro-batch input name is memory of another device
/// than the pass's kernels (the engine moves tokens and targets; named inputs stay where the
/// caller put them).
template <class T, class U>
void expect_input_on_kernels_device(const StepContext<T>& ctx, const Tensor<U>& input,
                                    const std::string& name, const std::string& layer) {
  const DeviceKind device = kernels_of(ctx).device();
  expect<InputError>(input.device() == device, layer, ": input '", name, "' is ",
                     name_of(input.device()), " memory, and this pass runs on the ",
                     name_of(device), " device; give the micro-batch its inputs in ",
                     name_of(device), " memory");
}

}  // namespace zero::nn
