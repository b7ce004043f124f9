// NvmeSwapper: round trips of odd-sized tensors, the pipelined pass equal to a sequential loop
// for every buffer count, fault injection that leaves other sub-groups intact, and cleanup.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/offload/nvme_swapper.hpp>

#include "scratch.hpp"

using namespace zero;
using namespace zero::offload;
using zero::testing::TempDir;

namespace {

NvmeConfig small_config(const std::filesystem::path& dir, int buffers) {
  NvmeConfig c;
  c.nvme_path = dir;
  c.buffer_count = buffers;
  c.block_size = 64 * 1024;
  c.queue_depth = 4;
  c.thread_count = 2;
  return c;
}

// Sub-groups of three optimizer states with sizes that are not multiples of any block.
std::vector<std::vector<SwapTensor>> odd_groups(int n) {
  std::vector<std::vector<SwapTensor>> g;
  for (int i = 0; i < n; ++i) {
    const std::int64_t numel = 20'000 + 4'099 * i + (i % 2 ? 1 : 0);
    g.push_back({{"master", numel}, {"exp_avg", numel}, {"exp_avg_sq", numel + 7}});
  }
  return g;
}

// The reference values of tensor t of group g.
std::vector<float> values(std::size_t g, std::size_t t, std::int64_t numel) {
  return zero::testing::random_floats(static_cast<std::size_t>(numel),
                                      static_cast<std::uint32_t>(1000 * g + t));
}

// Writes every group's reference values with swap_out.
void fill(NvmeSwapper& s) {
  for (std::size_t g = 0; g < s.num_groups(); ++g) {
    std::vector<std::vector<float>> data;
    std::vector<std::span<const float>> spans;
    for (std::size_t t = 0; t < s.layout(g).tensors.size(); ++t)
      data.push_back(values(g, t, s.layout(g).tensors[t].numel));
    for (auto& d : data) spans.emplace_back(d);
    s.swap_out(g, spans);
  }
}

// Reads group g whole.
std::vector<std::vector<float>> read(NvmeSwapper& s, std::size_t g) {
  std::vector<std::vector<float>> data;
  std::vector<std::span<float>> spans;
  for (const auto& t : s.layout(g).tensors) data.emplace_back(static_cast<std::size_t>(t.numel));
  for (auto& d : data) spans.emplace_back(d);
  s.swap_in(g, spans);
  return data;
}

// One "optimizer step" on a group: deterministic and different for every element and step.
void update(std::size_t g, std::span<const std::span<float>> t, int step) {
  for (std::size_t i = 0; i < t[0].size(); ++i) {
    t[1][i] = 0.9f * t[1][i] + 0.1f * static_cast<float>(g + 1);
    t[2][i] = 0.99f * t[2][i] + 0.01f * t[1][i] * t[1][i];
    t[0][i] -= 0.01f * t[1][i] + static_cast<float>(step) * 1e-4f;
  }
  t[2][t[2].size() - 1] += 1.0f;  // the odd tail element of exp_avg_sq
}

// The values odd_groups(groups) hold after `steps` calls of update (steps 0, 1, ...) on each group,
// from values(): what a swapper's passes must leave in the files.
std::vector<std::vector<std::vector<float>>> updated_values(int groups, int steps) {
  std::vector<std::vector<std::vector<float>>> ref;
  for (std::size_t g = 0; g < static_cast<std::size_t>(groups); ++g) {
    ref.emplace_back();
    for (std::size_t t = 0; t < 3; ++t)
      ref[g].push_back(values(g, t, odd_groups(groups)[g][t].numel));
    std::vector<std::span<float>> sp(ref[g].begin(), ref[g].end());
    for (int step = 0; step < steps; ++step) update(g, sp, step);
  }
  return ref;
}

// Swapper options (designated initialisers would warn about the fields left out).
SwapperOptions opts(IoBackend backend, int rank = 0,
                    std::shared_ptr<FaultInjector> faults = nullptr) {
  SwapperOptions o;
  o.rank = rank;
  o.backend = backend;
  o.faults = std::move(faults);
  return o;
}

}  // namespace

