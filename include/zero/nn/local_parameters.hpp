#pragma once
// LocalParameters: the whole model's parameters and gradients in one process, one flat buffer
// per unit (the layout the engine shards). It is the single-process reference owner: tests and
// small programs train with it, and the engine's results are compared against it.

#include <cstdint>
#include <vector>

#include <zero/core/buffer.hpp>
#include <zero/nn/model.hpp>
#include <zero/nn/param.hpp>

namespace zero::nn {

/// Owns every unit's parameters and gradients for model M and binds them.
template <Model M>
class LocalParameters {
 public:
  using T = typename M::value_type;

  /// Allocates, initialises from seed (per parameter name) and binds model's parameters.
  LocalParameters(M& model, std::uint64_t seed) {
    const int units = model.num_units();
    specs_.resize(static_cast<std::size_t>(units));
    values_.resize(static_cast<std::size_t>(units));
    grads_.resize(static_cast<std::size_t>(units));
    views_.resize(static_cast<std::size_t>(units));
    for (int u = 0; u < units; ++u) {
      const auto k = static_cast<std::size_t>(u);
      specs_[k] = model.unit_params(u);
      const auto n = static_cast<std::size_t>(total_numel(specs_[k]));
      values_[k] = Buffer<T>(n);
      grads_[k] = Buffer<T>(n);
      std::int64_t offset = 0;
      for (const auto& spec : specs_[k]) {
        ParamView<T> v{values_[k].view().slice(offset, spec.numel()).reshape(spec.shape),
                       grads_[k].view().slice(offset, spec.numel()).reshape(spec.shape)};
        initialise(spec, v.value.flat(), 0, seed);
        views_[k].push_back(v);
        offset += spec.numel();
      }
      model.bind_unit(u, views_[k]);
    }
  }

  int num_units() const { return static_cast<int>(specs_.size()); }
  /// Unit u's flat parameter buffer.
  Tensor<T> unit_values(int u) { return values_[static_cast<std::size_t>(u)].view(); }
  /// Unit u's flat gradient buffer.
  Tensor<T> unit_grads(int u) { return grads_[static_cast<std::size_t>(u)].view(); }
  const std::vector<ParamSpec>& unit_specs(int u) const {
    return specs_[static_cast<std::size_t>(u)];
  }
  const std::vector<ParamView<T>>& unit_views(int u) const {
    return views_[static_cast<std::size_t>(u)];
  }
  /// Sets every gradient to zero.
  void zero_grads() {
    for (auto& g : grads_) {
      for (T& v : g.view()) v = T(0);
    }
  }
  /// Total parameter count.
  std::int64_t num_parameters() const {
    std::int64_t n = 0;
    for (const auto& v : values_) n += static_cast<std::int64_t>(v.size());
    return n;
  }

 private:
  std::vector<std::vector<ParamSpec>> specs_;
  std::vector<Buffer<T>> values_, grads_;
  std::vector<std::vector<ParamView<T>>> views_;
};

}  // namespace zero::nn
