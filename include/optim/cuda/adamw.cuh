#pragma once
// zero-requires: cuda
// Fused Adam/AdamW step on the GPU over a flat fp32 shard: unscale and clip (one factor), the
// update, and the bf16/f16 write-back of the parameters in one pass, as the host pass in
// optim/cpu/fused_driver.hpp. The per-element math is the same AdamRule (optim/update_rules.hpp)
// run with ScalarOps, whose device branch uses the _rn intrinsics: nothing is contracted and
// every operation is correctly rounded, so the GPU gives the host's bits (f16 NaN payloads aside
// against the F16C host paths).
// References: llm.c's adamw.cuh (flat kernel, stochastic rounding), DeepSpeed FusedAdam.
#if !defined(__CUDACC__)
#error "optim/cuda/adamw.cuh needs nvcc; host-only code includes optim/adam.hpp"
#endif

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optim/adam_hyper.hpp>
#include <optim/fused_io.hpp>
#include <optim/lane_ops.hpp>
#include <optim/param_groups.hpp>
#include <optim/state_dict.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/bfloat16.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
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

// ---- kernels
// -------------------------------------------------------------------------------------

/// Arguments of one launch over elements [begin, begin + count) of the shard.
struct AdamLaunch {
  AdamRule rule;
  float* param;
  float* m;
  float* v;
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

/// Vec consecutive elements per thread (4: 128-bit fp32 loads and stores, 64-bit for 16-bit
/// data; 1: any alignment), grid-stride over the range. GradKind: 0 f32, 1 bf16, 2 f16.
template <int Vec, int GradKind>
__global__ void adam_kernel(AdamLaunch a) {
  const std::size_t groups = a.count / Vec;
  for (std::size_t k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t i = a.begin + k * Vec;
    float p[Vec], m[Vec], v[Vec], g[Vec];
    if constexpr (Vec == 4) {
      const float4 p4 = *reinterpret_cast<const float4*>(a.param + i);
      const float4 m4 = *reinterpret_cast<const float4*>(a.m + i);
      const float4 v4 = *reinterpret_cast<const float4*>(a.v + i);
      p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
      m[0] = m4.x, m[1] = m4.y, m[2] = m4.z, m[3] = m4.w;
      v[0] = v4.x, v[1] = v4.y, v[2] = v4.z, v[3] = v4.w;
      if constexpr (GradKind == 0) {
        const float4 g4 = *reinterpret_cast<const float4*>(static_cast<const float*>(a.grad) + i);
        g[0] = g4.x, g[1] = g4.y, g[2] = g4.z, g[3] = g4.w;
      } else {
        const uint2 raw =
            *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(a.grad) + i);
        const std::uint16_t h[4] = {
            static_cast<std::uint16_t>(raw.x & 0xffffu), static_cast<std::uint16_t>(raw.x >> 16),
            static_cast<std::uint16_t>(raw.y & 0xffffu), static_cast<std::uint16_t>(raw.y >> 16)};
        for (int l = 0; l < 4; ++l) g[l] = GradKind == 1 ? widen_bf16(h[l]) : widen_f16(h[l]);
      }
    } else {
      p[0] = a.param[i];
      m[0] = a.m[i];
      v[0] = a.v[i];
      if constexpr (GradKind == 0) {
        g[0] = static_cast<const float*>(a.grad)[i];
      } else {
        const std::uint16_t h = static_cast<const std::uint16_t*>(a.grad)[i];
        g[0] = GradKind == 1 ? widen_bf16(h) : widen_f16(h);
      }
    }
    std::uint16_t low[Vec];
#pragma unroll
    for (int l = 0; l < Vec; ++l) {
      float s[2] = {m[l], v[l]};
      a.rule.template apply<ScalarOps>(p[l], ScalarOps::mul(g[l], a.grad_scale), s);
      m[l] = s[0];
      v[l] = s[1];
      if (a.lowp != nullptr) {
        low[l] = lowp_bits(p[l], a.lowp_kind, a.key, a.step, a.first_index + i + l);
      }
    }
    if constexpr (Vec == 4) {
      *reinterpret_cast<float4*>(a.param + i) = make_float4(p[0], p[1], p[2], p[3]);
      *reinterpret_cast<float4*>(a.m + i) = make_float4(m[0], m[1], m[2], m[3]);
      *reinterpret_cast<float4*>(a.v + i) = make_float4(v[0], v[1], v[2], v[3]);
      if (a.lowp != nullptr) {
        *reinterpret_cast<uint2*>(a.lowp + i) =
            make_uint2(low[0] | (static_cast<std::uint32_t>(low[1]) << 16),
                       low[2] | (static_cast<std::uint32_t>(low[3]) << 16));
      }
    } else {
      a.param[i] = p[0];
      a.m[i] = m[0];
      a.v[i] = v[0];
      if (a.lowp != nullptr) a.lowp[i] = low[0];
    }
  }
}

// ---- launcher
// ------------------------------------------------------------------------------------