TEST_CASE("swap_out then swap_in returns the data for odd tensor sizes", "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  INFO("engine " << zero::testing::name_of(backend));
  TempDir dir("swap", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 2), odd_groups(3), opts(backend, 3));
  CHECK(s.directory() == dir.path() / "zero_swap" / "rank3" / "optimizer");
  CHECK(std::filesystem::exists(s.file_of(2)));
  CHECK(s.layout(1).offsets[1] % s.alignment() == 0);
  // A group never written reads as zeros.
  for (const auto& t : read(s, 1))
    for (float x : t) REQUIRE(x == 0.0f);
  fill(s);
  for (std::size_t g = 0; g < 3; ++g) {
    const auto got = read(s, g);
    for (std::size_t t = 0; t < got.size(); ++t)
      REQUIRE(got[t] == values(g, t, static_cast<std::int64_t>(got[t].size())));
  }
  // Wrong span counts and sizes are shape errors naming the tensor.
  std::vector<float> small(5);
  std::vector<std::span<float>> bad{small, small, small};
  CHECK_THROWS_WITH(s.swap_in(0, bad), Catch::Contains("tensor 'master'"));
  CHECK_THROWS_AS(s.swap_in(7, bad), ShapeError);
}

TEST_CASE("pipelined for_each_group equals a sequential loop for every buffer count",
          "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  const int buffers = GENERATE(1, 2, 3, 5);
  INFO("engine " << zero::testing::name_of(backend) << ", buffer_count " << buffers);
  TempDir dir("pipe", zero::testing::direct_io_base());
  const int groups = 6, steps = 3;
  // Reference: the same updates on vectors in memory.
  const auto ref = updated_values(groups, steps);

  NvmeSwapper s(small_config(dir.path(), buffers), odd_groups(groups), opts(backend));
  fill(s);
  std::vector<std::size_t> order;
  for (int step = 0; step < steps; ++step)
    s.for_each_group([&](std::size_t g, std::span<const std::span<float>> t) {
      order.push_back(g);
      REQUIRE(t.size() == 3);
      REQUIRE(reinterpret_cast<std::uintptr_t>(t[0].data()) % s.alignment() == 0);
      update(g, t, step);
    });
  CHECK(order.size() == static_cast<std::size_t>(groups * steps));
  CHECK(order[groups + 1] == 1);
  for (std::size_t g = 0; g < groups; ++g) {
    const auto got = read(s, g);
    for (std::size_t t = 0; t < 3; ++t) REQUIRE(got[t] == ref[g][t]);
  }
}

TEST_CASE("a write-only pass starts from zeros and a read-only pass writes nothing",
          "[unit][offload]") {
  TempDir dir("passes", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 3), odd_groups(4));
  s.for_each_group({.read = false, .write = true},
                   [](std::size_t g, std::span<const std::span<float>> t) {
                     for (auto span : t)
                       for (auto& x : span) {
                         REQUIRE(x == 0.0f);
                         x = static_cast<float>(g) + 0.5f;
                       }
                   });
  s.for_each_group({.read = true, .write = false},
                   [](std::size_t g, std::span<const std::span<float>> t) {
                     for (auto span : t)
                       for (auto& x : span) {
                         REQUIRE(x == static_cast<float>(g) + 0.5f);
                         x = -1.0f;  // not written back
                       }
                   });
  for (std::size_t g = 0; g < 4; ++g)
    for (const auto& t : read(s, g))
      for (float x : t) REQUIRE(x == static_cast<float>(g) + 0.5f);
}

