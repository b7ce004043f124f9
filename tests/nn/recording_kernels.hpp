#pragma once
// RecordingKernels: the host kernel set (nn::HostKernels) counting each call by name, for tests
// that check which kernels a layer, a model or the engine ran through the pass's set. device()
// reports what the test asks for; the memory stays the host's, so a "cuda" set only tests
// refusals.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include <zero/core/device.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/kernels.hpp>

namespace zero::test {

/// The host kernels, counting each call by name (see the file comment).
template <class T>
class RecordingKernels final : public nn::Kernels<T> {
 public:
  using Stat = typename nn::Kernels<T>::Stat;
  /// A set reporting device; every call is also added to *tally when given (sets of several
  /// threads, one per rank, counting into one atomic).
  explicit RecordingKernels(DeviceKind device = DeviceKind::host,
                            std::atomic<long>* tally = nullptr)
      : device_(device), tally_(tally) {}

  /// Calls by kernel name.
  std::map<std::string, int> calls;
  /// logits_row_stride's multiple.
  std::int64_t logits_row_align = 1;

  DeviceKind device() const override { return device_; }
  nn::KernelMemory allocate(std::size_t bytes) override {
    note("allocate");
    return host().allocate(bytes);
  }
  void fill_zero(T* x, std::int64_t n) override {
    note("fill_zero");
    host().fill_zero(x, n);
  }
  void copy(T* dst, const T* src, std::int64_t n) override {
    note("copy");
    host().copy(dst, src, n);
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    note("copy_from_host");
    host().copy_from_host(dst, src, bytes);
  }
  void add(T* y, const T* a, const T* b, std::int64_t n) override {
    note("add");
    host().add(y, a, b, n);
  }
  void accumulate(T* y, const T* x, std::int64_t n) override {
    note("accumulate");
    host().accumulate(y, x, n);
  }
  void add_periodic_rows(T* y, const T* x, const T* rows, std::int64_t N, std::int64_t R,
                         std::int64_t C) override {
    note("add_periodic_rows");
    host().add_periodic_rows(y, x, rows, N, R, C);
  }
  void embedding_forward(T* y, const std::int32_t* tokens, const T* wte, const T* wpe,
                         std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t V) override {
    note("embedding_forward");
    host().embedding_forward(y, tokens, wte, wpe, B, Tn, C, V);
  }
  void embedding_backward(T* dwte, T* dwpe, const T* dy, const std::int32_t* tokens, std::int64_t B,
                          std::int64_t Tn, std::int64_t C, std::int64_t V) override {
    note("embedding_backward");
    host().embedding_backward(dwte, dwpe, dy, tokens, B, Tn, C, V);
  }
  std::int64_t count_valid_targets(const std::int32_t* targets, std::int64_t N,
                                   std::int64_t V) override {
    note("count_valid_targets");
    return host().count_valid_targets(targets, N, V);
  }
  /// V rounded up to a multiple of logits_row_align (1 unless the test asks): a set that pads
  /// the loss layers' logits rows as the device's does.
  std::int64_t logits_row_stride(std::int64_t V) const override {
    return (V + logits_row_align - 1) / logits_row_align * logits_row_align;
  }
  void cross_entropy_forward(Stat* losses, const T* logits, const std::int32_t* targets,
                             std::int64_t N, std::int64_t V, std::int64_t ld,
                             Stat* row_stats) override {
    note("cross_entropy_forward");
    host().cross_entropy_forward(losses, logits, targets, N, V, ld, row_stats);
  }
  Stat cross_entropy_mean(const Stat* losses, const std::int32_t* targets, std::int64_t N,
                          std::int64_t valid) override {
    note("cross_entropy_mean");
    return host().cross_entropy_mean(losses, targets, N, valid);
  }
  void cross_entropy_forward_backward(Stat* losses, T* dlogits, const T* logits,
                                      const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                      std::int64_t ld, Stat* row_stats, Stat dloss,
                                      std::int64_t valid) override {
    note("cross_entropy_forward_backward");
    host().cross_entropy_forward_backward(losses, dlogits, logits, targets, N, V, ld, row_stats,
                                          dloss, valid);
  }
  void cross_entropy_backward(T* dlogits, const T* logits, const std::int32_t* targets,
                              std::int64_t N, std::int64_t V, std::int64_t ld, Stat dloss,
                              std::int64_t valid, const Stat* row_stats) override {
    note("cross_entropy_backward");
    host().cross_entropy_backward(dlogits, logits, targets, N, V, ld, dloss, valid, row_stats);
  }
  void rms_norm_forward(T* y, Stat* rstd, const T* x, const T* w, std::int64_t N, std::int64_t C,
                        Stat eps) override {
    note("rms_norm_forward");
    host().rms_norm_forward(y, rstd, x, w, N, C, eps);
  }
  void rms_norm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const Stat* rstd,
                         std::int64_t N, std::int64_t C) override {
    note("rms_norm_backward");
    host().rms_norm_backward(dx, dw, dy, x, w, rstd, N, C);
  }
  void rotary_forward(T* y, const T* x, const Stat* cos, const Stat* sin, std::int64_t N,
                      std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                      std::int64_t head_size) override {
    note("rotary_forward");
    host().rotary_forward(y, x, cos, sin, N, seq_len, kv_heads, group, head_size);
  }
  void rotary_backward(T* dx, const T* dy, const Stat* cos, const Stat* sin, std::int64_t N,
                       std::int64_t seq_len, std::int64_t kv_heads, std::int64_t group,
                       std::int64_t head_size, bool overwrite_dx) override {
    note("rotary_backward");
    host().rotary_backward(dx, dy, cos, sin, N, seq_len, kv_heads, group, head_size, overwrite_dx);
  }
  void repeat_kv_forward(T* y, const T* x, std::int64_t N, std::int64_t kv_heads,
                         std::int64_t group, std::int64_t head_size) override {
    note("repeat_kv_forward");
    host().repeat_kv_forward(y, x, N, kv_heads, group, head_size);
  }
  void repeat_kv_backward(T* dx, const T* dy, std::int64_t N, std::int64_t kv_heads,
                          std::int64_t group, std::int64_t head_size, bool overwrite_dx) override {
    note("repeat_kv_backward");
    host().repeat_kv_backward(dx, dy, N, kv_heads, group, head_size, overwrite_dx);
  }
  void swiglu_forward(T* y, const T* x, std::int64_t N, std::int64_t F) override {
    note("swiglu_forward");
    host().swiglu_forward(y, x, N, F);
  }
  void swiglu_backward(T* dx, const T* x, const T* dy, std::int64_t N, std::int64_t F,
                       bool overwrite_dx) override {
    note("swiglu_backward");
    host().swiglu_backward(dx, x, dy, N, F, overwrite_dx);
  }
  void linear_forward(T* y, const T* x, const T* w, const T* b, std::int64_t N, std::int64_t in,
                      std::int64_t out) override {
    note("linear_forward");
    host().linear_forward(y, x, w, b, N, in, out);
  }
  void linear_forward_add(T* y, const T* skip, const T* x, const T* w, const T* b, std::int64_t N,
                          std::int64_t in, std::int64_t out) override {
    note("linear_forward_add");
    host().linear_forward_add(y, skip, x, w, b, N, in, out);
  }
  void linear_gelu_forward(T* pre, T* y, const T* x, const T* w, const T* b, std::int64_t N,
                           std::int64_t in, std::int64_t out) override {
    note("linear_gelu_forward");
    host().linear_gelu_forward(pre, y, x, w, b, N, in, out);
  }
  /// Whether the set says it fuses a linear layer's backward through the GELU before it (false,
  /// as the host's, unless the test asks); the fused call is then the host's two kernels.
  bool fuse_gelu_backward = false;
  bool fuses_gelu_backward() const override { return fuse_gelu_backward; }
  void linear_backward_gelu(T* dpre, T* dw, T* db, const T* dy, const T* x, const T* w,
                            const T* pre, std::int64_t N, std::int64_t in,
                            std::int64_t out) override {
    note("linear_backward_gelu");
    host().linear_backward_gelu(dpre, dw, db, dy, x, w, pre, N, in, out);
  }
  void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, std::int64_t N,
                       std::int64_t in, std::int64_t out, bool overwrite_dx) override {
    note("linear_backward");
    host().linear_backward(dx, dw, db, dy, x, w, N, in, out, overwrite_dx);
  }
  void layer_norm_forward(T* y, Stat* mean, Stat* rstd, const T* x, const T* w, const T* b,
                          std::int64_t N, std::int64_t C) override {
    note("layer_norm_forward");
    host().layer_norm_forward(y, mean, rstd, x, w, b, N, C);
  }
  void layer_norm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                           const Stat* mean, const Stat* rstd, std::int64_t N, std::int64_t C,
                           bool overwrite_dx) override {
    note("layer_norm_backward");
    host().layer_norm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, overwrite_dx);
  }
  void layer_norm_backward_from(T* dx, const T* start, T* dw, T* db, const T* dy, const T* x,
                                const T* w, const Stat* mean, const Stat* rstd, std::int64_t N,
                                std::int64_t C) override {
    note("layer_norm_backward_from");
    host().layer_norm_backward_from(dx, start, dw, db, dy, x, w, mean, rstd, N, C);
  }
  void gelu_forward(T* y, const T* x, std::int64_t n) override {
    note("gelu_forward");
    host().gelu_forward(y, x, n);
  }
  void gelu_backward(T* dx, const T* x, const T* dy, std::int64_t n, bool overwrite_dx) override {
    note("gelu_backward");
    host().gelu_backward(dx, x, dy, n, overwrite_dx);
  }
  void dropout_forward(T* y, const T* x, std::int64_t n,
                       const ops::cpu::DropoutMask& mask) override {
    note("dropout_forward");
    host().dropout_forward(y, x, n, mask);
  }
  void dropout_backward(T* dx, const T* dy, std::int64_t n,
                        const ops::cpu::DropoutMask& mask) override {
    note("dropout_backward");
    host().dropout_backward(dx, dy, n, mask);
  }
  std::size_t attention_saved_bytes(std::int64_t B, std::int64_t Tn,
                                    std::int64_t NH) const override {
    return nn::host_kernels<T>().attention_saved_bytes(B, Tn, NH);
  }
  void attention_forward(T* y, std::byte* saved, const T* qkv, std::int64_t B, std::int64_t Tn,
                         std::int64_t C, std::int64_t NH,
                         const ops::cpu::DropoutMask& mask) override {
    note("attention_forward");
    host().attention_forward(y, saved, qkv, B, Tn, C, NH, mask);
  }
  void attention_backward(T* dqkv, const T* dy, const T* qkv, const T* y, const std::byte* saved,
                          std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t NH,
                          const ops::cpu::DropoutMask& mask, bool overwrite_dx) override {
    note("attention_backward");
    host().attention_backward(dqkv, dy, qkv, y, saved, B, Tn, C, NH, mask, overwrite_dx);
  }

 private:
  static nn::HostKernels<T>& host() { return nn::host_kernels<T>(); }
  void note(const char* kernel) {
    ++calls[kernel];
    if (tally_ != nullptr) ++*tally_;
  }
  DeviceKind device_;
  std::atomic<long>* tally_;
};

}  // namespace zero::test
