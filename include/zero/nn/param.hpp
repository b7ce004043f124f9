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

namespace zero::nn {

/// How a parameter starts.
enum class Init : unsigned char { zeros, ones, normal };

/// One parameter a unit declares. Shapes are zero's layout: a Linear weight is [out, in].
struct ParamSpec {
  std::string name;          ///< Hugging Face GPT-2 name, e.g. "transformer.h.0.ln_1.weight"
  Shape shape;               ///< logical shape
  Init init = Init::normal;  ///< initialiser
  double stddev = 0.02;      ///< for Init::normal
  bool weight_decay = true;  ///< false for biases, norms (and embeddings where configured)

  std::int64_t numel() const { return shape.numel(); }
};

/// A bound parameter: its value and its gradient (empty when only evaluating).
template <class T>
struct ParamView {
  Tensor<T> value;
  Tensor<T> grad;
};

/// Fills elements [first_index, first_index + slice.numel()) of the parameter spec describes,
/// from (seed, name, index) alone: any split over ranks gives the single-process values.
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
    case Init::normal:
      fill_normal(slice, CounterRng(CounterRng::key_for(seed, spec.name)), first_index, 0.0,
                  spec.stddev);
      break;
  }
}

/// Total element count of specs.
inline std::int64_t total_numel(const std::vector<ParamSpec>& specs) {
  std::int64_t n = 0;
  for (const auto& s : specs) n += s.numel();
  return n;
}

}  // namespace zero::nn
