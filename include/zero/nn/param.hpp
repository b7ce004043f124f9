#pragma once
// Parameters as units declare them (name, shape, initialiser, flags) and as owners bind them
// (value and gradient views into storage the owner keeps: a single-process model, or the engine's
// gathered unit buffers).

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <zero/core/rng.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/nn/tensor_split.hpp>

namespace zero::nn {

/// How a parameter starts.
enum class Init : unsigned char { zeros, ones, normal };

/// One parameter a unit declares. Shapes are zero's layout: a Linear weight is [out, in].
struct ParamSpec {
  std::string name;          ///< Hugging Face GPT-2 name, e.g. "transformer.h.0.ln_1.weight"
  Shape shape;               ///< shape held by this rank (the whole tensor unless split)
  Init init = Init::normal;  ///< initialiser
  double stddev = 0.02;      ///< for Init::normal
  bool weight_decay = true;  ///< false for biases and norms (embeddings decay, as in Megatron)
  TensorSplit split = {};    ///< the part held (tensor parallelism; of expert_split's part)
  /// When positive, the logical tensor's rows (dimension 0) from this one on are padding, never
  /// read (a token table padded past its vocabulary): a checkpoint holding the tensor with
  /// another number of rows, no fewer than these, fills it (its first rows; rows past the
  /// stored ones zero), so a table padded for one tensor-parallel size loads at another.
  std::int64_t rows_in_use = 0;
  /// Stacked experts split over an expert-parallel group: the experts this rank holds, a part of
  /// the logical stack along dimension 0. `split` is then the tensor-parallel part of those
  /// experts (split.whole is expert_split's part shape): each expert's hidden units (expert
  /// tensor parallelism), or, with whole experts over tp, some of the experts (dimension 0).
  TensorSplit expert_split = {};

  /// Elements held.
  std::int64_t numel() const { return shape.numel(); }
  /// The logical tensor's shape (shape itself unless split).
  Shape logical_shape() const {
    if (expert_split.is_split()) return expert_split.whole;
    return split.is_split() ? split.whole : shape;
  }
  /// fn(logical_offset, offset, count) for each contiguous run of the held elements
  /// [first, first + count) in the logical tensor (one run unless split): split's runs in
  /// expert_split's part, each cut into the runs of that part in the logical tensor.
  template <class Fn>
  void for_each_run(std::int64_t first, std::int64_t count, Fn&& fn) const {
    if (!expert_split.is_split()) {
      split.for_each_run(first, count, fn);
      return;
    }
    split.for_each_run(first, count, [&](std::int64_t in_part, std::int64_t held, std::int64_t n) {
      expert_split.for_each_run(in_part, n,
                                [&](std::int64_t logical, std::int64_t at, std::int64_t m) {
                                  fn(logical, held + (at - in_part), m);
                                });
    });
  }
};

/// A bound parameter: its value and its gradient (empty when only evaluating).
template <class T>
struct ParamView {
  Tensor<T> value;
  Tensor<T> grad;
};

/// Fills elements [first_index, first_index + slice.numel()) of the parameter spec describes,
/// from (seed, name, logical index) alone: any split over ranks, data- or tensor-parallel,
/// gives the single-process values.
template <class T>
void initialise(const ParamSpec& spec, Tensor<T> slice, std::int64_t first_index,
                std::uint64_t seed) {
  switch (spec.init) {
    case Init::zeros:
      for (T& v : slice) v = convert<T>(0.0);
      break;
    case Init::ones:
      for (T& v : slice) v = convert<T>(1.0);
      break;
    case Init::normal: {
      const CounterRng rng(CounterRng::key_for(seed, spec.name));
      spec.for_each_run(first_index, slice.numel(),
                        [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
                          fill_normal(slice.slice(held - first_index, count), rng, logical, 0.0,
                                      spec.stddev);
                        });
      break;
    }
  }
}

/// Total element count of specs.
inline std::int64_t total_numel(const std::vector<ParamSpec>& specs) {
  std::int64_t n = 0;
  for (const auto& s : specs) n += s.numel();
  return n;
}

}  // namespace zero::nn
