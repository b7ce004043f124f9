#pragma once
// check_unit_gradients: the first thing to run on a new unit. It compares a unit's backward with
// central finite differences of the model's loss, in f64:
//   for every element p of the unit's parameters (and, for units after the first, of the
//   activation entering the unit): numeric = (loss(p + eps) - loss(p - eps)) / (2 eps),
// where the loss is the model's whole forward on one micro-batch, and analytic is what the
// backward (from the last unit down to this one) accumulated. Only the units from the checked
// one onwards are rerun per perturbation: the earlier units' activations stay in the arena
// below a mark. Perturbing a parameter reruns its users too, so tied parameters (unit_uses) are
// checked through every use. The error of an element is |analytic - numeric| / max(|analytic|,
// |numeric|, floor); the report names the worst tensor and element.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <zero/core/arena.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/nn/model.hpp>

namespace zero::testing {

/// Settings of check_unit_gradients.
struct GradientCheckOptions {
  double eps = 1e-6;              ///< finite-difference step
  double floor = 1e-4;            ///< gradients below this are compared absolutely
  double tolerance = 1e-5;        ///< largest error that passes
  std::uint64_t seed = 1234;      ///< parameter initialisation (per name, as the engine's)
  std::int64_t max_elements = 0;  ///< per tensor: check at most this many (evenly spaced); 0 all
  bool check_input = true;        ///< also check the gradient at the unit's input activation
  std::uint64_t step = 0;         ///< ctx.step (selects dropout masks)
  std::size_t arena_bytes = 64 << 20;  ///< activations of one forward
};

/// What check_unit_gradients found.
struct GradientCheckReport {
  int unit = 0;                   ///< the unit checked
  double loss = 0;                ///< the model's loss at the unperturbed parameters
  double worst_error = 0;         ///< largest error over the checked elements
  std::string worst_tensor;       ///< parameter name, or "input of unit u"
  std::int64_t worst_index = -1;  ///< flat element index in worst_tensor
  double analytic = 0;            ///< backward's value there
  double numeric = 0;             ///< finite difference there
  std::int64_t checked = 0;       ///< elements compared
  double tolerance = 0;           ///< the options' tolerance

