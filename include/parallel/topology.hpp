#pragma once
// Topology as arithmetic: a Grid maps ranks to (tp, cp, ep, dp, pp) coordinates and back, and
// names the group of any set of axes (an AxisMask), exactly as Megatron-LM's RankGenerator and
// generate_masked_orthogonal_rank_groups do. No communicator is involved, so it is testable
// for any world size without MPI. The first axis of the order string varies fastest; with the
// default "tp-cp-ep-dp-pp":
//   rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))
// A group of mask m holds the ranks that agree on every axis outside m. Its split color is the
// mixed-radix index over the axes outside m and its key the index over the axes inside m (both
// in order), so one split per mask builds every group, in Megatron's in-group order.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::parallel {

/// A parallelism axis: tensor, context, expert, data and pipeline parallel.
enum class Axis : std::uint8_t { tp, cp, ep, dp, pp };

/// Number of axes.
inline constexpr int axis_count = 5;

/// Every axis, in the default order.
inline constexpr Axis all_axes[axis_count] = {Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp};

/// Index of axis in a Coords array. The modulo is free and tells the compiler the index is in
/// bounds (g++ 12 otherwise warns that an enum value could be out of range).
constexpr std::size_t axis_index(Axis axis) {
  return static_cast<std::size_t>(axis) % axis_count;
}

/// Lower-case name of axis ("tp", ...).
constexpr std::string_view name_of(Axis axis) {
  constexpr std::string_view names[] = {"tp", "cp", "ep", "dp", "pp"};
  return names[static_cast<int>(axis)];
}

/// Parses an axis name; throws ConfigError listing the names.
inline Axis parse_axis(std::string_view text) {
  for (Axis a : all_axes) {
    if (name_of(a) == text) return a;
  }
  raise<ConfigError>("unknown parallel axis '", std::string(text),
                     "': expected one of tp, cp, ep, dp, pp");
}

/// A set of axes: the axes a group varies along.
class AxisMask {
 public:
  /// The empty set.
  constexpr AxisMask() = default;
  /// The set of the listed axes.
  constexpr AxisMask(std::initializer_list<Axis> axes) {
    for (Axis a : axes) bits_ = static_cast<std::uint8_t>(bits_ | bit(a));
  }
  /// The set whose bit i (Axis i) is set in bits.
  static constexpr AxisMask from_bits(unsigned bits) {
    AxisMask m;
    m.bits_ = static_cast<std::uint8_t>(bits & 0x1fu);
    return m;
  }
  /// Parses "tp", "dp-cp", "tp-pp", ... (any order).
  static AxisMask parse(std::string_view text) {
    AxisMask m;
    while (!text.empty()) {
      const auto dash = text.find('-');
      m.bits_ = static_cast<std::uint8_t>(m.bits_ | bit(parse_axis(text.substr(0, dash))));
      text = dash == std::string_view::npos ? std::string_view{} : text.substr(dash + 1);
    }
    return m;
  }

  /// True when axis is in the set.
  constexpr bool contains(Axis axis) const { return (bits_ & bit(axis)) != 0; }
  /// The bit pattern (bit i = Axis i).
  constexpr unsigned bits() const { return bits_; }
  /// True for the empty set.
  constexpr bool empty() const { return bits_ == 0; }
  /// The axes not in this set.
  constexpr AxisMask complement() const { return from_bits(~bits_ & 0x1fu); }
  /// Union.
  friend constexpr AxisMask operator|(AxisMask a, AxisMask b) {
    return from_bits(a.bits_ | b.bits_);
  }
  /// Equality.
  friend constexpr bool operator==(AxisMask, AxisMask) = default;
  /// "tp-dp" (axes in the default order), or "none".
  std::string to_string() const {
    std::string out;
    for (Axis a : all_axes) {
      if (!contains(a)) continue;
      if (!out.empty()) out += '-';
      out += name_of(a);
    }
    return out.empty() ? "none" : out;
  }

 private:
  static constexpr std::uint8_t bit(Axis a) {
    return static_cast<std::uint8_t>(1u << static_cast<int>(a));
  }
  std::uint8_t bits_ = 0;
};

/// Sizes of the five axes.
struct GridSizes {
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
  /// Size of axis.
  constexpr int operator[](Axis axis) const {
    switch (axis) {
      case Axis::tp:
        return tp;
      case Axis::cp:
        return cp;
      case Axis::ep:
        return ep;
      case Axis::dp:
        return dp;
      case Axis::pp:
        return pp;
    }
    return 1;
  }
  friend constexpr bool operator==(const GridSizes&, const GridSizes&) = default;
};

/// Rank <-> coordinates over (tp, cp, ep, dp, pp), and the groups of any axis mask.
class Grid {
 public:
  /// Coordinates indexed by Axis (coords[Axis::dp] is the dp coordinate).
  using Coords = std::array<int, axis_count>;

