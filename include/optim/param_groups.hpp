#pragma once
// Parameter groups over a flat shard: each group is a range of elements with its own
// hyper-parameters (typically: no weight decay on biases and norm weights, or a smaller lr for
// embeddings). Ranges rather than tensors because the engine owns flat shards; a mask (one byte
// per element) converts to ranges with ranges_from_mask.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::optim {

/// A half-open range [offset, offset + count) of a flat shard.
struct Range {
  std::size_t offset = 0;  ///< first element
  std::size_t count = 0;   ///< number of elements

  /// One past the last element.
  constexpr std::size_t end() const { return offset + count; }
  friend constexpr bool operator==(const Range&, const Range&) = default;
};

/// A range of the shard and the hyper-parameters used for it.
template <class Hyper>
struct ParamGroup {
  Range range;  ///< elements this group updates
  Hyper hyper;  ///< its hyper-parameters
};

/// One group covering a whole shard of numel elements.
template <class Hyper>
std::vector<ParamGroup<Hyper>> single_group(std::size_t numel, const Hyper& hyper) {
  return {ParamGroup<Hyper>{Range{0, numel}, hyper}};
}

/// The maximal runs of elements whose mask byte is non-zero (selected == true) or zero.
inline std::vector<Range> ranges_from_mask(std::span<const std::uint8_t> mask, bool selected) {
  std::vector<Range> out;
  std::size_t i = 0;
  while (i < mask.size()) {
    if ((mask[i] != 0) != selected) {
      ++i;
      continue;
    }
    const std::size_t start = i;
    while (i < mask.size() && (mask[i] != 0) == selected) ++i;
    out.push_back({start, i - start});
  }
  return out;
}

/// Groups from a no-decay mask: elements whose byte is non-zero get no_decay, the others decay.
template <class Hyper>
std::vector<ParamGroup<Hyper>> groups_from_mask(std::span<const std::uint8_t> no_decay_mask,
                                                const Hyper& decay, const Hyper& no_decay) {
  std::vector<ParamGroup<Hyper>> out;
  for (const Range& r : ranges_from_mask(no_decay_mask, false)) out.push_back({r, decay});
  for (const Range& r : ranges_from_mask(no_decay_mask, true)) out.push_back({r, no_decay});
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.range.offset < b.range.offset; });
  return out;
}

/// Throws ConfigError unless the ranges lie inside [0, numel) and do not overlap; elements in
/// no range are left untouched by the optimizer (padding, frozen parameters).
inline void validate_ranges(std::vector<Range> ranges, std::size_t numel, const char* who) {
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.offset < b.offset; });
  std::size_t covered_to = 0;
  for (const Range& r : ranges) {
    expect<ConfigError>(r.end() <= numel && r.end() >= r.offset, who, ": group range [", r.offset,
                        ", ", r.end(), ") exceeds the shard of ", numel, " elements");
    expect<ConfigError>(r.offset >= covered_to || r.count == 0, who, ": group range [", r.offset,
                        ", ", r.end(), ") overlaps the previous group, which ends at ", covered_to);
    covered_to = std::max(covered_to, r.end());
  }
}

}  // namespace zero::optim
