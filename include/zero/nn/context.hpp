#pragma once
// StepContext: what flows between units during one micro-step. Units read the batch and the
// current activation x, write their output back to x (forward), or read dy and write dx
// (backward). Saved activations come from the arena in stack order: a unit's backward releases
// everything its forward took, which is exactly LIFO when units run backward in reverse.
// Besides tokens/targets (language models), a micro-batch carries named tensors of any element
// type in `inputs` (features, labels, masks); units read them with input<U>(name).

#include <cstdint>
#include <string_view>

#include <zero/core/arena.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/tensor.hpp>
#include <zero/nn/inputs.hpp>
#include <zero/ops/cpu/dropout.hpp>
#include <zero/profile/op_times.hpp>

namespace zero::nn {

template <class T>
class DeferredWeightGrads;  // deferred_weight_grads.hpp
template <class T>
class Kernels;  // kernels.hpp

/// A rank's part of a tensor that a group of ranks splits, for its dropout mask
/// (StepContext::dropout_mask): the part draws the mask of its place in the whole, so the ranks
/// together drop what one rank holding the whole tensor drops.
struct DropoutShard {
  std::int64_t parts = 1;  ///< ranks the tensor is split over (1: not split)
  std::int64_t index = 0;  ///< this rank's part, in [0, parts)
  /// false: the micro-batch's rows, flattened, are split into parts contiguous blocks (Megatron
  /// sequence parallelism's rows); true: every one of the micro-batch's `batch` rows is (a
  /// tensor-parallel rank's heads of the attention probabilities [B, heads, T, T], a Ulysses
  /// rank's positions of each sequence [B, T / sp, C]).
  bool within_rows = false;
};

/// The state of one forward/backward micro-step through a model's units.
template <class T>
struct StepContext {
  BumpArena* arena = nullptr;  ///< activations and temporaries (on the kernels' device)
  /// The kernels the layers run (nn/kernels.hpp); null means the host's. The arena, the
  /// activations and the bound parameters are memory of its device.
  Kernels<T>* kernels = nullptr;
  const std::int32_t* tokens = nullptr;   ///< [B, T] inputs
  const std::int32_t* targets = nullptr;  ///< [B, T] labels (ignore_index = -1 skips a token)
  std::int64_t batch = 0;                 ///< B
  std::int64_t seq_len = 0;               ///< T
  Inputs inputs;                          ///< named tensors of the micro-batch (any dtype)
  bool training = true;                   ///< save what backward needs; dropout active
  std::uint64_t step = 0;                 ///< selects dropout masks
  std::uint64_t seed = 0;                 ///< the run's seed: keys dropout masks with the site
  /// The global row (within the step's global batch) of this micro-batch's row 0, when the
  /// caller says where its rows sit (engine::MicroBatch::first_row); -1 otherwise. Dropout masks
  /// then follow the rows (dropout_first), so a sample is dropped alike at any world size.
  std::int64_t first_row = -1;
  Tensor<T> x;    ///< activation between units (forward)
  Tensor<T> dy;   ///< gradient arriving at a unit's output (backward)
  Tensor<T> dx;   ///< gradient the unit writes for its input (backward)
  T loss = T(0);  ///< mean loss, set by the last unit
  /// Auxiliary losses the pass's layers added, already weighted (a mixture of experts' load
  /// balancing and router z-loss); the loss layer adds them to `loss`.
  compute_type_t<T> aux_loss = 0;
  /// dloss seeding the backward pass (fp16 scaling, over accumulation steps); kept in the compute
  /// type because fp16's initial scale 2^16 is past fp16's range.
  compute_type_t<T> loss_scale = 1;
  /// Set for the input half of a split backward (zero-bubble pipeline schedules): layers that
  /// can, leave their weight-gradient GEMMs here (deferred_weight_grads.hpp); null otherwise.
  DeferredWeightGrads<T>* weight_grads = nullptr;
  /// Set by Sequential for the backward of a layer whose writes_input_grad() is true: ctx.dx
  /// holds no gradient yet (it was not zeroed), so the layer writes it instead of adding into it.
  bool overwrite_dx = false;
  /// Set by Sequential for the backward of a layer whose starts_input_grad() is true, when the
  /// unit's input gradient starts from another buffer (a residual's skip gradient): ctx.dx holds
  /// no gradient yet, and the layer writes dx = dx_start + its input gradient. Null otherwise.
  const T* dx_start = nullptr;
  /// False for a backward that is not its unit's last of the accumulation window (the engine
  /// sets it per unit): a layer that sums gradient contributions over a group may hold them
  /// back until the last one (parallel::WindowGradSum). True, the default, outside an engine:
  /// every backward is then complete on its own.
  bool window_end = true;
  /// The accumulation window this micro-step belongs to: the engine moves it on at the end of
  /// every window, a failed one included, so sums held for a window are not carried into the
  /// next.
  std::uint64_t window = 0;
  /// When set, Sequential times each layer's forward and backward into it by layer kind
  /// (profile/op_times.hpp); null (the default) times nothing.
  profile::OpTimes* op_times = nullptr;

  /// Number of token positions B * T.
  std::int64_t tokens_count() const { return batch * seq_len; }
  /// The dropout mask index of element 0 of a tensor of n elements over this micro-batch's
  /// `batch` rows (ops::cpu::DropoutMask::first): first_row rows of n / batch elements, so a
  /// row's elements are decided at the same indices whichever rank and micro-batch hold it. 0
  /// without first_row; a tensor that is not whole rows (n % batch != 0) gets first_row * n.
  std::uint64_t dropout_first(std::int64_t n) const {
    if (first_row <= 0 || batch <= 0 || n <= 0) return 0;
    const std::int64_t per_row = n % batch == 0 ? n / batch : n;
    return static_cast<std::uint64_t>(first_row) * static_cast<std::uint64_t>(per_row);
  }
  /// The mask (p, rng) of this step (stream `step`) over a tensor of n elements: the whole
  /// micro-batch's tensor placed at its rows (dropout_first), or this rank's part of it (shard);
  /// ShapeError when the part cannot be placed (rows that do not divide over batch).
  ops::cpu::DropoutMask dropout_mask(double p, const CounterRng& rng, std::int64_t n,
                                     const DropoutShard& shard = {}) const {
    ops::cpu::DropoutMask mask{p, rng, static_cast<std::uint32_t>(step)};
    expect<ShapeError>(shard.parts >= 1 && shard.index >= 0 && shard.index < shard.parts,
                       "dropout: part ", shard.index, " of ", shard.parts);
    if (shard.parts == 1 || n <= 0) {
      mask.first = dropout_first(n);
    } else if (!shard.within_rows) {
      const auto u = static_cast<std::uint64_t>(n);
      mask.first = dropout_first(n * shard.parts) + static_cast<std::uint64_t>(shard.index) * u;
    } else {
      expect<ShapeError>(batch > 0 && n % batch == 0, "dropout: a part of every row of ", batch,
                         " rows, but ", n, " elements");
      const auto part = static_cast<std::uint64_t>(n / batch);
      const auto row = part * static_cast<std::uint64_t>(shard.parts);
      mask.first = (first_row > 0 ? static_cast<std::uint64_t>(first_row) * row : 0) +
                   static_cast<std::uint64_t>(shard.index) * part;
      mask.block = part;
      mask.stride = row;
    }
    return mask;
  }
  /// The micro-batch's input name as U; throws InputError naming it when absent or mistyped.
  template <class U>
  Tensor<const U> input(std::string_view name) const {
    return inputs.get<U>(name);
  }
};

}  // namespace zero::nn
