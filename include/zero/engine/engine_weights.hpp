#pragma once
// Starting weights from a Hugging Face GPT-2 safetensors file, empty-then-shard: each rank reads
// only the element ranges of the parameters its master slice holds (Conv1D weights, stored
// transposed, are read one tensor at a time), so at stage 3 no rank ever holds the whole model.
// The optimizer states stay fresh; counters are untouched.

#include <filesystem>

#include <zero/engine/engine_checkpoint.hpp>
#include <zero/io/gpt2_layout.hpp>
#include <zero/io/safetensors_reader.hpp>

namespace zero::engine {

/// Overwrites eng's master slices with the weights of a GPT-2 safetensors file (any float
/// dtype; a collective only in that every rank must call it before its next step).
template <class Eng>
void load_gpt2_weights(Eng& eng, const std::filesystem::path& file) {
  using MasterT = typename Eng::MasterT;
  expect<CheckpointError>(eng.between_steps(),
                          "load_gpt2_weights: called in the middle of gradient accumulation");
  eng.synchronize();
  const io::SafetensorsReader reader(file);
  for (int u = 0; u < eng.units(); ++u) {
    const auto& specs = eng.unit_specs(u);
    const std::span<MasterT> slice = eng.master_span(u);
    std::fill(slice.begin(), slice.end(), MasterT{});
    detail::for_each_owned_shard(eng, u, slice, false, [&](int r, std::span<MasterT> shard) {
      for (const ShardSegment& s : eng.partition(u).segments(r)) {
        const nn::ParamSpec& p = specs[static_cast<std::size_t>(s.param)];
        Tensor<MasterT> out(shard.data() + s.shard_offset, Shape{s.count});
        io::gpt2::import_range(reader, p.name, p.shape, s.param_offset, out,
                               io::DTypeRule::convert);
      }
    });
  }
  eng.refresh_from_master();
  eng.synchronize();
}

}  // namespace zero::engine
