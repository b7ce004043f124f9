#pragma once
// Stage partitioning: a model's units cut into pp * v contiguous parts, one per virtual stage
// (virtual stage c * pp + s is chunk c of pipeline rank s, Megatron's interleaving), by one of
// DeepSpeed's partition methods (PipelineModule's partition_method):
//   uniform          as many units per part as possible, the first parts one more;
//   parameters       balanced by each unit's parameter count (minimises the largest part);
//   type:<regex>     balanced by the number of units whose type name matches the regex
//                    (case-insensitive, as DeepSpeed), every part at least one unit.
// The first part holds unit 0 (a GPT's embedding) and the last the last unit (its LM head and
// loss), so the ends stay on the first and last stages. Megatron balances a GPT by giving it
// k * pp - 2 transformer layers: the embedding and the head each weigh about a layer, so
// layers + 2 units split evenly. A uniform split that is uneven says so in `warnings`.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <parallel/pipeline/partition_method.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/micro_step.hpp>

namespace zero::parallel::pipeline {

/// Units of each virtual stage: parts[c * pp + s] is chunk c of pipeline rank s.
struct Partition {
  std::vector<engine::UnitRange> parts;  ///< contiguous, in unit order, covering every unit
  std::vector<std::string> warnings;     ///< non-fatal findings (an uneven uniform split)

  /// Units of chunk c on pipeline rank s of pp.
  engine::UnitRange chunk(int s, int c, int pp) const {
    return parts.at(static_cast<std::size_t>(c * pp + s));
  }
  /// The virtual stage holding unit u.
  int virtual_stage_of(int u) const {
    for (std::size_t k = 0; k < parts.size(); ++k) {
      if (parts[k].first <= u && u < parts[k].last) return static_cast<int>(k);
    }
    raise<ConfigError>("pipeline partition: unit ", u, " is on no stage");
  }
  /// The units of every virtual stage in order, each its first and last unit: "0-3 | 4-7".
  std::string describe() const {
    std::string text;
    for (const auto& part : parts) {
      text += (text.empty() ? "" : " | ") + std::to_string(part.first) + "-" +
              std::to_string(part.last - 1);
    }
    return text;
  }
};

/// Cuts weights (one per unit) into parts contiguous parts, each at least one unit, minimising
/// the largest part's weight (ties: the earliest cut that achieves it, so parts lean forward).
inline std::vector<engine::UnitRange> partition_balanced(const std::vector<double>& weights,
                                                         int parts) {
  const int n = static_cast<int>(weights.size());
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[static_cast<std::size_t>(i)];
  auto sum = [&](int a, int b) { return prefix[static_cast<std::size_t>(b)] - prefix[a]; };
  // best[k][i]: the smallest largest-part weight of units [0, i) in k parts; cut[k][i] the start
  // of the k-th part there. n and parts are small (units, stages), so O(parts * n^2) is cheap.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<std::size_t>(parts) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(static_cast<std::size_t>(parts) + 1,
                                    std::vector<int>(static_cast<std::size_t>(n) + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n - (parts - k); ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][static_cast<std::size_t>(j)], sum(j, i));
        if (v < best[k][static_cast<std::size_t>(i)]) {
          best[k][static_cast<std::size_t>(i)] = v;
          cut[k][static_cast<std::size_t>(i)] = j;
        }
      }
    }
  }
  std::vector<engine::UnitRange> out(static_cast<std::size_t>(parts));
  int end = n;
  for (int k = parts; k >= 1; --k) {
    const int start = cut[k][static_cast<std::size_t>(end)];
    out[static_cast<std::size_t>(k) - 1] = {start, end};
    end = start;
  }
  return out;
}

/// Cuts n units into parts parts of n / parts units, the first n % parts one more (DeepSpeed's
/// partition_uniform).
inline std::vector<engine::UnitRange> partition_uniform(int n, int parts) {
  std::vector<engine::UnitRange> out;
  const int base = n / parts, extra = n % parts;
  int start = 0;
  for (int k = 0; k < parts; ++k) {
    const int size = base + (k < extra ? 1 : 0);
    out.push_back({start, start + size});
    start += size;
  }
  return out;
}