TEST_CASE("multi-MiB groups in 1 MiB requests round-trip exactly through every pass kind",
          "[unit][offload]") {
  // Buffers of 2 MiB and more take the huge-page path of AlignedBuffer; groups end in a partial
  // request (sizes are not multiples of 1 MiB) and outnumber the buffers, so buffers are reused
  // dirty by every pass kind.
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  const int buffers = GENERATE(1, 2, 4);
  INFO("engine " << zero::testing::name_of(backend) << ", buffer_count " << buffers);
  TempDir dir("bigswap", zero::testing::direct_io_base());
  NvmeConfig c = small_config(dir.path(), buffers);
  c.block_size = 1 << 20;
  c.queue_depth = 8;
  std::vector<std::vector<SwapTensor>> groups;
  for (int i = 0; i < 5; ++i) {
    const std::int64_t numel = 700'001 + 65'537 * i;
    groups.push_back({{"master", numel}, {"exp_avg", numel + 3}, {"exp_avg_sq", numel}});
  }
  NvmeSwapper s(c, groups, opts(backend));
  REQUIRE(s.layout(0).bytes > (std::size_t{8} << 20));
  const auto at = [](std::size_t g, std::size_t t, std::size_t i, int step) {
    return static_cast<float>(g * 1'000'003 + t * 7'919 + i) * 0.5f + static_cast<float>(step);
  };
  // Write-only: starts from zeros even in a buffer reused from an earlier group of the pass.
  s.for_each_group({.read = false, .write = true},
                   [&](std::size_t g, std::span<const std::span<float>> t) {
                     for (std::size_t k = 0; k < t.size(); ++k)
                       for (std::size_t i = 0; i < t[k].size(); ++i) {
                         REQUIRE(t[k][i] == 0.0f);
                         t[k][i] = at(g, k, i, 0);
                       }
                   });
  // Read and write: sees step 0, leaves step 1.
  s.for_each_group([&](std::size_t g, std::span<const std::span<float>> t) {
    for (std::size_t k = 0; k < t.size(); ++k)
      for (std::size_t i = 0; i < t[k].size(); ++i) {
        REQUIRE(t[k][i] == at(g, k, i, 0));
        t[k][i] = at(g, k, i, 1);
      }
  });
  // Read-only: sees step 1 and writes nothing back.
  s.for_each_group({.read = true, .write = false},
                   [&](std::size_t g, std::span<const std::span<float>> t) {
                     for (std::size_t k = 0; k < t.size(); ++k)
                       for (std::size_t i = 0; i < t[k].size(); ++i) {
                         REQUIRE(t[k][i] == at(g, k, i, 1));
                         t[k][i] = -1.0f;
                       }
                   });
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto got = read(s, g);
    for (std::size_t k = 0; k < got.size(); ++k)
      for (std::size_t i = 0; i < got[k].size(); ++i) REQUIRE(got[k][i] == at(g, k, i, 1));
  }
}

TEST_CASE("a pass cut short by fn leaves no stale zero-fill for the next pass", "[unit][offload]") {
  // Fresh groups are zero-filled instead of read; an exception stops a pass after later groups
  // were claimed that way. Once the groups hold data, the next pass must read them.
  TempDir dir("stale", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 4), odd_groups(5));
  CHECK_THROWS_WITH(s.for_each_group([](std::size_t, std::span<const std::span<float>>) {
    throw std::runtime_error("stop at the first group");
  }),
                    "stop at the first group");
  fill(s);
  std::size_t seen = 0;
  s.for_each_group({.read = true, .write = false},
                   [&](std::size_t g, std::span<const std::span<float>> t) {
                     ++seen;
                     for (std::size_t k = 0; k < t.size(); ++k) {
                       const auto want = values(g, k, static_cast<std::int64_t>(t[k].size()));
                       REQUIRE(std::equal(t[k].begin(), t[k].end(), want.begin(), want.end()));
                     }
                   });
  CHECK(seen == 5);
}

