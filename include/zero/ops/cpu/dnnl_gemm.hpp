#pragma once
// bf16 GEMM through oneDNN's matmul primitive (zero::dnnl, Debian's libdnnl-dev): bf16 A and B,
// float C accumulated in place, C += alpha op(A) op(B), the accumulation in float. On CPUs with
// AMX or AVX512-BF16 oneDNN runs the products on those units (about 5x the widen+sgemm path on
// a Sapphire Rapids core); elsewhere it may emulate or refuse, and a refusal, or a result that
// differs from sgemm on exact integer data (check_bf16_gemm in gemm.hpp), leaves bf16 GEMM on
// its other paths. Transposes are strides of the memory descriptors, so nothing is copied.
// One primitive per (transposes, sizes, leading dimensions, alpha), created on first use
// and cached; execution is thread-safe, so the GEMM's fixed tiles run it from the OpenMP threads
// (oneDNN inside an OpenMP region runs on the calling thread, which keeps the tiles
// single-threaded and the result independent of the thread count).
// zero-requires: dnnl

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include <oneapi/dnnl/dnnl.hpp>

#include <zero/core/dtype.hpp>

namespace zero::ops::cpu {

namespace detail {

// A cached matmul primitive with its memory descriptors.
struct DnnlMatmul {
  dnnl::memory::desc a, b, c;
  dnnl::matmul primitive;
};

// The CPU engine, the primitive cache and its lock (process-wide: primitives are immutable and
// JIT-compiled once per shape).
struct DnnlState {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<std::tuple<bool, bool, int, int, int, int, int, int, float>,
           std::shared_ptr<const DnnlMatmul>>
      cache;
};

inline DnnlState& dnnl_state() {
  static DnnlState state;  // created on the first bf16 GEMM
  return state;
}

// The primitive for one shape (created under the lock on first use). Throws dnnl::error when
// oneDNN cannot run this matmul on this CPU.
inline std::shared_ptr<const DnnlMatmul> dnnl_matmul(bool ta, bool tb, int M, int N, int K, int lda,
                                                     int ldb, int ldc, float alpha) {
  DnnlState& state = dnnl_state();
  const auto key = std::make_tuple(ta, tb, M, N, K, lda, ldb, ldc, alpha);
  const std::lock_guard lock(state.mutex);
  if (const auto it = state.cache.find(key); it != state.cache.end()) return it->second;
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  auto entry = std::make_shared<DnnlMatmul>();
  entry->a = dnnl::memory::desc(dims{M, K}, dt::bf16, ta ? dims{1, lda} : dims{lda, 1});
  entry->b = dnnl::memory::desc(dims{K, N}, dt::bf16, tb ? dims{1, ldb} : dims{ldb, 1});
  entry->c = dnnl::memory::desc(dims{M, N}, dt::f32, dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  dnnl::post_ops accumulate;
  accumulate.append_sum(1.0f);
  attr.set_post_ops(accumulate);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(entry->a, entry->b, entry->c), attr,
                                        state.engine);
  entry->primitive = dnnl::matmul(pd);
  if (state.cache.size() >= 4096) state.cache.clear();  // a bound for programs of many shapes
  return state.cache.emplace(key, std::move(entry)).first->second;
}

}  // namespace detail

/// C[M,N] += alpha op(A) op(B) on the calling thread, A and B bf16 (row-major, leading
/// dimensions lda, ldb), C float (ldc). Throws dnnl::error where oneDNN cannot run it.
inline void dnnl_bf16_gemm_accumulate(bool ta, bool tb, int M, int N, int K, float alpha,
                                      const bf16* A, int lda, const bf16* B, int ldb, float* C,
                                      int ldc) {
  const auto mm = detail::dnnl_matmul(ta, tb, M, N, K, lda, ldb, ldc, alpha);
  const dnnl::engine& engine = detail::dnnl_state().engine;
  dnnl::stream stream(engine);
  // oneDNN takes non-const handles; it only reads A and B.
  dnnl::memory a(mm->a, engine, const_cast<bf16*>(A));
  dnnl::memory b(mm->b, engine, const_cast<bf16*>(B));
  dnnl::memory c(mm->c, engine, C);
  mm->primitive.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream.wait();
}

}  // namespace zero::ops::cpu
