#pragma once
// Engine checkpoints on top of zero::checkpoint: every rank saves the pieces of parameters its
// master slice holds (the fp32 master "<name>" and each optimizer state "<name>/<state>") as
// segments of logical, unsharded tensors, plus the engine's state (counters, LR scheduler, loss
// scaler, the policies it ran with) and the program's own state. Loading reads, for whatever
// world size and stage the loading engine has, exactly the ranges its slices need, so any
// (world, stage) resumes any other. At stage 0 every rank holds replicas; rank 0 saves them.
//
// Saves and loads happen between optimizer steps (not in the middle of gradient accumulation).

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/checkpoint/reader.hpp>
#include <zero/checkpoint/save.hpp>
#include <zero/checkpoint/unit_segments.hpp>
#include <zero/core/error.hpp>

namespace zero::engine {

namespace detail {

// Calls fn(rank r, the part of `slice` that is r's shard) for each shard this rank saves or
// loads for unit u: its own shard at stages 1-3; at stage 0 (the slice is the whole padded
// unit) every shard, on rank 0 only when saving replicas once.
template <class Eng, class Span, class Fn>
void for_each_owned_shard(Eng& eng, int u, Span slice, bool saving, Fn&& fn) {
  const UnitPartition& p = eng.partition(u);
  if constexpr (Eng::stage == 0) {
    if (saving && eng.rank() != 0) return;
    for (int r = 0; r < p.world_size(); ++r) {
      fn(r, slice.subspan(static_cast<std::size_t>(p.shard_begin(r)),
                          static_cast<std::size_t>(p.shard_numel())));
    }
  } else {
    fn(eng.rank(), slice);
  }
}

}  // namespace detail

/// Saves eng as <dir>/<tag> (a collective; atomic; `latest` then names it). client_state is the
/// program's own JSON (data loader position, ...), returned by load_engine_checkpoint.
template <class Eng>
checkpoint::SaveResult save_engine_checkpoint(Eng& eng, const std::filesystem::path& dir,
                                              std::string_view tag,
                                              const nlohmann::json& client_state) {
  using MasterT = typename Eng::MasterT;
  expect<CheckpointError>(eng.between_steps(), "save_checkpoint('", std::string(tag),
                          "'): called in the middle of gradient accumulation; save after step()");
  eng.expect_intact("save_checkpoint('" + std::string(tag) + "')");
  eng.synchronize();
  std::vector<checkpoint::TensorSpec> tensors;
  std::vector<checkpoint::Segment> segments;
  auto add = [&](int u, auto slice, const std::string& suffix) {
    using E = std::remove_const_t<typename decltype(slice)::element_type>;
    const auto& specs = eng.unit_specs(u);
    for (auto& t : checkpoint::unit_tensor_specs<E>(specs, suffix)) tensors.push_back(t);
    detail::for_each_owned_shard(eng, u, slice, true, [&](int r, auto shard) {
      for (auto& s : checkpoint::unit_segments<E>(specs, eng.partition(u), r,
                                                  std::span<const E>(shard), suffix)) {
        segments.push_back(s);
      }
    });
  };
  // Offloaded masters and states are streamed in a unit at a time, so they are copied for the
  // save (the save writes every segment at once); in-memory ones are saved from where they are.
  std::vector<std::vector<float>> copies;
  auto kept = [&](std::span<float> s) {
    if constexpr (Eng::offload_nvme) {
      copies.emplace_back(s.begin(), s.end());
      return std::span<float>(copies.back());
    } else {
      return s;
    }
  };
  if constexpr (!Eng::offload_nvme) {
    for (int u = 0; u < eng.units(); ++u) add(u, std::span<MasterT>(eng.master_span(u)), "");
  }
  if (eng.has_optimizer()) {  // offloaded: the master comes in with the states, in one pass
    eng.for_each_optimizer([&](int u, auto& opt) {
      if constexpr (Eng::offload_nvme) add(u, kept(eng.master_span(u)), "");
      for (const std::string& name : opt.state_names()) add(u, kept(opt.state(name)), "/" + name);
    });
  }
  nlohmann::json state = eng.state_json();
  state["client_state"] = client_state;
  return checkpoint::save(eng.comm(), dir, tag, tensors, segments, state);
}

/// Loads <dir>/<tag> (or the tag `latest` names when tag is empty) into eng, whatever world size
/// and stage saved it (a collective). Returns the client_state saved with it.
template <class Eng>
nlohmann::json load_engine_checkpoint(Eng& eng, const std::filesystem::path& dir,
                                      std::string_view tag = {}) {
  expect<CheckpointError>(eng.between_steps(),
                          "load_checkpoint: called in the middle of gradient accumulation");
  eng.synchronize();
  const checkpoint::Reader reader = checkpoint::load(eng.comm(), dir, tag);
  auto read = [&](int u, auto slice, const std::string& suffix) {
    using E = typename decltype(slice)::element_type;
    const auto& specs = eng.unit_specs(u);
    for (const auto& p : specs) {
      expect<CheckpointError>(reader.contains(p.name + suffix), "checkpoint '",
                              reader.path().string(), "' has no tensor '", p.name + suffix, "'",
                              suffix.empty() ? std::string(" (saved from another model?)")
                                             : " (saved with another optimizer?)");
    }
    std::fill(slice.begin(), slice.end(), E{});
    detail::for_each_owned_shard(eng, u, slice, false, [&](int r, auto shard) {
      checkpoint::read_unit_shard<E>(reader, specs, eng.partition(u), r, shard, suffix,
                                     io::DTypeRule::convert);
    });
  };
  try {  // from here on a failure leaves some slices loaded and others not
    if constexpr (!Eng::offload_nvme) {
      for (int u = 0; u < eng.units(); ++u) read(u, eng.master_span(u), "");
    }
    if (eng.has_optimizer()) {  // offloaded: read into the swap buffers, written back out
      eng.for_each_optimizer(
          [&](int u, auto& opt) {
            if constexpr (Eng::offload_nvme) read(u, eng.master_span(u), "");
            for (const std::string& name : opt.state_names()) read(u, opt.state(name), "/" + name);
          },
          /*write_back=*/true, /*read_before=*/false);
    }
  } catch (const std::exception& e) {
    eng.mark_broken(std::string("load_checkpoint of '") + reader.path().string() +
                    "' failed part-way: " + e.what());
    throw;
  }
  eng.load_state_json(reader.engine_state());
  eng.refresh_from_master();
  eng.synchronize();
  const nlohmann::json& state = reader.engine_state();
  return state.contains("client_state") ? state["client_state"] : nlohmann::json();
}

}  // namespace zero::engine
