#pragma once
// zero-requires: cuda
// One fused optimizer pass on the GPU, for any update rule (optim/update_rules.hpp): per element,
// widen the gradient (fp32, bf16 or f16), multiply it by grad_scale (unscale and clip in one
// factor), apply the rule, store the parameter and the states, and write the bf16/f16 copy, all
// in registers. It is the device twin of the host pass in optim/cpu/fused_driver.hpp: the same
// rule runs with ScalarOps, whose device branch uses the _rn intrinsics, so nothing is contracted
// and every operation is correctly rounded. The GPU gives the host's bits (f16 NaN payloads
// aside, against the F16C host paths).
// References: llm.c's adamw.cuh (flat kernel, stochastic rounding), DeepSpeed FusedAdam.
#if !defined(__CUDACC__)
#error "optim/cuda/fused_pass.cuh needs nvcc; host-only code includes optim/cpu/fused_driver.hpp"
#endif

#include <cstddef>
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optim/fused_io.hpp>
#include <optim/lane_ops.hpp>
#include <optim/param_groups.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/float16.hpp>

namespace zero::optim::cuda {

// ---- element loads and stores -------------------------------------------------------------------

/// What the kernel writes besides fp32 (a run-time choice: one kernel serves all).
enum class LowpKind : int { none, bf16_nearest, bf16_stochastic, f16_nearest };

/// One bf16 gradient element widened to float (exact).
__device__ __forceinline__ float widen_bf16(std::uint16_t b) {
  return bf16::to_float(b);
}
/// One f16 gradient element widened to float (exact; the hardware conversion).
__device__ __forceinline__ float widen_f16(std::uint16_t b) {
  return __half2float(__ushort_as_half(b));
}

/// The 16-bit copy of x for element index (global flat index, for the random bits). The rounding
/// is core/bfloat16.hpp's and core/float16.hpp's own __host__ __device__ functions, the scalar
/// host pass's rule, so the copies equal its bits (NaN payloads included; the host's F16C paths
/// may give other NaN payloads).
__device__ __forceinline__ std::uint16_t lowp_bits(float x, LowpKind kind, std::uint64_t key,
                                                   std::uint32_t step, std::uint64_t index) {
  switch (kind) {
    case LowpKind::bf16_stochastic:
      return bf16::round_stochastic(x, rounding_bits(key, step, index));
    case LowpKind::f16_nearest:
      return f16::round_nearest_even(x);
    default:
      return bf16::round_nearest_even(x);
  }
}

/// The low-precision kind io asks for.
inline LowpKind lowp_kind_of(const FusedIo& io) {
  if (io.lowp == nullptr) return LowpKind::none;
  if (io.lowp_dtype == DType::f16) return LowpKind::f16_nearest;
  return io.rounding == Rounding::stochastic ? LowpKind::bf16_stochastic : LowpKind::bf16_nearest;
}

// ---- kernel -------------------------------------------------------------------------------------

/// The most state buffers a rule has (RMSprop, centered with momentum).
inline constexpr int max_rule_states = 3;

/// Arguments of one launch of Rule over elements [begin, begin + count) of the shard.
template <class Rule>
struct PassLaunch {
  static_assert(Rule::states <= max_rule_states, "PassLaunch: a rule with more state buffers");
  Rule rule;
  float* param;
  float* states[max_rule_states];
  const void* grad;
  float grad_scale;
  std::uint16_t* lowp;  // null: no copy
  LowpKind lowp_kind;
  std::uint64_t key;
  std::uint32_t step;
  std::uint64_t first_index;
  std::size_t begin;
  std::size_t count;
};

/// Loads Vec consecutive floats at p (float4 when Vec is 4).
template <int Vec>
__device__ __forceinline__ void load_floats(const float* p, float* out) {
  if constexpr (Vec == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
  } else {
    out[0] = *p;
  }
}
/// Stores Vec consecutive floats at p.
template <int Vec>
__device__ __forceinline__ void store_floats(float* p, const float* in) {
  if constexpr (Vec == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  } else {
    *p = in[0];
  }
}
/// Loads Vec gradient elements at element i, widened to float. GradKind: 0 f32, 1 bf16, 2 f16.
template <int Vec, int GradKind>
__device__ __forceinline__ void load_grads(const void* grad, std::size_t i, float* out) {
  if constexpr (GradKind == 0) {
    load_floats<Vec>(static_cast<const float*>(grad) + i, out);
  } else {
    const std::uint16_t* g = static_cast<const std::uint16_t*>(grad) + i;
    std::uint16_t h[Vec];
    if constexpr (Vec == 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(g);
      h[0] = static_cast<std::uint16_t>(raw.x & 0xffffu);
      h[1] = static_cast<std::uint16_t>(raw.x >> 16);
      h[2] = static_cast<std::uint16_t>(raw.y & 0xffffu);
      h[3] = static_cast<std::uint16_t>(raw.y >> 16);
    } else {
      h[0] = *g;
    }
#pragma unroll
    for (int l = 0; l < Vec; ++l) out[l] = GradKind == 1 ? widen_bf16(h[l]) : widen_f16(h[l]);
  }
}

/// Vec consecutive elements per thread (4: 128-bit fp32 loads and stores, 64-bit for 16-bit
/// data; 1: any alignment), grid-stride over the range. GradKind: 0 f32, 1 bf16, 2 f16. The
/// order of operations is fused_range's (cpu/fused_driver.hpp).
template <class Rule, int Vec, int GradKind>
__global__ void fused_pass_kernel(PassLaunch<Rule> a) {
  constexpr int n = Rule::states > 0 ? Rule::states : 1;
  const std::size_t groups = a.count / Vec;
  for (std::size_t k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t i = a.begin + k * Vec;
    float p[Vec], g[Vec], s[n][Vec];
    load_floats<Vec>(a.param + i, p);
    if constexpr (Rule::reads_grad) load_grads<Vec, GradKind>(a.grad, i, g);
#pragma unroll
    for (int j = 0; j < Rule::states; ++j) load_floats<Vec>(a.states[j] + i, s[j]);
    std::uint16_t low[Vec];
#pragma unroll
    for (int l = 0; l < Vec; ++l) {
      float gl = p[l];
      if constexpr (Rule::reads_grad) gl = ScalarOps::mul(g[l], a.grad_scale);
      float sl[n];
#pragma unroll
      for (int j = 0; j < Rule::states; ++j) sl[j] = s[j][l];
      a.rule.template apply<ScalarOps>(p[l], gl, sl);
#pragma unroll
      for (int j = 0; j < Rule::states; ++j) s[j][l] = sl[j];
      if (Rule::writes_param && a.lowp != nullptr) {
        low[l] = lowp_bits(p[l], a.lowp_kind, a.key, a.step, a.first_index + i + l);
      }
    }
    if constexpr (Rule::writes_param) {
      store_floats<Vec>(a.param + i, p);
      if (a.lowp != nullptr) {
        if constexpr (Vec == 4) {
          *reinterpret_cast<uint2*>(a.lowp + i) =
              make_uint2(low[0] | (static_cast<std::uint32_t>(low[1]) << 16),
                         low[2] | (static_cast<std::uint32_t>(low[3]) << 16));
        } else {
          a.lowp[i] = low[0];
        }
      }
    }
    if constexpr (Rule::writes_states) {
#pragma unroll
      for (int j = 0; j < Rule::states; ++j) store_floats<Vec>(a.states[j] + i, s[j]);
    }
  }
}

// ---- launcher -----------------------------------------------------------------------------------

/// True when p is aligned to bytes.
inline bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// Launches fused_pass_kernel<Rule, Vec> for grad_dtype on stream and checks the launch.
template <int Vec, class Rule>
void launch_fused_pass(const PassLaunch<Rule>& a, DType grad_dtype, cudaStream_t stream) {
  if (a.count / Vec == 0) return;
  constexpr int threads = 256;
  const std::size_t needed = (a.count / Vec + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(needed < 65535 ? needed : 65535);
  switch (grad_dtype) {
    case DType::bf16:
      fused_pass_kernel<Rule, Vec, 1><<<blocks, threads, 0, stream>>>(a);
      break;
    case DType::f16:
      fused_pass_kernel<Rule, Vec, 2><<<blocks, threads, 0, stream>>>(a);
      break;
    default:
      fused_pass_kernel<Rule, Vec, 0><<<blocks, threads, 0, stream>>>(a);
      break;
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// One fused pass of rule over range of the shard io (device pointers) with the state buffers
/// states (Rule::states of them, each io.numel floats), on stream: a scalar head up to 16-byte
/// alignment, 4-wide vectors, a scalar tail (or scalar throughout when the buffers are not
/// mutually aligned).
template <class Rule>
void fused_pass(const Rule& rule, const FusedIo& io, float* const* states, Range range,
                std::uint32_t step, cudaStream_t stream) {
  PassLaunch<Rule> a{};
  a.rule = rule;
  a.param = io.param;
  for (int j = 0; j < Rule::states; ++j) a.states[j] = states[j];
  a.grad = io.grad;
  a.grad_scale = io.grad_scale;
  a.lowp = static_cast<std::uint16_t*>(io.lowp);
  a.lowp_kind = lowp_kind_of(io);
  a.key = io.rounding_key;
  a.step = step;
  a.first_index = io.first_index;
  a.begin = range.offset;
  a.count = range.count;
  const std::size_t grad_bytes = io.grad_dtype == DType::f32 ? 4 : 2;
  std::size_t head = 0;
  while (head < range.count && !aligned(io.param + range.offset + head, 16)) ++head;
  const std::size_t start = range.offset + head;
  bool vectorizable =
      (!Rule::reads_grad ||
       aligned(static_cast<const char*>(io.grad) + start * grad_bytes, 4 * grad_bytes)) &&
      (io.lowp == nullptr || aligned(static_cast<std::uint16_t*>(io.lowp) + start, 8));
  for (int j = 0; j < Rule::states; ++j)
    vectorizable = vectorizable && aligned(states[j] + start, 16);
  if (!vectorizable) {
    launch_fused_pass<1>(a, io.grad_dtype, stream);
    return;
  }
  PassLaunch<Rule> part = a;
  part.count = head;
  launch_fused_pass<1>(part, io.grad_dtype, stream);
  part.begin = start;
  part.count = (range.count - head) / 4 * 4;
  launch_fused_pass<4>(part, io.grad_dtype, stream);
  part.begin = start + part.count;
  part.count = range.count - head - part.count;
  launch_fused_pass<1>(part, io.grad_dtype, stream);
}

}  // namespace zero::optim::cuda
