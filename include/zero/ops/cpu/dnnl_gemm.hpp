#pragma once
// GEMM through oneDNN's matmul primitive (zero::dnnl, Debian's libdnnl-dev): A and B both f32 or
// both bf16, a float C, C = alpha op(A) op(B) + beta C with the accumulation in float. oneDNN
// JIT-compiles its kernels for the CPU it runs on: f32 on AVX-512 or AVX2 (its brgemm kernels run
// 5-20% faster than OpenBLAS 0.3.21's sgemm on the GPT's shapes here, docs/models.md), bf16 on
// AMX or AVX512-BF16 where the CPU has them (about 5x the widen+sgemm path on a Sapphire Rapids
// core); elsewhere bf16 may be emulated or refused. A refusal, or a result that differs from the
// float GEMM on exact integer data (check_gemm_kernel in gemm.hpp), leaves gemm<T> on its other
// paths. Transposes are strides of the memory descriptors, so nothing is copied. A float bias
// added to every row of C (a linear layer's forward) is oneDNN's bias argument: C is then written
// without being first filled with the bias and read back.
// One primitive per (element type, transposes, sizes, leading dimensions, alpha, beta, threads,
// bias),
// created on first use and cached; execution is thread-safe (each call brings its own scratch
// memory), so the GEMM's fixed tiles run it from the OpenMP threads. The library's primitives are
// single-threaded: oneDNN splits a matmul's work (over M and N, and for some shapes over K, which
// changes the order of the sums) by the OpenMP thread count it sees when the primitive is created,
// so they are created with that count at 1 (inside an OpenMP region oneDNN runs on the calling
// thread anyway). The result then depends on the tiles only, never on the thread count.
// zero-requires: dnnl (which brings OpenMP, oneDNN's threading runtime in Debian's build)

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <zero/core/dtype.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

namespace detail {

// A cached matmul primitive with its memory descriptors.
struct DnnlMatmul {
  dnnl::memory::desc a, b, c;
  dnnl::memory::desc bias;        // [1, N] f32, empty without a bias
  dnnl::memory::desc scratchpad;  // the primitive's scratch memory, which each call provides
  dnnl::matmul primitive;
};

// The CPU engine, the primitive cache and its lock (process-wide: primitives are immutable and
// JIT-compiled once per shape).
struct DnnlState {
  using Key = std::tuple<dnnl::memory::data_type, bool, bool, int, int, int, int, int, int, float,
                         float, int, bool>;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<Key, std::shared_ptr<const DnnlMatmul>> cache;
};

inline DnnlState& dnnl_state() {
  static DnnlState state;  // created on the first oneDNN GEMM
  return state;
}

// oneDNN's name for the element type of A and B.
template <class T>
constexpr dnnl::memory::data_type dnnl_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                "oneDNN GEMM takes float or bf16 operands");
  return std::is_same_v<T, float> ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
}

// Sets the OpenMP thread count of this thread (no-op without OpenMP).
inline void dnnl_set_max_threads([[maybe_unused]] int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
}

// The primitive for one shape (created under the lock on first use), made for `threads` OpenMP
// threads, with an f32 bias [N] added to every row when `bias`. beta 0 has no sum post-op, so C
// is written without being read. Throws dnnl::error when oneDNN cannot run this matmul on this
// CPU.
inline std::shared_ptr<const DnnlMatmul> dnnl_matmul(dnnl::memory::data_type type, bool ta, bool tb,
                                                     int M, int N, int K, int lda, int ldb, int ldc,
                                                     float alpha, float beta, int threads,
                                                     bool bias = false) {
  DnnlState& state = dnnl_state();
  const DnnlState::Key key{type, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta, threads, bias};
  const std::lock_guard lock(state.mutex);
  if (const auto it = state.cache.find(key); it != state.cache.end()) return it->second;
  using dims = dnnl::memory::dims;
  auto entry = std::make_shared<DnnlMatmul>();
  entry->a = dnnl::memory::desc(dims{M, K}, type, ta ? dims{1, lda} : dims{lda, 1});
  entry->b = dnnl::memory::desc(dims{K, N}, type, tb ? dims{1, ldb} : dims{ldb, 1});
  entry->c = dnnl::memory::desc(dims{M, N}, dnnl::memory::data_type::f32, dims{ldc, 1});
  if (bias) entry->bias = dnnl::memory::desc(dims{1, N}, dnnl::memory::data_type::f32, dims{N, 1});
  dnnl::primitive_attr attr;
  // oneDNN's own scratchpad is one buffer for the whole library unless it was built for
  // concurrent execution; tiles run concurrently (and ranks may be threads), so each call brings
  // its own.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops sum;
    sum.append_sum(beta);
    attr.set_post_ops(sum);
  }
  // oneDNN reads the thread count when the primitive is created (see the top of this file).
  const int saved_threads = num_threads();
  dnnl_set_max_threads(threads);
  try {
    const dnnl::matmul::desc desc =
        bias ? dnnl::matmul::desc(entry->a, entry->b, entry->bias, entry->c)
             : dnnl::matmul::desc(entry->a, entry->b, entry->c);
    const dnnl::matmul::primitive_desc pd(desc, attr, state.engine);
    entry->primitive = dnnl::matmul(pd);
    entry->scratchpad = pd.scratchpad_desc();
  } catch (...) {
    dnnl_set_max_threads(saved_threads);
    throw;
  }
  dnnl_set_max_threads(saved_threads);
  if (state.cache.size() >= 4096) state.cache.clear();  // a bound for programs of many shapes
  return state.cache.emplace(key, std::move(entry)).first->second;
}

