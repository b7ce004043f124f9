#pragma once
// Engine checkpoints on top of zero::checkpoint: every rank saves the pieces of parameters its
// master slice holds (the fp32 master "<name>" and each optimizer state "<name>/<state>") as
// segments of logical, unsharded tensors, plus the engine's state (counters, LR scheduler, loss
// scaler, the policies it ran with) and the program's own state. Loading reads, for whatever
// world size and stage the loading engine has, exactly the ranges its slices need, so any
// (world, stage) resumes any other. At stage 0 every rank holds replicas; rank 0 saves them.
// With tensor parallelism every tp x dp rank takes part: a tensor-parallel part is saved as the
// runs of its logical tensor, parameters whole on every tp rank by tp rank 0, so any
// (tp, dp, stage) resumes any other.
//
// Saves and loads happen between optimizer steps (not in the middle of gradient accumulation).

#include <algorithm>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <parallel/comm/text_collectives.hpp>
#include <zero/checkpoint/reader.hpp>
#include <zero/checkpoint/save.hpp>
#include <zero/checkpoint/unit_segments.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/engine_state.hpp>

namespace zero::engine {

/// Saves eng as <dir>/<tag> (a collective; atomic; `latest` then names it). client_state is the
/// program's own JSON (data loader position, ...), returned by load_engine_checkpoint.
template <class Eng>
checkpoint::SaveResult save_engine_checkpoint(Eng& eng, const std::filesystem::path& dir,
                                              std::string_view tag,
                                              const nlohmann::json& client_state) {
  auto state = eng.state();
  const std::string what = "save_checkpoint('" + std::string(tag) + "')";
  state.require_between_steps(what);
  state.require_consistent(what);
  state.synchronize();
  // Every rank names every tensor; the segments come from the units this rank saves, which
  // alone are staged (at stage 0 rank 0 saves the whole units, so the others copy nothing).
  std::vector<checkpoint::TensorSpec> tensors;
  // The save streams: it declares this rank's segments first (their shapes need no data), then
  // writes each unit's as the state store hands the unit out, so state that is only swapped in
  // or staged for the pass (Offload<NVMe>, a device's optimizer states) is never in host memory
  // more than a unit at a time. Both passes walk the units, shards and states in one order.
  const bool whole_params = state.tp_rank() == 0;
  std::vector<checkpoint::SegmentShape> declared;
  auto name_and_declare = [&]<class E>(int u, const std::string& suffix) {
    for (auto& t : checkpoint::unit_tensor_specs<E>(state.unit_specs(u), suffix)) {
      tensors.push_back(t);
    }
    for (int r : state.owned_shard_ranks(u, ShardUse::save)) {
      for (auto& s : checkpoint::unit_segment_shapes<E>(state.unit_specs(u), state.partition(u), r,
                                                        suffix, whole_params)) {
        declared.push_back(std::move(s));
      }
    }
  };
  // Declaring may fail on one rank alone: the ranks agree before the save's collectives, so
  // every rank throws the first failure instead of the others waiting for it there. A failure
  // while a unit is written (a swap file's read, a device copy) is agreed on by the save.
  std::string failure;
  try {
    for (int u = 0; u < state.num_units(); ++u) {
      name_and_declare.template operator()<typename decltype(state)::MasterT>(u, "");
      if (const optim::AnyOptimizer* opt = state.optimizer_of(u)) {
        for (const std::string& n : opt->state_names()) {
          name_and_declare.template operator()<float>(u, "/" + n);
        }
      }
    }
  } catch (const std::exception& e) {
    failure = zero::detail::concat("rank ", state.state_comm().rank(), ": ", e.what());
  }
  auto comm = state.state_comm();
  if (const std::string first = parallel::first_nonempty_text(comm, failure); !first.empty()) {
    raise<CheckpointError>(what, " failed on ", first, " (nothing was written)");
  }
  const auto produce = [&](const checkpoint::SegmentSink& sink) {
    auto write = [&]<class E>(int u, std::span<E> slice, const std::string& suffix) {
      state.for_each_owned_shard(u, slice, ShardUse::save, [&](int r, std::span<E> shard) {
        for (const auto& s :
             checkpoint::unit_segments<E>(state.unit_specs(u), state.partition(u), r,
                                          std::span<const E>(shard), suffix, whole_params)) {
          sink(s);
        }
      });
    };
    state.for_each_unit(
        StateAccess::read,
        [&](int u, auto master, optim::AnyOptimizer* opt) {
          write(u, master, "");
          if (opt == nullptr) return;
          for (const std::string& n : opt->state_names()) write(u, opt->state(n), "/" + n);
        },
        [&](int u) { return state.saves_unit(u); });
  };
  nlohmann::json engine_json = state.to_json();
  engine_json["client_state"] = client_state;
  // The rows in use of the tables that declare them (ParamSpec::rows_in_use), from every rank of
  // the state group (a pipeline stage holds only its own units): a load at another padding of
  // the same vocabulary reads them, and one of another vocabulary is refused.
  std::vector<nn::ParamSpec> all_specs;
  for (int u = 0; u < state.num_units(); ++u) {
    for (const nn::ParamSpec& p : state.unit_specs(u)) all_specs.push_back(p);
  }
  nlohmann::json rows_in_use = nlohmann::json::object();
  for (const std::string& text :
       parallel::all_gather_text(comm, checkpoint::rows_in_use_record(all_specs).dump())) {
    rows_in_use.update(nlohmann::json::parse(text));
  }
  if (!rows_in_use.empty()) engine_json[checkpoint::rows_in_use_key] = std::move(rows_in_use);
  return checkpoint::save_streamed(comm, dir, tag, tensors, declared, produce, engine_json);
}

/// Runs a load's pass over this rank's slices, pass(touched), which sets touched before it
/// changes the first one, and then refreshes the engine from the new masters (a collective).
/// Each rank reads its own slices, so a failure (a checksum, a file only it reads, another
/// optimizer's states) may be one rank's alone: the ranks agree on the outcome first, so when any
/// pass threw every rank throws CheckpointError naming what of source and the first failure, and
/// none goes on to the regather waiting for the others. When no rank changed a slice the engine
/// is left as it was; when any did, every rank is marked inconsistent (some slices loaded, others
/// not) until a load succeeds. A load that replaces the whole state (whole) marks the engine
/// consistent when it succeeds; one that replaces only the masters keeps what it was.
template <class State, class Pass>
void load_agreed(State& state, std::string_view what, const std::string& source, bool whole,
                 Pass&& pass) {
  auto comm = state.state_comm();
  const std::string before = state.inconsistency();
  const std::string unfinished = zero::detail::concat(what, " of '", source, "' did not finish");
  bool touched = false;
  std::string failure;
  try {
    pass(touched);
  } catch (const std::exception& e) {
    failure = zero::detail::concat("rank ", comm.rank(), ": ", e.what());
  }
  // Marked before the agreement, which may itself fail (a broken communicator).
  if (touched) state.mark_inconsistent(unfinished);
  // Each rank's report: whether it changed a slice, then its failure (empty: none).
  std::string first;
  bool any_touched = false;
  for (const std::string& r : parallel::all_gather_text(comm, (touched ? "+" : "-") + failure)) {
    any_touched = any_touched || r.front() == '+';
    if (first.empty() && r.size() > 1) first = r.substr(1);
  }
  if (!first.empty()) {
    const std::string why = zero::detail::concat(what, " of '", source, "' failed",
                                                 any_touched ? " part-way" : "", " on ", first);
    if (any_touched) state.mark_inconsistent(why);
    throw CheckpointError(why);
  }
  state.masters_replaced();
  if (whole || before.empty()) {
    state.mark_consistent();
  } else {
    state.mark_inconsistent(before);
  }
  state.synchronize();
}

/// Loads <dir>/<tag> (or the tag `latest` names when tag is empty) into eng, whatever world size
/// and stage saved it (a collective). Returns the client_state saved with it.
template <class Eng>
nlohmann::json load_engine_checkpoint(Eng& eng, const std::filesystem::path& dir,
                                      std::string_view tag = {}) {
  auto state = eng.state();
  state.require_between_steps("load_checkpoint");
  state.synchronize();
  auto comm = state.state_comm();
  const checkpoint::Reader reader = checkpoint::load(comm, dir, tag);
  auto read = [&](int u, auto slice, const std::string& suffix) {
    using E = typename decltype(slice)::element_type;
    const auto& specs = state.unit_specs(u);
    for (const auto& p : specs) {
      expect<CheckpointError>(reader.contains(p.name + suffix), "checkpoint '",
                              reader.path().string(), "' has no tensor '", p.name + suffix, "'",
                              suffix.empty() ? std::string(" (saved from another model?)")
                                             : " (saved with another optimizer?)");
    }
    std::fill(slice.begin(), slice.end(), E{});
    state.for_each_owned_shard(u, slice, ShardUse::fill, [&](int r, auto shard) {
      checkpoint::read_unit_shard<E>(reader, specs, state.partition(u), r, shard, suffix,
                                     io::DTypeRule::convert);
    });
  };
  // As a strict module load: a tensor this model lacks means another (larger) model, e.g. 24
  // layers read into 12, whose names all match. The names are those of every rank of the state
  // group (a collective): a pipeline stage holds only its own units, and a 24-layer checkpoint
  // read into 12 layers at pp 2 found each stage's tensors.
  {
    std::string mine;
    for (int u = 0; u < state.num_units(); ++u) {
      for (const auto& p : state.unit_specs(u)) mine.append(p.name).push_back('\n');
    }
    std::set<std::string, std::less<>> known;
    for (const std::string& text : parallel::all_gather_text(comm, mine)) {
      for (std::size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos;
           at = end + 1) {
        known.insert(text.substr(at, end - at));
      }
    }
    std::vector<std::string> extra;
    for (const std::string& n : reader.names()) {
      if (!known.contains(checkpoint::parameter_of(n))) extra.push_back(n);
    }
    if (!extra.empty()) {
      std::string listed;
      for (std::size_t i = 0; i < std::min<std::size_t>(extra.size(), 4); ++i) {
        listed += (i ? ", '" : "'") + extra[i] + "'";
      }
      raise<CheckpointError>("checkpoint '", reader.path().string(), "' holds ", extra.size(),
                             " tensor(s) this model does not have (", listed,
                             extra.size() > 4 ? ", ..." : "",
                             "): saved from another model? Nothing was loaded");
    }
  }
  load_agreed(state, "load_checkpoint", reader.path().string(), true, [&](bool& touched) {
    state.check_json(reader.engine_state());  // another optimizer's states are refused here
    // Every tensor this rank reads is there, in its shape, before the first slice changes: a
    // refused load (another model's sizes, another optimizer) leaves the engine as it was.
    for (int u = 0; u < state.num_units(); ++u) {
      checkpoint::expect_unit_tensors(reader, state.unit_specs(u), "",
                                      " (saved from another model?)");
      if (const optim::AnyOptimizer* opt = state.optimizer_of(u)) {
        for (const std::string& name : opt->state_names()) {
          checkpoint::expect_unit_tensors(reader, state.unit_specs(u), "/" + name,
                                          " (saved with another optimizer?)");
        }
      }
    }
    touched = true;
    state.for_each_unit(StateAccess::overwrite, [&](int u, auto master, optim::AnyOptimizer* opt) {
      read(u, master, "");
      if (opt == nullptr) return;
      for (const std::string& name : opt->state_names()) read(u, opt->state(name), "/" + name);
    });
    state.load_json(reader.engine_state());
  });
  const nlohmann::json& saved = reader.engine_state();
  return saved.contains("client_state") ? saved["client_state"] : nlohmann::json();
}

}  // namespace zero::engine
