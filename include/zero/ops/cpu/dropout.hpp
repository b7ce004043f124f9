#pragma once
// Inverted dropout with a counter-based mask: whether element i is kept is a function of
// (rng key, stream, i) alone, so a mask is never stored. A backward pass, or a forward pass
// recomputed under activation checkpointing, redraws exactly the forward's mask.
// DropoutMask's member functions are ZERO_HOST_DEVICE: the CUDA kernels (zero/ops/cuda/dropout.cuh,
// attention.cuh) call these very functions, so host and device masks are equal by construction.
// One Philox call (four 32-bit words) decides four consecutive elements. On the host, float, bf16
// and f16 draw a vector's mask one group of four at a time and scale the vector at once through
// the dispatched kernels (isa_dispatch.hpp).
// A mask's `first` places a tensor in a longer index space: element i of the tensor is decided at
// index first + i. The layers set it from the micro-batch's first sample in the step's global
// batch (nn::StepContext::dropout_mask), so a sample draws the same mask whichever rank and
// micro-batch hold it, and a run at any world size equals one process on the whole batch with
// dropout on. A rank that holds a part of every sample's row (a tensor-parallel rank's heads of
// the attention probabilities, a Ulysses rank's positions) places its tensor as blocks of
// `block` elements `stride` apart, so the ranks' parts draw the whole tensor's mask.

#include <cstdint>

#include <zero/core/macros.hpp>
#include <zero/core/rng.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// A dropout mask: element i of (rng, stream) is kept with probability 1 - p and then scaled by
/// 1 / (1 - p). p = 0 means no dropout.
struct DropoutMask {
  double p = 0.0;            ///< drop probability in [0, 1)
  CounterRng rng{0};         ///< key of this site (layer and position in the model)
  std::uint32_t stream = 0;  ///< selects the mask per step
  std::uint64_t first = 0;   ///< index at which element 0 is decided (see the file comment)
  /// 0: element i is decided at first + i. Otherwise the tensor is blocks of `block` elements,
  /// the k-th decided from first + k * stride on (stride >= block): element i at
  /// first + (i / block) * stride + i % block.
  std::uint64_t block = 0;
  std::uint64_t stride = 0;  ///< see block

  /// True when elements are dropped at all.
  ZERO_HOST_DEVICE bool active() const { return p > 0.0; }
  /// Elements decided by one Philox call: each of its four words decides one element.
  static constexpr int group_size = 4;

  /// The mask index at which element index is decided (first, block and stride above).
  ZERO_HOST_DEVICE std::uint64_t index_of(std::int64_t index) const {
    const auto u = static_cast<std::uint64_t>(index);
    return block == 0 ? first + u : first + (u / block) * stride + u % block;
  }
  /// Whether element index is kept: word i % 4 of group i / 4's words, i = index_of(index).
  ZERO_HOST_DEVICE bool keep(std::int64_t index) const {
    const auto i = index_of(index);
    return kept(group_words(i / group_size)[i % group_size]);
  }
  /// The mask of the elements from index on, while they stay inside index's block: element j of
  /// it is element index + j of this one (a row of attention probabilities never crosses a
  /// block, so its loop draws without a division per element).
  ZERO_HOST_DEVICE DropoutMask from(std::int64_t index) const {
    return {p, rng, stream, index_of(index)};
  }
  /// The random words deciding indices [4 g, 4 g + 4) (elements [4 g - first, 4 g + 4 - first)),
  /// one per index in order.
  ZERO_HOST_DEVICE Philox4x32::Counter group_words(std::uint64_t g) const {
    return rng.words(g, stream);
  }
  /// Whether an element whose random word is word is kept (probability 1 - p).
  ZERO_HOST_DEVICE bool kept(std::uint32_t word) const { return word >= threshold(); }
  /// The factor kept elements are multiplied by, in the compute type A.
  template <class A>
  ZERO_HOST_DEVICE A scale() const {
    return static_cast<A>(1.0 / (1.0 - p));
  }
  /// The factor an element is multiplied by: scale for a kept element, 0 for a dropped one.
  /// Dropout multiplies rather than selects (PyTorch's x * mask * scale), so a NaN or an
  /// infinity stays NaN where it is dropped and an overflow is not hidden from the loss scaler.
  template <class A>
  ZERO_HOST_DEVICE static A factor(bool kept, A scale) {
    return kept ? scale : A(0);
  }

 private:
  ZERO_HOST_DEVICE std::uint32_t threshold() const {
    return static_cast<std::uint32_t>(p * 4294967296.0);
  }
};