TEST_CASE("swap_in_tensor reads one tensor alone, nothing swaps inside a pass", "[unit][offload]") {
  TempDir dir("tensor", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 3), odd_groups(4));
  std::vector<float> out(static_cast<std::size_t>(s.layout(2).tensors[1].numel), -1.0f);
  s.swap_in_tensor(2, 1, out);  // never written: zeros
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
  fill(s);
  for (std::size_t g = 0; g < 4; ++g) {
    for (std::size_t t = 0; t < 3; ++t) {
      std::vector<float> one(static_cast<std::size_t>(s.layout(g).tensors[t].numel));
      s.swap_in_tensor(g, t, one);
      REQUIRE(one == values(g, t, static_cast<std::int64_t>(one.size())));
    }
  }
  CHECK_THROWS_AS(s.swap_in_tensor(1, 0, std::span<float>(out)), ShapeError);  // wrong size
  CHECK_THROWS_WITH(s.for_each_group([&](std::size_t g, std::span<const std::span<float>>) {
    if (g == 1) s.swap_in_tensor(2, 1, out);
  }),
                    Catch::Contains("inside for_each_group"));
  // The refused call left the files as they were.
  std::vector<float> again(out.size());
  s.swap_in_tensor(2, 1, again);
  CHECK(again == values(2, 1, static_cast<std::int64_t>(again.size())));
}

TEST_CASE("swap_in_tensor takes its read ahead, and a pass or a swap_out drops the reads it staled",
          "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  INFO("engine " << zero::testing::name_of(backend));
  TempDir dir("ahead", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 4), odd_groups(5), opts(backend));
  REQUIRE(s.read_ahead_capacity() == 3);
  const auto numel = [&](std::size_t g, std::size_t t) {
    return static_cast<std::size_t>(s.layout(g).tensors[t].numel);
  };
  std::vector<float> out(numel(2, 1), -1.0f);
  CHECK(s.read_ahead(2, 1));  // never written: holds a buffer, reads nothing, gives zeros
  s.swap_in_tensor(2, 1, out);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
  CHECK(s.read_stats().on_demand == 1);
  fill(s);
  CHECK(s.read_ahead(0, 0));
  CHECK(s.read_ahead(1, 0));
  CHECK(s.read_ahead(1, 0));  // already held
  CHECK(s.read_ahead(2, 2));
  CHECK_FALSE(s.read_ahead(3, 0));  // every buffer but the first is held
  CHECK(s.reading_ahead(1, 0));
  CHECK_FALSE(s.reading_ahead(3, 0));
  std::vector<float> one(numel(1, 0));
  s.swap_in_tensor(1, 0, one);
  CHECK(one == values(1, 0, static_cast<std::int64_t>(one.size())));
  CHECK(s.read_stats().read_ahead == 1);
  CHECK_FALSE(s.reading_ahead(1, 0));
  CHECK(s.read_ahead(3, 0));  // its buffer is free again
  // A swap_out of group 0 drops group 0's read (its bytes are stale), and only that one.
  std::vector<std::vector<float>> fresh;
  std::vector<std::span<const float>> spans;
  for (std::size_t t = 0; t < 3; ++t) {
    fresh.push_back(values(0, t + 7, static_cast<std::int64_t>(numel(0, t))));
    spans.emplace_back(fresh.back());
  }
  s.swap_out(0, spans);
  CHECK_FALSE(s.reading_ahead(0, 0));
  CHECK(s.reading_ahead(3, 0));
  CHECK(s.read_stats().dropped == 1);
  std::vector<float> zero0(numel(0, 0));
  s.swap_in_tensor(0, 0, zero0);
  CHECK(zero0 == fresh[0]);
  // A pass drops the rest: it needs their buffers, and it changes the groups.
  CHECK(s.read_ahead(0, 0));
  CHECK_THROWS_WITH(s.for_each_group([&](std::size_t g, std::span<const std::span<float>>) {
    if (g == 1) (void)s.read_ahead(4, 0);
  }),
                    Catch::Contains("inside for_each_group"));
  s.for_each_group([](std::size_t g, std::span<const std::span<float>> t) { update(g, t, 1); });
  CHECK(s.read_stats().dropped == 4);  // (0, 0), (2, 2) and (3, 0), by the refused pass
  for (std::size_t g = 0; g < 5; ++g) CHECK_FALSE(s.reading_ahead(g, 0));
  for (std::size_t g : {2u, 3u}) {
    CHECK(s.read_ahead(g, g == 2 ? 2 : 0));
  }
  const auto whole2 = read(s, 2);
  const auto whole3 = read(s, 3);
  std::vector<float> t22(numel(2, 2)), t30(numel(3, 0));
  s.swap_in_tensor(3, 0, t30);
  s.swap_in_tensor(2, 2, t22);
  CHECK(t22 == whole2[2]);
  CHECK(t30 == whole3[0]);
  CHECK(s.read_stats().read_ahead == 3);
  CHECK(s.read_stats().wait_s > 0);
  // One buffer: nothing reads ahead.
  TempDir one_dir("ahead1", zero::testing::direct_io_base());
  NvmeSwapper single(small_config(one_dir.path(), 1), odd_groups(2), opts(backend));
  CHECK(single.read_ahead_capacity() == 0);
  CHECK_FALSE(single.read_ahead(0, 0));
}

