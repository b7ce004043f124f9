#pragma once
// How a DeepSpeed config meets an engine's policies: the structural keys (stage, precision,
// offload) must agree with the compile-time policies (ConfigError naming the key otherwise),
// and the config builds the per-unit optimizers, the LR scheduler and the NVMe settings. The
// numeric keys (accumulation, clipping, the fp16 block, stage-3 buckets) are
// EngineOptions::with_config's.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <optim/any_optimizer.hpp>
#include <optim/lr_schedule.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/topology.hpp>
#include <zero/config/config.hpp>
#include <zero/core/dtype.hpp>
#include <zero/engine/partition.hpp>
#include <zero/nn/param.hpp>
#include <zero/offload/nvme_config.hpp>
#include <zero/policies/compute.hpp>
#include <zero/policies/offload.hpp>

namespace zero::engine {

/// True when config asks for CPU offload and the engine computes on the host with Offload<None>:
/// the states already live in host memory, so the request is met as it stands.
template <class Where, class Device>
bool offload_cpu_already_host(const Config& config) {
  const auto& z = config.zero_optimization;
  return std::is_same_v<Where, None> && std::is_same_v<Device, Host> &&
         (z.offload_optimizer.device == OffloadDevice::cpu ||
          z.offload_param.device == OffloadDevice::cpu);
}

/// The line a program prints once when offload_cpu_already_host holds.
inline std::string host_offload_note() {
  return "zero_optimization.offload_optimizer/offload_param.device is cpu: on this host-only run "
         "the master, optimizer states and parameter shards already live in host memory";
}

/// Throws ConfigError when config's stage, fp16/bf16 switches or offload devices contradict an
/// engine of ZeRO stage `stage`, compute type T, offload target Where and compute Device (CPU
/// offload on the host is met by Offload<None>: see offload_cpu_already_host).
template <class T, class Where, class Device = Host>
void check_config_against_policies(const Config& config, int stage) {
  const int want = config.zero_optimization.stage;
  expect<ConfigError>(want == stage, "zero_optimization.stage: the config asks for stage ", want,
                      " but this engine was built with ZeroStage<", stage,
                      "> (use zero::dispatch to pick the engine from the config)");
  const bool fp16 = config.fp16.enabled.value_or(std::is_same_v<T, f16>);
  const bool bf16 = config.bf16_enabled.value_or(std::is_same_v<T, zero::bf16>);
  expect<ConfigError>(fp16 == std::is_same_v<T, f16>, "fp16.enabled: the config says ",
                      fp16 ? "true" : "false", " but the engine computes in ",
                      name_of(dtype_of<T>));
  expect<ConfigError>(bf16 == std::is_same_v<T, zero::bf16>, "bf16.enabled: the config says ",
                      bf16 ? "true" : "false", " but the engine computes in ",
                      name_of(dtype_of<T>));
  constexpr OffloadDevice expected = offload_device_of<Where>;
  const bool host_cpu = offload_cpu_already_host<Where, Device>(config);
  const auto met = [&](OffloadDevice d) {
    return host_cpu && d == OffloadDevice::cpu ? expected : d;
  };
  const OffloadDevice device = met(config.zero_optimization.offload_optimizer.device);
  // The master slice is a rank's only parameter copy at rest, so parameter offload (stage 3)
  // is the same move as optimizer offload: offload_param alone also selects Offload<NVMe> (or
  // Offload<CPU> on a device).
  const OffloadDevice param_device = met(config.zero_optimization.offload_param.device);
  const bool param_only =
      device == OffloadDevice::none && param_device == expected && expected != OffloadDevice::none;
  expect<ConfigError>(device == expected || param_only,
                      "zero_optimization.offload_optimizer.device: the config says '",
                      name_of(device), "' but the engine was built with Offload<",
                      name_of(expected), ">");
  expect<ConfigError>(param_device == OffloadDevice::none || param_device == expected,
                      "zero_optimization.offload_param.device: the config says '",
                      name_of(param_device), "' but the engine was built with Offload<",
                      name_of(expected), "> (parameters go where the master goes)");
}

/// Sets config's comm_timeout_s, when the config gives it, as the deadline of comm (every later
/// wait of the group); returns comm. Called with an update callback instead of a config, or on
/// a communicator without options, it changes nothing.
template <class ConfigOrUpdate, class C>
C& apply_comm_timeout(const ConfigOrUpdate& config, C& comm) {
  if constexpr (std::is_same_v<std::remove_cvref_t<ConfigOrUpdate>, Config> &&
                requires { comm.set_options(comm.options()); }) {
    if (config.comm_timeout_given) {
      auto options = comm.options();
      options.timeout_s = config.comm_timeout_s;
      comm.set_options(options);
    }
  }
  return comm;
}

/// The same for every group of a process grid the engine works over (EngineGroups): the
/// data-parallel group; with tensor parallelism the tensor-parallel and tp x dp groups; with
/// pipeline stages the pipeline-parallel and tp x dp x pp groups (the stages' sends, the norm,
/// checkpoints); with sequence parallelism the cp group; with experts the ep x dp (x cp) group,
/// the experts' data-parallel group and the expert-parallel group (the all-to-alls), with
/// Ulysses the cp group, with tensor parallelism the tensor-parallel and state (every rank)
/// groups, and with pipeline stages the pipeline-parallel and state groups.
template <class ConfigOrUpdate, class C>
parallel::ProcessGroups<C>& apply_comm_timeout(const ConfigOrUpdate& config,
                                               parallel::ProcessGroups<C>& groups) {
  using parallel::Axis;
  const parallel::Grid& g = groups.grid();
  if (g.size(Axis::ep) > 1) {
    const bool cp = g.size(Axis::cp) > 1, tp = g.size(Axis::tp) > 1;
    apply_comm_timeout(
        config, cp ? groups.get({Axis::cp, Axis::ep, Axis::dp}) : groups.get({Axis::ep, Axis::dp}));
    apply_comm_timeout(config, groups.data_parallel());  // the experts' dp (x cp)
    apply_comm_timeout(config, groups.ep());             // the experts' all-to-alls
    if (cp) apply_comm_timeout(config, groups.cp());     // Ulysses' all-to-alls
    if (tp) {  // the experts' and blocks' tp reductions, and the state group: every rank
      apply_comm_timeout(config, groups.tp());
      apply_comm_timeout(config, groups.get({Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp}));
    }
    if (g.size(Axis::pp) > 1) {
      apply_comm_timeout(config, groups.pp());
      if (!tp) {
        apply_comm_timeout(config, cp ? groups.get({Axis::cp, Axis::ep, Axis::dp, Axis::pp})
                                      : groups.get({Axis::ep, Axis::dp, Axis::pp}));
      }
    }
    return groups;
  }
  apply_comm_timeout(config, groups.data_parallel());
  if (g.size(Axis::cp) > 1) apply_comm_timeout(config, groups.cp());  // Ulysses' all-to-alls
  if (g.size(Axis::tp) > 1) {
    apply_comm_timeout(config, groups.tp());
    apply_comm_timeout(config, groups.tp_dp());
  }
  if (g.size(Axis::pp) > 1) {
    apply_comm_timeout(config, groups.pp());
    apply_comm_timeout(config, groups.tp_dp_pp());
  }
  return groups;
}

/// The NVMe settings of config: offload_optimizer's section when it offloads to NVMe, else
/// offload_param's. With both on NVMe one swapper holds the master, the optimizer states and
/// the parameter shards, so offload_param's section is checked too and must name the same
/// nvme_path (DeepSpeed may put the two on different drives; zero would have used the
/// optimizer's without a word); offload_optimizer's buffer_count and pin_memory apply.
inline offload::NvmeConfig nvme_settings(const Config& config) {
  const auto& z = config.zero_optimization;
  const bool optimizer_section = z.offload_optimizer.device == OffloadDevice::nvme;
  if (optimizer_section && z.offload_param.device == OffloadDevice::nvme) {
    const auto params = offload::NvmeConfig::from_config(config, offload::OffloadSection::param);
    const auto states =
        offload::NvmeConfig::from_config(config, offload::OffloadSection::optimizer);
    expect<ConfigError>(
        (params.nvme_path / "").lexically_normal() == (states.nvme_path / "").lexically_normal(),
        "zero_optimization.offload_param.nvme_path: '", params.nvme_path.string(),
        "' differs from offload_optimizer.nvme_path '", states.nvme_path.string(),
        "'; zero swaps parameters and optimizer states together, under one path: give both "
        "the same nvme_path");
    return states;
  }
  return offload::NvmeConfig::from_config(config, optimizer_section
                                                      ? offload::OffloadSection::optimizer
                                                      : offload::OffloadSection::param);
}

/// The LR scheduler of config's "scheduler" block starting from lr, if it has one.
inline std::optional<optim::LrScheduler> scheduler_from_config(const Config& config, double lr) {
  if (!config.scheduler) return std::nullopt;
  nlohmann::json block = {{"type", config.scheduler->type}, {"params", nlohmann::json::object()}};
  for (const auto& [k, v] : config.scheduler->params) {
    // A list stays a list (the schedule refuses it where it takes a number), even of one.
    const bool list = config.scheduler->lists.contains(k) || v.size() != 1;
    block["params"][k] = list ? nlohmann::json(v) : nlohmann::json(v[0]);
  }
  for (const auto& [k, v] : config.scheduler->words) block["params"][k] = v;
  return optim::LrScheduler::from_json(block, lr);
}

/// The optimizer of one unit's master: over the whole padded unit when every rank keeps all of
/// it (whole_master, stage 0), else over this rank's shard; weight decay off for the
/// parameters their spec exempts; per-tensor ranges for LAMB, each named by its parameter's
/// index among specs (the whole tensor a shard's range is a part of, whose norms LAMB sums over
/// the ranks holding its parts).
inline optim::AnyOptimizer unit_optimizer(const NamedParams& spec,
                                          const std::vector<nn::ParamSpec>& specs,
                                          const UnitPartition& p, bool whole_master, int rank) {
  const auto numel = static_cast<std::size_t>(whole_master ? p.padded_numel() : p.shard_numel());
  std::vector<std::uint8_t> no_decay(numel, 0);
  std::vector<optim::Range> tensors;
  std::vector<std::size_t> whole;  // per range: its parameter
  const int first = whole_master ? 0 : rank;
  const int last = whole_master ? p.world_size() : rank + 1;
  int last_param = -1;
  for (int r = first; r < last; ++r) {
    const std::int64_t base = whole_master ? p.shard_begin(r) : 0;
    for (const ShardSegment& seg : p.segments(r)) {
      const auto offset = static_cast<std::size_t>(base + seg.shard_offset);
      const auto count = static_cast<std::size_t>(seg.count);
      // A whole master holds a parameter that crosses a shard boundary as two segments that
      // meet: one tensor (LAMB's trust ratio is per tensor).
      if (seg.param == last_param && tensors.back().offset + tensors.back().count == offset) {
        tensors.back().count += count;
      } else {
        tensors.push_back({offset, count});
        whole.push_back(static_cast<std::size_t>(seg.param));
      }
      last_param = seg.param;
      if (!specs[static_cast<std::size_t>(seg.param)].weight_decay) {
        std::fill_n(no_decay.begin() + static_cast<std::ptrdiff_t>(offset), count, 1);
      }
    }
  }
  return optim::AnyOptimizer::from_config(spec, numel, no_decay, std::move(tensors),
                                          std::move(whole), specs.size());
}

}  // namespace zero::engine