namespace detail {

// Mask words (all ones: kept, 0: dropped) of the count elements from element index (mask
// indices from mask.index_of(index)); with no dropout every element is kept and no draw is needed.
inline void dropout_mask_words(std::uint32_t* words, const DropoutMask& mask, std::int64_t index,
                               int count) {
  if (!mask.active()) {
    for (int j = 0; j < count; ++j) words[j] = ~std::uint32_t{0};
    return;
  }
  // One Philox call per group of DropoutMask::group_size elements, not one per element, and one
  // division for the placement: the index steps by one, and by stride at a block's end.
  std::uint64_t group = ~std::uint64_t{0};
  Philox4x32::Counter random{};
  std::uint64_t i = mask.index_of(index);
  std::uint64_t left = mask.block == 0
                           ? ~std::uint64_t{0}
                           : mask.block - static_cast<std::uint64_t>(index) % mask.block;
  for (int j = 0; j < count; ++j) {
    if (i / DropoutMask::group_size != group) {
      group = i / DropoutMask::group_size;
      random = mask.group_words(group);
    }
    words[j] = mask.kept(random[i % DropoutMask::group_size]) ? ~std::uint32_t{0} : 0u;
    ++i;
    if (--left == 0) {
      i += mask.stride - mask.block;
      left = mask.block;
    }
  }
}

struct DropoutForward {
  template <class O, class T>
  static void run(T* out, const T* inp, const DropoutMask* mask, float scale, std::int64_t begin,
                  std::int64_t end) {
    std::uint32_t words[O::width];
    const auto at = [&](auto ops, std::int64_t i) {
      using P = decltype(ops);
      dropout_mask_words(words, *mask, i, P::width);
      const auto factor = P::select(words, P::set1(scale), P::set1(0.0f));
      store_lanes<P>(out + i, P::mul(load_lanes<P>(inp + i), factor));
    };
    std::int64_t i = begin;
    for (; i + O::width <= end; i += O::width) at(O{}, i);
    for (; i < end; ++i) at(optim::ScalarHostOps{}, i);
  }
};

struct DropoutBackward {
  template <class O, class T>
  static void run(T* dinp, const T* dout, const DropoutMask* mask, float scale, std::int64_t begin,
                  std::int64_t end) {
    std::uint32_t words[O::width];
    const auto at = [&](auto ops, std::int64_t i) {
      using P = decltype(ops);
      dropout_mask_words(words, *mask, i, P::width);
      const auto factor = P::select(words, P::set1(scale), P::set1(0.0f));
      store_lanes<P>(dinp + i, P::fma(load_lanes<P>(dout + i), factor, load_lanes<P>(dinp + i)));
    };
    std::int64_t i = begin;
    for (; i + O::width <= end; i += O::width) at(O{}, i);
    for (; i < end; ++i) at(optim::ScalarHostOps{}, i);
  }
};

}  // namespace detail

/// Inverted dropout: out = inp * keep / (1 - p) with keep drawn from (rng, stream, first + i), so a
/// recomputed forward (activation checkpointing) draws the same mask. A dropped element is
/// multiplied by 0 (DropoutMask::factor): NaN and infinities give NaN, as in PyTorch.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, const DropoutMask& mask) {
  using A = compute_type_t<T>;
  const A scale = mask.scale<A>();
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::DropoutForward, T*, const T*, const DropoutMask*, float,
                                   std::int64_t, std::int64_t>();
    parallel_chunks(
        n, elementwise_chunk, mask.active() ? 8 * n : n,
        [&](std::int64_t begin, std::int64_t end) { kernel(out, inp, &mask, scale, begin, end); });
  } else {
    parallel_for(n, [&](std::int64_t i) {
      out[i] = store<T>(load(inp[i]) * DropoutMask::factor(mask.keep(i), scale));
    });
  }
}

/// dinp += dout * mask / (1 - p), the mask redrawn from the same (rng, stream): a dropped element
/// adds dout * 0, which keeps a finite dinp's value and gives NaN for a NaN or infinite dout
/// (PyTorch's grad * mask * scale).
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, const DropoutMask& mask) {
  using A = compute_type_t<T>;
  const A scale = mask.scale<A>();
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<detail::DropoutBackward, T*, const T*, const DropoutMask*, float,
                                   std::int64_t, std::int64_t>();
    parallel_chunks(n, elementwise_chunk, mask.active() ? 8 * n : n,
                    [&](std::int64_t begin, std::int64_t end) {
                      kernel(dinp, dout, &mask, scale, begin, end);
                    });
  } else {
    parallel_for(n, [&](std::int64_t i) {
      const A factor = DropoutMask::factor(mask.keep(i), scale);
      dinp[i] = store<T>(load(dinp[i]) + load(dout[i]) * factor);
    });
  }
}

/// dropout_forward over the mask of (p, rng, stream) from index 0.
template <class T>
void dropout_forward(T* out, const T* inp, std::int64_t n, double p, const CounterRng& rng,
                     std::uint32_t stream) {
  dropout_forward(out, inp, n, DropoutMask{p, rng, stream});
}

/// dropout_backward over the mask of (p, rng, stream) from index 0.
template <class T>
void dropout_backward(T* dinp, const T* dout, std::int64_t n, double p, const CounterRng& rng,
                      std::uint32_t stream) {
  dropout_backward(dinp, dout, n, DropoutMask{p, rng, stream});
}

}  // namespace zero::ops::cpu