TEST_CASE("a reversed pass hands over its last groups' master to swap_in_tensor without a read",
          "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  const int buffers = GENERATE(1, 2, 3, 4);
  const int groups = GENERATE(4, 5, 7);  // every rotation of the buffers
  INFO("engine " << zero::testing::name_of(backend) << ", buffer_count " << buffers << ", "
                 << groups << " groups");
  TempDir dir("handover", zero::testing::direct_io_base());
  // Counts the read requests (a fault that never fires).
  auto reads = std::make_shared<FaultInjector>(~std::uint64_t{0}, EIO, IoOp::read);
  NvmeSwapper s(small_config(dir.path(), buffers), odd_groups(groups), opts(backend, 0, reads));
  fill(s);
  const std::size_t n = static_cast<std::size_t>(groups);
  const std::size_t kept = s.read_ahead_capacity();
  REQUIRE(kept == static_cast<std::size_t>(std::min(buffers, groups) - 1));
  const auto ref = updated_values(groups, 2);  // the same updates in memory
  for (int step = 0; step < 2; ++step) {
    if (step == 1) CHECK(s.reading_ahead(0, 0) == (kept > 0));  // the first pass's hand-over
    std::vector<std::size_t> order;
    SwapPass pass;
    pass.reverse = true;
    pass.hand_over = 0;
    s.for_each_group(pass, [&](std::size_t g, std::span<const std::span<float>> t) {
      order.push_back(g);
      update(g, t, step);
    });
    for (std::size_t j = 0; j < n; ++j) REQUIRE(order[j] == n - 1 - j);
  }
  CHECK(s.read_stats().dropped == static_cast<std::int64_t>(kept));  // by the second pass
  // Groups 0 .. kept - 1 hold their master as read; the rest, and the other tensors, do not.
  for (std::size_t g = 0; g < n; ++g) {
    CHECK(s.reading_ahead(g, 0) == (g < kept));
    CHECK_FALSE(s.reading_ahead(g, 1));
  }
  const std::uint64_t before = reads->seen();
  for (std::size_t g = 0; g < kept; ++g) {
    std::vector<float> master(ref[g][0].size());
    s.swap_in_tensor(g, 0, master);
    REQUIRE(master == ref[g][0]);
  }
  CHECK(reads->seen() == before);  // no request went to the file
  CHECK(s.read_stats().handed_over == static_cast<std::int64_t>(kept));
  CHECK(s.read_stats().read_ahead == 0);
  // The files hold the same values, and a read ahead may take the freed buffers again.
  for (std::size_t g = 0; g < n; ++g) {
    const auto got = read(s, g);
    for (std::size_t t = 0; t < 3; ++t) REQUIRE(got[t] == ref[g][t]);
  }
  if (kept > 0) {
    CHECK(s.read_ahead(n - 1, 0));
    std::vector<float> last(ref[n - 1][0].size());
    s.swap_in_tensor(n - 1, 0, last);
    CHECK(last == ref[n - 1][0]);
    CHECK(s.read_stats().read_ahead == 1);
  }
  // A pass that hands nothing over, or one cut short, leaves nothing held.
  SwapPass read_only;
  read_only.write = false;
  s.for_each_group(read_only, [](std::size_t, std::span<const std::span<float>>) {});
  for (std::size_t g = 0; g < n; ++g) CHECK_FALSE(s.reading_ahead(g, 0));
  SwapPass pass;
  pass.reverse = true;
  pass.hand_over = 0;
  CHECK_THROWS_WITH(s.for_each_group(pass,
                                     [](std::size_t g, std::span<const std::span<float>>) {
                                       if (g == 0) throw Error("stop");
                                     }),
                    Catch::Contains("stop"));
  for (std::size_t g = 0; g < n; ++g) CHECK_FALSE(s.reading_ahead(g, 0));
}

