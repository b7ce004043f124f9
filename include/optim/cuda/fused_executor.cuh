#pragma once
// zero-requires: cuda
// The GPU's FusedExecutor (optim/fused_executor.hpp): every fused pass an optimizer of optim/
// hands to run_fused runs here as fused_pass.cuh's kernel, one launch per parameter group, on one
// stream. The optimizers build their rules on the host as they do for the host pass; only the
// element loop moves. So a device engine runs SGD, Adam, AdamW, Lion, RMSprop and Adagrad over
// shards and states in device memory, with the host pass's bits.
#if !defined(__CUDACC__)
#error "optim/cuda/fused_executor.cuh needs nvcc"
#endif

#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>

#include <cuda_runtime.h>

#include <optim/cuda/fused_pass.cuh>
#include <optim/fused_executor.hpp>
#include <zero/core/error.hpp>

namespace zero::optim::cuda {

/// Runs fused passes as kernels on a stream (null: the legacy default stream).
class CudaFusedExecutor final : public FusedExecutor {
 public:
  explicit CudaFusedExecutor(cudaStream_t stream = nullptr) : stream_(stream) {}

  /// "cuda".
  const char* where() const override { return "cuda"; }
  /// Launches rules[k] over ranges[k] on the stream; returns without waiting for them.
  void run(std::span<const AnyRule> rules, std::span<const Range> ranges, const FusedIo& io,
           std::span<float* const> states, std::uint32_t step) const override {
    expect<Error>(rules.size() == ranges.size(), "CudaFusedExecutor: ", rules.size(), " rules for ",
                  ranges.size(), " ranges");
    for (std::size_t k = 0; k < rules.size(); ++k) {
      std::visit(
          [&]<class Rule>(const Rule& rule) {
            if constexpr (Rule::states > 0) {
              expect<Error>(states.size() >= static_cast<std::size_t>(Rule::states),
                            "CudaFusedExecutor: the rule needs ", Rule::states,
                            " state buffers, got ", states.size());
            }
            fused_pass(rule, io, states.data(), ranges[k], step, stream_);
          },
          rules[k]);
    }
  }
  /// The stream the passes run on.
  cudaStream_t stream() const { return stream_; }
  /// Runs later passes on stream.
  void set_stream(cudaStream_t stream) { stream_ = stream; }

 private:
  cudaStream_t stream_;
};

}  // namespace zero::optim::cuda