  /// True when every checked element is within tolerance.
  bool passed() const { return checked > 0 && worst_error <= tolerance; }
  /// One line for a log or a test failure.
  std::string summary() const {
    std::ostringstream s;
    s << "unit " << unit << ": " << (passed() ? "ok" : "MISMATCH") << ", worst error "
      << worst_error << " (tolerance " << tolerance << ") at " << worst_tensor << "[" << worst_index
      << "]: backward " << analytic << ", finite difference " << numeric << "; " << checked
      << " elements checked, loss " << loss;
    return s.str();
  }
};

namespace detail {

// Runs the forward of units [first, U) from the context's current x and returns the loss.
template <class M>
double loss_from(M& model, nn::StepContext<double>& ctx, int first) {
  for (int u = first; u < model.num_units(); ++u) model.forward_unit(u, ctx);
  return ctx.loss;
}

// Indices of a tensor of n elements to check: all, or max evenly spaced ones.
inline std::vector<std::int64_t> pick(std::int64_t n, std::int64_t max) {
  std::vector<std::int64_t> idx;
  if (max <= 0 || n <= max) {
    for (std::int64_t i = 0; i < n; ++i) idx.push_back(i);
  } else {
    for (std::int64_t k = 0; k < max; ++k) idx.push_back(k * n / max);
  }
  return idx;
}

}  // namespace detail

/// Checks unit's backward against finite differences of model's loss on batch, with the
/// parameters in params (already bound to model). The model must compute in f64.
template <nn::Model M>
GradientCheckReport check_unit_gradients(M& model, nn::LocalParameters<M>& params, int unit,
                                         const engine::MicroBatch& batch,
                                         const GradientCheckOptions& options = {}) {
  static_assert(std::is_same_v<typename M::value_type, double>,
                "check_unit_gradients needs the model instantiated with double: finite "
                "differences in f32 or bf16 cannot resolve a gradient error");
  expect<Error>(unit >= 0 && unit < model.num_units(), "check_unit_gradients: unit ", unit,
                " is outside [0, ", model.num_units(), ")");
  Arena<Host> arena(options.arena_bytes, "gradient check");
  nn::StepContext<double> ctx;
  const auto start = [&] { ctx = batch.context<double>(arena, true, options.step); };

  GradientCheckReport report;
  report.unit = unit;
  report.tolerance = options.tolerance;
  const auto compare = [&](const std::string& tensor, std::int64_t index, double analytic,
                           double numeric) {
    const double scale = std::max({std::fabs(analytic), std::fabs(numeric), options.floor});
    const double error = std::fabs(analytic - numeric) / scale;
    ++report.checked;
    if (error > report.worst_error || report.worst_index < 0) {
      report.worst_error = error;
      report.worst_tensor = tensor;
      report.worst_index = index;
      report.analytic = analytic;
      report.numeric = numeric;
    }
  };

  // Analytic: the whole forward, then backward from the last unit down to this one.
  params.zero_grads();
  start();
  report.loss = detail::loss_from(model, ctx, 0);
  for (int u = model.num_units() - 1; u >= unit; --u) model.backward_unit(u, ctx);
  std::vector<double> input_grad;  // an empty Tensor has rank 0, i.e. one element: test data
  if (ctx.dx.data() != nullptr) input_grad.assign(ctx.dx.begin(), ctx.dx.end());
  const auto grads = params.unit_grads(unit);
  const std::vector<double> param_grads(grads.begin(), grads.end());

  // Numeric: the earlier units run once; each perturbation reruns [unit, U) above a mark.
  start();
  for (int u = 0; u < unit; ++u) model.forward_unit(u, ctx);
  const Tensor<double> x_in = ctx.x;
  const double aux_in = ctx.aux_loss;  // what the earlier units added
  const auto mark = arena.mark();
  const auto rerun = [&] {
    arena.release(mark);
    ctx.x = x_in;
    ctx.loss = 0;
    ctx.aux_loss = aux_in;
    return detail::loss_from(model, ctx, unit);
  };
  const auto difference = [&](double& value) {
    const double saved = value;
    value = saved + options.eps;
    const double up = rerun();
    value = saved - options.eps;
    const double down = rerun();
    value = saved;
    return (up - down) / (2 * options.eps);
  };

  const auto values = params.unit_values(unit);
  std::int64_t offset = 0;
  for (const nn::ParamSpec& spec : params.unit_specs(unit)) {
    for (std::int64_t i : detail::pick(spec.numel(), options.max_elements)) {
      const double numeric = difference(values.data()[offset + i]);
      compare(spec.name, i, param_grads[static_cast<std::size_t>(offset + i)], numeric);
    }
    offset += spec.numel();
  }
  if (options.check_input && unit > 0 && x_in.data() != nullptr) {
    expect<Error>(static_cast<std::int64_t>(input_grad.size()) == x_in.numel(),
                  "check_unit_gradients: unit ", unit, "'s backward left ctx.dx with ",
                  input_grad.size(), " elements, but its input activation has ", x_in.numel());
    const std::string name = "input of unit " + std::to_string(unit);
    for (std::int64_t i : detail::pick(x_in.numel(), options.max_elements)) {
      const double numeric = difference(x_in.data()[i]);
      compare(name, i, input_grad[static_cast<std::size_t>(i)], numeric);
    }
  }
  return report;
}

/// As above, with fresh parameters initialised from options.seed. The model stays bound to
/// storage that is freed on return: bind it again (an Engine or LocalParameters) before use.
template <nn::Model M>
GradientCheckReport check_unit_gradients(M& model, int unit, const engine::MicroBatch& batch,
                                         const GradientCheckOptions& options = {}) {
  nn::LocalParameters<M> params(model, options.seed);
  return check_unit_gradients(model, params, unit, batch, options);
}

}  // namespace zero::testing