TEST_CASE("a read ahead that fails throws from its swap_in_tensor, as a read then would have",
          "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  INFO("engine " << zero::testing::name_of(backend));
  TempDir dir("aheadfault", zero::testing::direct_io_base());
  // The first read request fails: the read ahead of group 1's master.
  auto faults = std::make_shared<FaultInjector>(0, EIO, IoOp::read);
  NvmeSwapper s(small_config(dir.path(), 3), odd_groups(3), opts(backend, 0, faults));
  fill(s);
  CHECK(s.read_ahead(1, 0));
  std::vector<float> out(static_cast<std::size_t>(s.layout(1).tensors[0].numel));
  CHECK_THROWS_WITH(s.swap_in_tensor(1, 0, out), Catch::Contains(s.file_of(1).string()));
  CHECK(faults->fired() == 1);
  CHECK_FALSE(s.reading_ahead(1, 0));
  s.swap_in_tensor(1, 0, out);  // read again, now it succeeds
  CHECK(out == values(1, 0, static_cast<std::int64_t>(out.size())));
  // A group whose last write failed: its read ahead holds a buffer, reads nothing, and its
  // swap_in_tensor says why, as without the read ahead.
  TempDir dir2("aheadbroken", zero::testing::direct_io_base());
  auto write_fault = std::make_shared<FaultInjector>(0, EIO, IoOp::write);
  NvmeSwapper b(small_config(dir2.path(), 3), odd_groups(2), opts(backend, 0, write_fault));
  std::vector<std::vector<float>> data;
  std::vector<std::span<const float>> spans;
  for (std::size_t t = 0; t < 3; ++t) {
    data.push_back(values(0, t, b.layout(0).tensors[t].numel));
    spans.emplace_back(data.back());
  }
  CHECK_THROWS_AS(b.swap_out(0, spans), NvmeIoError);
  CHECK(b.read_ahead(0, 0));
  std::vector<float> master(data[0].size());
  CHECK_THROWS_WITH(b.swap_in_tensor(0, 0, master), Catch::Contains("incomplete on disk"));
  CHECK_FALSE(b.reading_ahead(0, 0));
  CHECK(b.read_stats().read_ahead == 0);
}

