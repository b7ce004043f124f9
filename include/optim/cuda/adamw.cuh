#pragma once
// zero-requires: cuda
// Adam/AdamW on the GPU over a flat fp32 shard, its exp_avg and exp_avg_sq in device memory: a
// standalone optimizer for programs that drive their own update. Each step is fused_pass.cuh's
// kernel with AdamRule (unscale and clip in one factor, the update, the bf16/f16 write-back), so
// it gives the host AdamW's bits. The engine runs every optimizer of optim/ on the device through
// fused_executor.cuh instead.
#if !defined(__CUDACC__)
#error "optim/cuda/adamw.cuh needs nvcc; host-only code includes optim/adam.hpp"
#endif

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <optim/adam_hyper.hpp>
#include <optim/cuda/fused_pass.cuh>
#include <optim/fused_io.hpp>
#include <optim/param_groups.hpp>
#include <optim/state_dict.hpp>
#include <optim/update_rules.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>

namespace zero::optim::cuda {

/// One fused Adam/AdamW step of rule over range of the shard io (device pointers) with state
/// buffers m and v, on stream (fused_pass.cuh's kernel with AdamRule).
inline void adam_step(const AdamRule& rule, const FusedIo& io, float* m, float* v, Range range,
                      std::uint32_t step, cudaStream_t stream) {
  float* const states[2] = {m, v};
  fused_pass(rule, io, states, range, step, stream);
}

// ---- optimizer ----------------------------------------------------------------------------------

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
    // The states were made and zeroed on the legacy stream, which a non-blocking stream given
    // to step() does not wait for.
    ZERO_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  CudaAdamFamily(CudaAdamFamily&&) noexcept = default;
  CudaAdamFamily& operator=(CudaAdamFamily&&) noexcept = default;
  /// Waits for the device before the states are freed (on the legacy stream, which the streams
  /// step() ran on need not be ordered with).
  ~CudaAdamFamily() { cudaDeviceSynchronize(); }

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
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());  // after the steps, whatever stream they ran on
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
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());  // no step still reads the states it replaces
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
