#pragma once
// SequentialModel: an nn::Model made of Sequential units, for models without tied parameters
// (every unit_uses is empty). A model with ties writes its own Model class around Sequential
// units and declares the ties in unit_uses (docs/custom-models.md).

#include <any>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <zero/nn/layers/sequential.hpp>
#include <zero/nn/model.hpp>

namespace zero::nn {

/// A model whose units are lists of layers.
template <class T>
class SequentialModel {
 public:
  using value_type = T;

  /// Appends an empty unit and returns it for adding layers.
  Sequential<T>& add_unit() { return units_.emplace_back(); }
  /// Unit u.
  Sequential<T>& unit(int u) { return units_.at(static_cast<std::size_t>(u)); }

  int num_units() const { return static_cast<int>(units_.size()); }
  /// Unit u's parameters; throws ConfigError when two parameters of the model share a name
  /// (names key the initialisation and the checkpoint tensors).
  std::vector<ParamSpec> unit_params(int u) const {
    check_unit(u);
    std::set<std::string> seen;
    for (const auto& unit : units_) {
      for (const ParamSpec& p : unit.params()) {
        expect<ConfigError>(seen.insert(p.name).second, "SequentialModel: parameter name '", p.name,
                            "' is used twice; give each layer its own name");
      }
    }
    return units_[static_cast<std::size_t>(u)].params();
  }
  /// No ties: every unit reads only its own parameters.
  std::vector<int> unit_uses(int u) const {
    check_unit(u);
    return {};
  }
  /// Binds unit u's parameters (views in unit_params order).
  void bind_unit(int u, std::span<const ParamView<T>> views) {
    check_unit(u);
    units_[static_cast<std::size_t>(u)].bind(views);
  }
  /// Runs unit u forward.
  void forward_unit(int u, StepContext<T>& ctx) {
    check_unit(u);
    units_[static_cast<std::size_t>(u)].forward(ctx);
  }
  /// Runs unit u backward (ctx.dy in, ctx.dx and ctx.dy out).
  void backward_unit(int u, StepContext<T>& ctx) {
    check_unit(u);
    units_[static_cast<std::size_t>(u)].backward(ctx);
  }
  /// MACs and FLOPs of unit u's last forward (empty before one ran, or when a layer does not
  /// report its count); the flops profiler reads it.
  std::optional<FlopCount> unit_forward_flops(int u) const {
    check_unit(u);
    return units_[static_cast<std::size_t>(u)].forward_flops();
  }
  /// True when every layer of unit u parks (nn::ParksPasses): a pipeline stage then keeps
  /// several of its micro-batches in flight instead of recomputing them.
  bool parks_unit(int u) const {
    check_unit(u);
    return units_[static_cast<std::size_t>(u)].parks();
  }
  /// Moves out what unit u's last forward kept for its backward.
  std::any park_unit(int u) {
    check_unit(u);
    return units_[static_cast<std::size_t>(u)].park();
  }
  /// Puts back what park_unit(u) moved out, before that forward's backward.
  void resume_unit(int u, std::any saved) {
    check_unit(u);
    units_[static_cast<std::size_t>(u)].resume(std::move(saved));
  }
  /// Forward through every unit; returns the loss (0 without labels).
  T forward(StepContext<T>& ctx) {
    for (int u = 0; u < num_units(); ++u) forward_unit(u, ctx);
    return ctx.loss;
  }
  /// Backward through every unit, accumulating into the bound gradients.
  void backward(StepContext<T>& ctx) {
    for (int u = num_units() - 1; u >= 0; --u) backward_unit(u, ctx);
  }

 private:
  void check_unit(int u) const {
    expect<Error>(u >= 0 && u < num_units(), "SequentialModel: unit ", u, " out of range [0, ",
                  num_units(), ")");
  }

  std::vector<Sequential<T>> units_;
};

static_assert(ParksPasses<SequentialModel<double>> && ParksPasses<SequentialModel<float>>);

}  // namespace zero::nn