// Runs mm on the calling thread (or on the OpenMP threads it was made for) with this thread's
// scratch memory; bias is read when mm has one.
template <class T>
void dnnl_execute(const DnnlMatmul& mm, const T* A, const T* B, const float* bias, float* C) {
  const dnnl::engine& engine = dnnl_state().engine;
  // A stream per call: cheap next to a tile's product, and a thread_local one would outlive the
  // library's state in OpenMP's pool threads, which are torn down after static destructors.
  dnnl::stream stream(engine);
  // oneDNN takes non-const handles; it only reads A, B and the bias.
  dnnl::memory a(mm.a, engine, const_cast<T*>(A));
  dnnl::memory b(mm.b, engine, const_cast<T*>(B));
  dnnl::memory c(mm.c, engine, C);
  // This thread's scratch bytes, grown as needed (plain memory, so freeing it at thread exit
  // does not touch oneDNN).
  thread_local std::vector<std::byte> scratch;
  if (scratch.size() < mm.scratchpad.get_size()) scratch.resize(mm.scratchpad.get_size());
  dnnl::memory scratchpad(mm.scratchpad, engine, scratch.data());
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, a},
                                             {DNNL_ARG_WEIGHTS, b},
                                             {DNNL_ARG_DST, c},
                                             {DNNL_ARG_SCRATCHPAD, scratchpad}};
  if (bias != nullptr) {
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(mm.bias, engine, const_cast<float*>(bias)));
  }
  mm.primitive.execute(stream, args);
  stream.wait();
}

}  // namespace detail

/// C[M,N] = alpha op(A) op(B) + beta C, A and B float or bf16 (row-major, leading dimensions
/// lda, ldb), C float (ldc); beta 0 does not read C. On the calling thread: its result depends on
/// the arguments only. With threaded set, on the OpenMP threads (outside an OpenMP region; the
/// result may then depend on their number: benchmarks only). Throws dnnl::error where oneDNN
/// cannot run it.
template <class T>
void onednn_gemm(bool ta, bool tb, int M, int N, int K, float alpha, const T* A, int lda,
                 const T* B, int ldb, float beta, float* C, int ldc, bool threaded = false) {
  const auto mm = detail::dnnl_matmul(detail::dnnl_type<T>(), ta, tb, M, N, K, lda, ldb, ldc, alpha,
                                      beta, threaded ? num_threads() : 1);
  detail::dnnl_execute(*mm, A, B, nullptr, C);
}

/// C[M,N] = op(A) op(B) + bias, the float bias [N] added to every row (oneDNN's bias argument:
/// C is written without being read), on the calling thread. Throws dnnl::error where oneDNN
/// cannot run it.
template <class T>
void onednn_gemm_bias(bool ta, bool tb, int M, int N, int K, const T* A, int lda, const T* B,
                      int ldb, const float* bias, float* C, int ldc) {
  const auto mm = detail::dnnl_matmul(detail::dnnl_type<T>(), ta, tb, M, N, K, lda, ldb, ldc, 1.0f,
                                      0.0f, 1, true);
  detail::dnnl_execute(*mm, A, B, bias, C);
}

}  // namespace zero::ops::cpu