TEST_CASE("I/O faults in a pass raise NvmeIoError and leave other groups intact",
          "[unit][offload]") {
  const auto backend = GENERATE(from_range(zero::testing::backends()));
  const int error = GENERATE(EIO, ENOSPC);
  INFO("engine " << zero::testing::name_of(backend) << ", errno " << error);
  TempDir dir("swapfault", zero::testing::direct_io_base());
  // Fail the first write request of group 2 inside the pass: the writes of fill() and of groups
  // 0 and 1 come before it, one request per started 64 KiB block.
  const auto groups = odd_groups(4);
  const auto requests = [&](std::size_t g) {
    const auto bytes = SwapLayout::plan(groups[g], probe_direct_io(dir.path()).alignment).bytes;
    return (bytes + 65535) / 65536;
  };
  const std::uint64_t nth =
      requests(0) + requests(1) + requests(2) + requests(3) + requests(0) + requests(1);
  auto in_pass = std::make_shared<FaultInjector>(nth, error, IoOp::write);
  NvmeSwapper s3(small_config(dir.path(), 3), groups, opts(backend, 0, in_pass));
  fill(s3);
  CHECK(in_pass->fired() == 0);
  std::vector<std::size_t> seen;
  try {
    s3.for_each_group([&](std::size_t g, std::span<const std::span<float>> t) {
      seen.push_back(g);
      for (auto span : t)
        for (auto& x : span) x += 1.0f;
    });
    FAIL("no error");
  } catch (const NvmeIoError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(e.error_code() == error);
    CHECK(m.find(s3.file_of(2).string()) != std::string::npos);
    CHECK(m.find(std::strerror(error)) != std::string::npos);
  }
  CHECK(in_pass->fired() == 1);
  // Groups 0, 1 and 3 were updated and written back whole (the error surfaces when the pass
  // waits for group 2's write, after group 3 was already under way).
  CHECK(seen == std::vector<std::size_t>{0, 1, 2, 3});
  for (std::size_t g : {0u, 1u, 3u}) {
    const auto got = read(s3, g);
    const float delta = 1.0f;
    for (std::size_t t = 0; t < 3; ++t) {
      auto want = values(g, t, static_cast<std::int64_t>(got[t].size()));
      for (auto& x : want) x += delta;
      REQUIRE(got[t] == want);
    }
  }
  // Group 2's file is incomplete: reading it says so until it is written again.
  CHECK_THROWS_WITH(read(s3, 2), Catch::Contains("incomplete on disk"));
  std::vector<std::vector<float>> fresh;
  std::vector<std::span<const float>> spans;
  for (std::size_t t = 0; t < 3; ++t) fresh.push_back(values(2, t, s3.layout(2).tensors[t].numel));
  for (auto& f : fresh) spans.emplace_back(f);
  s3.swap_out(2, spans);
  CHECK(read(s3, 2)[1] == fresh[1]);
}

TEST_CASE("an exception from the update function drains I/O and propagates", "[unit][offload]") {
  TempDir dir("fnthrow", zero::testing::direct_io_base());
  NvmeSwapper s(small_config(dir.path(), 4), odd_groups(5));
  fill(s);
  CHECK_THROWS_WITH(s.for_each_group([](std::size_t g, std::span<const std::span<float>>) {
    if (g == 2) throw std::runtime_error("optimizer failed");
  }),
                    "optimizer failed");
  CHECK(read(s, 4)[0] == values(4, 0, s.layout(4).tensors[0].numel));
}

TEST_CASE("the swapper removes its files and empty directories", "[unit][offload]") {
  TempDir dir("cleanup", zero::testing::direct_io_base());
  std::filesystem::path file;
  {
    NvmeSwapper s(small_config(dir.path(), 2), odd_groups(2), opts(IoBackend::automatic, 1));
    fill(s);
    file = s.file_of(1);
    CHECK(std::filesystem::file_size(file) == s.layout(1).bytes);
  }
  CHECK(!std::filesystem::exists(file));
  CHECK(!std::filesystem::exists(dir / "zero_swap"));
}

TEST_CASE("swappers of several ranks come and go on one nvme_path without tripping each other",
          "[unit][offload]") {
  // Each swapper removes zero_swap/ and rank<r>/ when it leaves them empty, which used to undo
  // another rank's create_directories before its lock file landed (ENOENT at construction; seen
  // in the engine's estimator test). Four ranks construct and destroy swappers at once.
  TempDir dir("swapper-ranks");
  constexpr int ranks = 4, rounds = 100;
  std::vector<std::string> failures(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        for (int i = 0; i < rounds; ++i) {
          SwapperOptions o;
          o.rank = r;
          NvmeSwapper s(small_config(dir.path(), 1), {{{"master", 1024}}}, o);
        }
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << failures[static_cast<std::size_t>(r)]);
    CHECK(failures[static_cast<std::size_t>(r)].empty());
  }
  CHECK(!std::filesystem::exists(dir.path() / "zero_swap"));  // the last one out tidied up
}