  /// A grid of the given sizes; order lists the axes fastest first ("tp-cp-ep-dp-pp"); axes
  /// left out of it must have size 1 and are appended (as Megatron does).
  explicit Grid(GridSizes sizes, std::string_view order = "tp-cp-ep-dp-pp") : sizes_(sizes) {
    for (Axis a : all_axes) {
      expect<ConfigError>(sizes[a] >= 1, "Grid: size of axis ", name_of(a), " is ", sizes[a],
                          "; every axis needs size >= 1");
    }
    bool seen[axis_count] = {};
    int n = 0;
    std::string_view rest = order;
    while (!rest.empty()) {
      const auto dash = rest.find('-');
      const Axis a = parse_axis(rest.substr(0, dash));
      expect<ConfigError>(!seen[static_cast<int>(a)], "Grid: axis ", name_of(a),
                          " appears twice in order '", std::string(order), "'");
      seen[static_cast<int>(a)] = true;
      order_[static_cast<std::size_t>(n++)] = a;
      rest = dash == std::string_view::npos ? std::string_view{} : rest.substr(dash + 1);
    }
    for (Axis a : all_axes) {
      if (seen[static_cast<int>(a)]) continue;
      expect<ConfigError>(sizes[a] == 1, "Grid: order '", std::string(order), "' leaves out axis ",
                          name_of(a), " of size ", sizes[a], "; only size-1 axes may be left out");
      order_[static_cast<std::size_t>(n++)] = a;
    }
    world_ = 1;
    for (Axis a : all_axes) world_ *= sizes[a];
  }

  /// The grid of world ranks with dp derived as world / (tp*cp*ep*pp) (Megatron derives dp
  /// the same way); throws ConfigError when the product does not divide the world.
  static Grid for_world(int world, int tp, int cp, int ep, int pp,
                        std::string_view order = "tp-cp-ep-dp-pp") {
    const long model = static_cast<long>(tp) * cp * ep * pp;
    expect<ConfigError>(model >= 1 && world % model == 0, "Grid: world size ", world,
                        " is not divisible by tp*cp*ep*pp = ", tp, "*", cp, "*", ep, "*", pp, " = ",
                        model);
    return Grid(GridSizes{tp, cp, ep, static_cast<int>(world / model), pp}, order);
  }

  /// Number of ranks.
  int world() const { return world_; }
  /// Size of axis.
  int size(Axis axis) const { return sizes_[axis]; }
  /// All sizes.
  const GridSizes& sizes() const { return sizes_; }
  /// The axes, fastest first.
  const std::array<Axis, axis_count>& order() const { return order_; }

  /// Coordinates of rank (mixed-radix decode, first axis fastest).
  Coords coords(int rank) const {
    check_rank(rank);
    Coords c{};
    for (Axis a : order_) {
      c[axis_index(a)] = rank % sizes_[a];
      rank /= sizes_[a];
    }
    return c;
  }
  /// Coordinate of rank along axis.
  int coord(int rank, Axis axis) const { return coords(rank)[axis_index(axis)]; }
  /// Rank at coordinates c.
  int rank(const Coords& c) const {
    int r = 0;
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      const int x = c[axis_index(*it)];
      expect<ConfigError>(x >= 0 && x < sizes_[*it], "Grid: coordinate ", x, " of axis ",
                          name_of(*it), " is outside [0, ", sizes_[*it], ")");
      r = r * sizes_[*it] + x;
    }
    return r;
  }

  /// Number of ranks in each group of mask.
  int group_size(AxisMask mask) const {
    int n = 1;
    for (Axis a : all_axes) {
      if (mask.contains(a)) n *= sizes_[a];
    }
    return n;
  }
  /// Number of groups of mask.
  int group_count(AxisMask mask) const { return world_ / group_size(mask); }
  /// split color of rank's group of mask: mixed-radix index over the axes outside mask.
  int color(int rank, AxisMask mask) const { return index_over(coords(rank), mask.complement()); }
  /// split key of rank within its group of mask: mixed-radix index over the axes in mask,
  /// which is also its rank in that group.
  int key(int rank, AxisMask mask) const { return index_over(coords(rank), mask); }

  /// The ranks of rank's group of mask, in group-rank (key) order.
  std::vector<int> group_ranks(int rank, AxisMask mask) const {
    const Coords base = coords(rank);
    std::vector<int> out;
    const int n = group_size(mask);
    out.reserve(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) {
      Coords c = base;
      int rest = k;
      for (Axis a : order_) {
        if (!mask.contains(a)) continue;
        c[axis_index(a)] = rest % sizes_[a];
        rest /= sizes_[a];
      }
      out.push_back(this->rank(c));
    }
    return out;
  }

  /// Every group of mask, ordered by color, each in key order (Megatron's
  /// generate_masked_orthogonal_rank_groups).
  std::vector<std::vector<int>> groups(AxisMask mask) const {
    std::vector<std::vector<int>> out(static_cast<std::size_t>(group_count(mask)),
                                      std::vector<int>(static_cast<std::size_t>(group_size(mask))));
    for (int r = 0; r < world_; ++r) {
      const Coords c = coords(r);
      out[static_cast<std::size_t>(index_over(c, mask.complement()))]
         [static_cast<std::size_t>(index_over(c, mask))] = r;
    }
    return out;
  }

 private:
  void check_rank(int rank) const {
    expect<ConfigError>(rank >= 0 && rank < world_, "Grid: rank ", rank, " is outside [0, ", world_,
                        ")");
  }
  int index_over(const Coords& c, AxisMask mask) const {
    int index = 0, stride = 1;
    for (Axis a : order_) {
      if (!mask.contains(a)) continue;
      index += c[axis_index(a)] * stride;
      stride *= sizes_[a];
    }
    return index;
  }

  GridSizes sizes_;
  std::array<Axis, axis_count> order_{};
  int world_ = 1;
};

}  // namespace zero::parallel
