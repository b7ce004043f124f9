#pragma once
// What one fused optimizer pass reads and writes: the flat fp32 master shard, its gradient (fp32,
// bf16 or f16) with the factor that unscales and clips it, and an optional low-precision copy of
// the updated parameters (bf16 or f16) written in the same pass.
//
// The engine hands shards, not tensors: param[i] is element first_index + i of the flat model
// buffer, which only matters for stochastic rounding (its random bits depend on the global
// element index, so a shard's bits do not depend on how the model was split).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <type_traits>

#include <optim/cpu/isa.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::optim {

class FusedExecutor;  // fused_executor.hpp

/// How the low-precision copy is rounded.
enum class Rounding : std::uint8_t {
  nearest_even,  ///< IEEE round to nearest, ties to even
  stochastic,    ///< bf16 only: round up with probability equal to the dropped fraction
};

/// Inputs and outputs of one fused step over a flat shard.
struct FusedIo {
  float* param = nullptr;          ///< fp32 master shard, updated in place
  std::size_t numel = 0;           ///< elements in the shard
  const void* grad = nullptr;      ///< gradient shard (numel elements of grad_dtype)
  DType grad_dtype = DType::f32;   ///< f32, bf16 or f16
  float grad_scale = 1.0f;         ///< multiplies every gradient: clip_coefficient / loss_scale
  void* lowp = nullptr;            ///< optional low-precision copy of param (written after update)
  DType lowp_dtype = DType::bf16;  ///< bf16 or f16
  Rounding rounding = Rounding::nearest_even;  ///< rounding of the low-precision copy
  std::uint64_t rounding_key = 0;  ///< stochastic-rounding stream (e.g. CounterRng::key_for)
  std::uint64_t first_index = 0;   ///< global flat index of param[0]

  /// A pass over param with an fp32, bf16 or f16 gradient of the same length.
  template <class GradT>
  static FusedIo over(std::span<float> param, std::span<const GradT> grad) {
    expect<ShapeError>(param.size() == grad.size(), "zero::optim::FusedIo: param has ",
                       param.size(), " elements but grad has ", grad.size());
    FusedIo io;
    io.param = param.data();
    io.numel = param.size();
    io.grad = grad.data();
    io.grad_dtype = dtype_of<GradT>;
    return io;
  }
  /// The same pass, also writing a rounded copy of the updated parameters into out.
  template <class LowT>
  FusedIo& write_back(std::span<LowT> out, Rounding mode = Rounding::nearest_even,
                      std::uint64_t key = 0) {
    static_assert(std::is_same_v<LowT, bf16> || std::is_same_v<LowT, f16>,
                  "zero::optim::FusedIo::write_back: the copy is bf16 or f16");
    expect<ShapeError>(out.size() == numel, "zero::optim::FusedIo: low-precision copy has ",
                       out.size(), " elements but param has ", numel);
    lowp = out.data();
    lowp_dtype = dtype_of<LowT>;
    rounding = mode;
    rounding_key = key;
    return *this;
  }
  /// Sets the gradient factor (clip_coefficient / loss_scale).
  FusedIo& scale_grad(float factor) {
    grad_scale = factor;
    return *this;
  }
};

/// Run-time options of a step.
struct StepOptions {
  Isa isa = Isa::automatic;  ///< instruction set; tests force each one the CPU supports
  int threads = 0;           ///< OpenMP threads; 0 uses the OpenMP default
  /// Where the passes run: null for the host's threads, else an executor whose memory the
  /// shard and the states are in (a device backend's; fused_executor.hpp).
  const FusedExecutor* executor = nullptr;
  /// Host passes over shards of 2^20 elements and more write their bf16/f16 copy past the cache
  /// (non-temporal stores, cpu/fused_driver.hpp); false keeps plain stores. The same bits.
  bool stream_lowp = true;
  /// For an optimizer whose update needs sums over whole tensors that are split over ranks
  /// (LAMB's per-tensor norms under ZeRO or tensor parallelism): sums the values in place over
  /// those ranks (an all-reduce). Every rank's step calls it with as many values, in the same
  /// order; empty: this shard's tensors are whole.
  std::function<void(std::span<double>)> sum_over_ranks = {};
};

/// Throws a message naming the problem when io cannot be used for a shard of numel elements.
inline void validate(const FusedIo& io, std::size_t numel, bool needs_grad, const char* who) {
  expect<ShapeError>(io.numel == numel, who, ": the shard has ", io.numel,
                     " elements but the optimizer was built for ", numel);
  expect<Error>(io.param != nullptr || numel == 0, who, ": FusedIo::param is null");
  if (needs_grad) {
    expect<Error>(io.grad != nullptr || numel == 0, who, ": FusedIo::grad is null");
    expect<Error>(
        io.grad_dtype == DType::f32 || io.grad_dtype == DType::bf16 || io.grad_dtype == DType::f16,
        who, ": gradients must be f32, bf16 or f16, got ", name_of(io.grad_dtype));
  }
  if (io.lowp != nullptr) {
    expect<Error>(io.lowp_dtype == DType::bf16 || io.lowp_dtype == DType::f16, who,
                  ": the low-precision copy must be bf16 or f16, got ", name_of(io.lowp_dtype));
    expect<Error>(io.rounding == Rounding::nearest_even || io.lowp_dtype == DType::bf16, who,
                  ": stochastic rounding is implemented for bf16 copies only");
  }
}

}  // namespace zero::optim