TEST_CASE("a swapper removes the swap files a run that was killed left in its directory",
          "[unit][offload]") {
  // They were kept until this run truncated the ones it reuses: their space counted against the
  // preflight (a restart refused for the space its own stale files held), and the files of
  // groups the new run does not have stayed for good.
  TempDir dir("stale", zero::testing::direct_io_base());
  const auto own = dir.path() / "zero_swap" / "rank0" / "optimizer";
  std::filesystem::create_directories(own);
  zero::testing::write_file(own / "group0.swp", std::string(1 << 20, '\xff'));
  zero::testing::write_file(own / "group7.swp", "stale");
  zero::testing::write_file(own / "notes.txt", "the user's");
  zero::testing::write_file(own / "group1.swp.bak", "the user's");
  {
    NvmeSwapper s(small_config(dir.path(), 2), odd_groups(2));
    CHECK(!std::filesystem::exists(own / "group7.swp"));
    CHECK(std::filesystem::file_size(s.file_of(0)) == s.layout(0).bytes);
    CHECK(read(s, 0)[0] == std::vector<float>(read(s, 0)[0].size(), 0.0f));  // fresh: zeros
    CHECK(std::filesystem::exists(own / "notes.txt"));
    CHECK(std::filesystem::exists(own / "group1.swp.bak"));
  }
  CHECK(!std::filesystem::exists(own / "group0.swp"));
  CHECK(std::filesystem::exists(own / "notes.txt"));  // not a swap file: kept, and so the folder
}

TEST_CASE("a pass called from inside a pass is refused without taking the outer pass's errors",
          "[unit][offload]") {
  // The nested call drained the outer pass's transfers before refusing: a failed read-ahead was
  // consumed there, and the outer pass went on to update a partly read buffer and write it.
  TempDir dir("nested", zero::testing::direct_io_base());
  const auto groups = odd_groups(4);
  const auto alignment = probe_direct_io(dir.path()).alignment;
  const std::uint64_t group0_reads = (SwapLayout::plan(groups[0], alignment).bytes + 65535) / 65536;
  auto faults = std::make_shared<FaultInjector>(group0_reads, EIO, IoOp::read);  // group 1's
  NvmeSwapper s(small_config(dir.path(), 3), groups, opts(IoBackend::automatic, 0, faults));
  fill(s);
  std::string nested;
  CHECK_THROWS_AS(s.for_each_group([&](std::size_t g, std::span<const std::span<float>>) {
    if (g != 0) return;
    try {
      s.for_each_group([](std::size_t, std::span<const std::span<float>>) {});
    } catch (const Error& e) {
      nested = e.what();
    }
  }),
                  NvmeIoError);
  CHECK(faults->fired() == 1);
  CHECK_THAT(nested, Catch::Contains("inside for_each_group"));
}

TEST_CASE("one rank's swappers coming and going never share a directory", "[unit][offload]") {
  // A swapper closing removes its lock file, then lets the lock go: one that had opened the file
  // before it was removed took a lock on a removed file, and a third could take a new one at
  // the same time (two swappers on one set of files), or the second found its directory gone.
  TempDir dir("swapper-lock");
  constexpr int threads_n = 4, rounds = 150;
  std::atomic<int> live{0}, most{0};
  std::vector<std::string> failures(threads_n);
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < rounds; ++i) {
        try {
          NvmeSwapper s(small_config(dir.path(), 1), {{{"master", 1024}}});
          const int now = live.fetch_add(1) + 1;
          int seen = most.load();
          while (now > seen && !most.compare_exchange_weak(seen, now)) {
          }
          std::this_thread::yield();
          live.fetch_sub(1);
        } catch (const ConfigError&) {
          // "in use by another swapper": the honest refusal
        } catch (const std::exception& e) {
          failures[static_cast<std::size_t>(t)] = e.what();
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < threads_n; ++t) {
    INFO("thread " << t << ": " << failures[static_cast<std::size_t>(t)]);
    CHECK(failures[static_cast<std::size_t>(t)].empty());
  }
  CHECK(most.load() == 1);
  CHECK(!std::filesystem::exists(dir.path() / "zero_swap"));
}
