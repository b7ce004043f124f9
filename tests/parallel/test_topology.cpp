// Grid and ProcessGroups: Megatron-LM's and DeepSpeed's documented groups, properties for world
// sizes up to 8192, and real sub-communicators on LocalComm checked against the Grid.

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/topology.hpp>

#include "comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using Groups = std::vector<std::vector<int>>;

namespace {
Groups sorted(Groups g) {
  std::sort(g.begin(), g.end());
  return g;
}
}  // namespace

TEST_CASE("Grid reproduces Megatron-LM's 16-rank example (tp=2, pp=4, dp=2)", "[unit][topology]") {
  const Grid grid = Grid::for_world(16, /*tp=*/2, /*cp=*/1, /*ep=*/1, /*pp=*/4);
  CHECK(grid.size(Axis::dp) == 2);
  CHECK(grid.groups({Axis::tp}) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(grid.groups({Axis::dp}) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(grid.groups({Axis::pp}) ==
        Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  // Megatron's model-parallel group (tp-pp) from the same docstring.
  CHECK(grid.groups(AxisMask::parse("tp-pp")) ==
        Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}});
}

TEST_CASE("Grid reproduces DeepSpeed's expert-parallel groups", "[unit][topology]") {
  // E + M + D (utils/groups.py docstring): world 16, tp 2, ep 4, so expert-dp 2.
  const Grid emd = Grid::for_world(16, 2, 1, 4, 1);
  CHECK(sorted(emd.groups({Axis::ep})) ==
        sorted(Groups{{0, 2, 4, 6}, {8, 10, 12, 14}, {1, 3, 5, 7}, {9, 11, 13, 15}}));
  CHECK(sorted(emd.groups({Axis::dp})) ==
        sorted(Groups{{0, 8}, {2, 10}, {4, 12}, {6, 14}, {1, 9}, {3, 11}, {5, 13}, {7, 15}}));
  // E + D: ep groups are consecutive ranks, expert-dp groups stride ep.
  const Grid ed = Grid::for_world(8, 1, 1, 2, 1);
  CHECK(ed.groups({Axis::ep}) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(ed.groups({Axis::dp}) == Groups{{0, 2, 4, 6}, {1, 3, 5, 7}});
  // The non-expert data-parallel group is every rank of the stage (ep x dp).
  CHECK(ed.groups(AxisMask::parse("ep-dp")) == Groups{{0, 1, 2, 3, 4, 5, 6, 7}});
}

TEST_CASE("Grid coordinates round-trip and follow the order string", "[unit][topology]") {
  const Grid g(GridSizes{.tp = 2, .cp = 3, .ep = 1, .dp = 2, .pp = 2}, "tp-cp-ep-dp-pp");
  CHECK(g.world() == 24);
  for (int r = 0; r < g.world(); ++r) CHECK(g.rank(g.coords(r)) == r);
  // rank = tp + 2*(cp + 3*(ep + 1*(dp + 2*pp)))
  CHECK(g.coords(23) == Grid::Coords{1, 2, 0, 1, 1});
  CHECK(g.coord(7, Axis::cp) == 0);
  CHECK(g.coord(7, Axis::dp) == 1);
  const Grid pp_first(GridSizes{.tp = 2, .dp = 2, .pp = 2}, "pp-tp-dp");
  CHECK(pp_first.groups({Axis::pp}) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(pp_first.groups({Axis::tp}) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK_THROWS_AS(Grid(GridSizes{.tp = 2}, "cp-dp"), ConfigError);  // tp > 1 left out
  CHECK_THROWS_AS(Grid(GridSizes{}, "tp-tp"), ConfigError);         // repeated axis
  CHECK_THROWS_AS(Grid::for_world(12, 8, 1, 1, 1), ConfigError);    // 8 does not divide 12
  CHECK_THROWS_AS(AxisMask::parse("tp-xx"), ConfigError);
}

TEST_CASE("Grid groups partition the world and complementary masks meet in one rank",
          "[unit][topology]") {
  const std::vector<GridSizes> grids = {{1, 1, 1, 1, 1},  {2, 1, 1, 4, 2},  {2, 2, 1, 2, 2},
                                        {4, 1, 2, 2, 2},  {8, 1, 1, 3, 4},  {3, 5, 7, 2, 1},
                                        {8, 2, 4, 16, 4}, {8, 4, 2, 32, 4}, {1, 1, 1, 8192, 1},
                                        {2, 2, 2, 2, 2},  {8, 1, 8, 16, 8}};
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "dp-pp-tp-ep-cp"};
  for (const auto& sizes : grids) {
    for (const auto& order : orders) {
      const Grid g(sizes, order);
      REQUIRE(g.world() <= 8192);
      for (unsigned bits = 0; bits < 32; ++bits) {
        const AxisMask m = AxisMask::from_bits(bits), c = m.complement();
        INFO("world " << g.world() << " order " << order << " mask " << m.to_string());
        // Partition: every rank in exactly one group, at the position given by its key.
        const auto groups = g.groups(m);
        std::vector<int> seen(static_cast<std::size_t>(g.world()), 0);
        bool keys_ok = true;
        for (std::size_t color = 0; color < groups.size(); ++color) {
          for (std::size_t k = 0; k < groups[color].size(); ++k) {
            const int r = groups[color][k];
            ++seen[static_cast<std::size_t>(r)];
            keys_ok = keys_ok && g.color(r, m) == static_cast<int>(color) &&
                      g.key(r, m) == static_cast<int>(k);
          }
        }
        CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
        CHECK(keys_ok);
        // A group of m and a group of its complement share exactly one rank: the pairs
        // (color under m, color under complement) are all distinct and cover every pair.
        std::set<std::pair<int, int>> pairs;
        for (int r = 0; r < g.world(); ++r) pairs.emplace(g.color(r, m), g.color(r, c));
        CHECK(static_cast<int>(pairs.size()) == g.world());
        CHECK(g.group_count(m) * g.group_count(c) == g.world());
      }
      // group_ranks agrees with groups for a sample of ranks.
      for (int r = 0; r < g.world(); r += std::max(1, g.world() / 7)) {
        const AxisMask dp_cp{Axis::dp, Axis::cp};
        CHECK(g.group_ranks(r, dp_cp) ==
              g.groups(dp_cp)[static_cast<std::size_t>(g.color(r, dp_cp))]);
      }
    }
  }
}

TEST_CASE("ProcessGroups on LocalComm: each rank's sub-communicators hold the Grid's ranks",
          "[unit][topology][comm]") {
  const Grid grid = Grid::for_world(8, /*tp=*/2, /*cp=*/1, /*ep=*/1, /*pp=*/2);
  auto ok = zero::testing::per_rank<int>(8, [&](LocalComm& world) {
    ProcessGroups<LocalComm> groups(world, grid);
    int failures = 0;
    for (AxisMask m : standard_masks()) {
      auto& comm = groups.get(m);
      std::vector<int> mine{world.rank()}, members(static_cast<std::size_t>(comm.size()));
      comm.all_gather(std::span<const int>(mine), std::span<int>(members));
      failures += members != grid.group_ranks(world.rank(), m);
      failures += comm.rank() != grid.key(world.rank(), m);
      failures += comm.name() != m.to_string();
    }
    // A tensor-parallel all_reduce of the world rank sums the tp pair (Megatron's test_mappings).
    std::vector<int> v{world.rank()};
    groups.tp().all_reduce(std::span<int>(v), ReduceOp::sum);
    failures += v[0] != (world.rank() / 2) * 4 + 1;
    return failures;
  });
  for (int f : ok) CHECK(f == 0);
  const auto eight_rank_grid_on_four = [&](LocalComm& world) {
    ProcessGroups<LocalComm> g(world, grid);
    return 0;
  };
  CHECK_THROWS_AS(zero::testing::per_rank<int>(4, eight_rank_grid_on_four), ConfigError);
}