/// True when p is aligned to bytes.
inline bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// Launches kernel<Vec> for the grad kind of io on stream and checks the launch.
template <int Vec>
void launch_adam(const AdamLaunch& a, DType grad_dtype, cudaStream_t stream) {
  if (a.count / Vec == 0) return;
  constexpr int threads = 256;
  const std::size_t needed = (a.count / Vec + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(needed < 65535 ? needed : 65535);
  switch (grad_dtype) {
    case DType::bf16:
      adam_kernel<Vec, 1><<<blocks, threads, 0, stream>>>(a);
      break;
    case DType::f16:
      adam_kernel<Vec, 2><<<blocks, threads, 0, stream>>>(a);
      break;
    default:
      adam_kernel<Vec, 0><<<blocks, threads, 0, stream>>>(a);
      break;
  }
  ZERO_CUDA_CHECK(cudaGetLastError());
}

/// One fused Adam/AdamW step of rule over range of the shard io (device pointers) with state
/// buffers m and v, on stream: a scalar head up to 16-byte alignment, 4-wide vectors, a scalar
/// tail (or scalar throughout when the buffers are not mutually aligned).
inline void adam_step(const AdamRule& rule, const FusedIo& io, float* m, float* v, Range range,
                      std::uint32_t step, cudaStream_t stream) {
  AdamLaunch a{rule,
               io.param,
               m,
               v,
               io.grad,
               io.grad_scale,
               static_cast<std::uint16_t*>(io.lowp),
               LowpKind::none,
               io.rounding_key,
               step,
               io.first_index,
               range.offset,
               range.count};
  if (io.lowp != nullptr) {
    a.lowp_kind = io.lowp_dtype == DType::f16           ? LowpKind::f16_nearest
                  : io.rounding == Rounding::stochastic ? LowpKind::bf16_stochastic
                                                        : LowpKind::bf16_nearest;
  }
  const std::size_t grad_bytes = io.grad_dtype == DType::f32 ? 4 : 2;
  std::size_t head = 0;
  while (head < range.count && !aligned(io.param + range.offset + head, 16)) ++head;
  const std::size_t start = range.offset + head;
  const bool vectorizable =
      aligned(m + start, 16) && aligned(v + start, 16) &&
      aligned(static_cast<const char*>(io.grad) + start * grad_bytes, 4 * grad_bytes) &&
      (io.lowp == nullptr || aligned(static_cast<std::uint16_t*>(io.lowp) + start, 8));
  if (!vectorizable) {
    launch_adam<1>(a, io.grad_dtype, stream);
    return;
  }
  AdamLaunch part = a;
  part.count = head;
  launch_adam<1>(part, io.grad_dtype, stream);
  part.begin = start;
  part.count = (range.count - head) / 4 * 4;
  launch_adam<4>(part, io.grad_dtype, stream);
  part.begin = start + part.count;
  part.count = range.count - head - part.count;
  launch_adam<1>(part, io.grad_dtype, stream);
}

// ---- optimizer
// -----------------------------------------------------------------------------------

/// Adam (l2) or AdamW (decoupled) with its states on the GPU; the host AdamFamily's twin.
template <WeightDecayMode Mode>
class CudaAdamFamily {
 public:
  /// One group over the whole shard.
  explicit CudaAdamFamily(std::size_t numel, const AdamHyper& hyper)
      : CudaAdamFamily(numel, single_group(numel, hyper)) {}
  /// Several groups.
  CudaAdamFamily(std::size_t numel, std::vector<ParamGroup<AdamHyper>> groups)
      : numel_(numel), groups_(std::move(groups)), m_(numel), v_(numel) {
    std::vector<Range> ranges;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      validate(groups_[k].hyper, k, "CudaAdam");
      ranges.push_back(groups_[k].range);
    }
    validate_ranges(ranges, numel_, "CudaAdam");
  }

  /// One fused step; io's pointers are device pointers; ordered on stream.
  void step(const FusedIo& io, cudaStream_t stream = nullptr) {
    optim::validate(io, numel_, true, "CudaAdam");
    ++step_;
    for (const auto& g : groups_) {
      adam_step(make_adam_rule(g.hyper, step_, Mode), io, m_.data(), v_.data(), g.range,
                static_cast<std::uint32_t>(step_), stream);
    }
  }
  /// Steps taken.
  std::int64_t step_count() const { return step_; }
  /// The groups (hyper-parameters may change between steps).
  std::vector<ParamGroup<AdamHyper>>& groups() { return groups_; }
  /// Step counter and states copied to the host (synchronous), named as the host optimizer's.
  StateDict state_dict() const {
    StateDict s;
    s.counters["step"] = step_;
    s.buffers["exp_avg"].resize(numel_);
    s.buffers["exp_avg_sq"].resize(numel_);
    ZERO_CUDA_CHECK(cudaMemcpy(s.buffers["exp_avg"].data(), m_.data(), numel_ * sizeof(float),
                               cudaMemcpyDeviceToHost));
    ZERO_CUDA_CHECK(cudaMemcpy(s.buffers["exp_avg_sq"].data(), v_.data(), numel_ * sizeof(float),
                               cudaMemcpyDeviceToHost));
    return s;
  }
  /// Restores a state saved by this class or by the host optimizer (synchronous).
  void load_state_dict(const StateDict& s) {
    step_ = s.counter("step", "CudaAdam");
    ZERO_CUDA_CHECK(cudaMemcpy(m_.data(), s.buffer("exp_avg", numel_, "CudaAdam").data(),
                               numel_ * sizeof(float), cudaMemcpyHostToDevice));
    ZERO_CUDA_CHECK(cudaMemcpy(v_.data(), s.buffer("exp_avg_sq", numel_, "CudaAdam").data(),
                               numel_ * sizeof(float), cudaMemcpyHostToDevice));
  }

 private:
  std::size_t numel_;
  std::vector<ParamGroup<AdamHyper>> groups_;
  Buffer<float, Cuda> m_;
  Buffer<float, Cuda> v_;
  std::int64_t step_ = 0;
};

/// Adam with L2 decay on the GPU.
using CudaAdam = CudaAdamFamily<WeightDecayMode::l2>;
/// AdamW (decoupled decay) on the GPU.
using CudaAdamW = CudaAdamFamily<WeightDecayMode::decoupled>;

}  // namespace zero::optim::cuda