/// Partitions units over pp * v virtual stages by method ("uniform", "parameters",
/// "type:<regex>"). unit_params[u] is unit u's parameter count and unit_types[u] its type name
/// (for type:). joined[u] (when given) keeps unit u on unit u-1's stage: a unit that reads the
/// parameters of the unit just before it (an MoE block and its experts unit), which on another
/// stage would need a replica of that unit, as much memory again. The methods then place these
/// groups of units (uniform counts groups; the balanced methods sum their weights).
/// ConfigError naming the value when the method is unknown, the regex is invalid or matches no
/// unit, or there are fewer units (groups) than virtual stages.
inline Partition partition_units(std::string_view method, int pp, int v,
                                 const std::vector<std::int64_t>& unit_params,
                                 const std::vector<std::string>& unit_types,
                                 const std::vector<bool>& joined = {}) {
  const int n = static_cast<int>(unit_params.size());
  const int parts = pp * v;
  expect<ConfigError>(pp >= 1 && v >= 1, "pipeline partition: pp = ", pp, " and v = ", v,
                      " must be at least 1");
  expect<ConfigError>(joined.empty() || static_cast<int>(joined.size()) == n,
                      "pipeline partition: joined has ", joined.size(), " entries for ", n,
                      " units");
  // first[g]: the first unit of group g (first.back() == n).
  std::vector<int> first;
  for (int u = 0; u < n; ++u) {
    if (u == 0 || joined.empty() || !joined[static_cast<std::size_t>(u)]) first.push_back(u);
  }
  const int groups = static_cast<int>(first.size());
  first.push_back(n);
  const std::string kept_together =
      groups == n ? std::string()
                  : " (" + std::to_string(groups) +
                        " groups: a unit stays with the unit before it that it reads)";
  expect<ConfigError>(groups >= parts, "pipeline partition: the model has ", n, " units",
                      kept_together, ", fewer than the ", parts, " (pp ", pp, " x virtual stages ",
                      v, ") stages to fill; every stage needs at least one unit");
  const PartitionMethod how = [&] {
    try {
      return parse_partition_method(method);
    } catch (const ConfigError& e) {
      raise<ConfigError>("pipeline partition_method ", e.what());
    }
  }();
  // Cuts over groups, then back to units.
  const auto in_units = [&](std::vector<engine::UnitRange> over_groups) {
    for (engine::UnitRange& r : over_groups) {
      r = {first[static_cast<std::size_t>(r.first)], first[static_cast<std::size_t>(r.last)]};
    }
    return over_groups;
  };
  Partition p;
  if (how.kind == PartitionMethod::Kind::uniform) {
    p.parts = in_units(partition_uniform(groups, parts));
    if (groups % parts != 0) {
      p.warnings.push_back(
          "pipeline partition: " + std::to_string(n) + " units" + kept_together +
          " do not split evenly over " + std::to_string(parts) +
          " stages, so some stages run one unit more and the pipeline " +
          "moves at their pace; a GPT balances with k * " + std::to_string(parts) +
          " - 2 transformer layers (Megatron's rule: the embedding and the LM head weigh about "
          "a layer each), e.g. " +
          std::to_string(std::max(1, (groups + parts - 1) / parts) * parts - 2) + " layers");
    }
    return p;
  }
  std::vector<double> weights(static_cast<std::size_t>(groups), 0.0);
  int matched = 0;
  for (int g = 0; g < groups; ++g) {
    for (int u = first[static_cast<std::size_t>(g)]; u < first[static_cast<std::size_t>(g) + 1];
         ++u) {
      const auto k = static_cast<std::size_t>(u);
      if (how.kind == PartitionMethod::Kind::parameters) {
        weights[static_cast<std::size_t>(g)] += static_cast<double>(unit_params[k]);
      } else if (std::regex_search(unit_types.at(k), how.regex)) {
        weights[static_cast<std::size_t>(g)] += 1.0;
        ++matched;
      }
    }
  }
  expect<ConfigError>(
      how.kind != PartitionMethod::Kind::type || matched > 0, "pipeline partition_method '",
      std::string(method),
      "' matches no unit (unit types: ", unit_types.empty() ? std::string() : unit_types.front(),
      " ... ", unit_types.empty() ? std::string() : unit_types.back(), ")");
  p.parts = in_units(partition_balanced(weights, parts));
  return p;
}

}  // namespace zero::parallel::pipeline
