// Checkpoints over MpiComm (run under mpiexec with 2 and 4 processes): a save by all processes
// with a random segmentation loads in every process, which reads its own share and random
// ranges bitwise; a sub-communicator of half the processes loads it too; a save that fails on
// one process fails with the same error on all of them (no process is left in a collective).
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>

#include "checkpoint_test_util.hpp"

using namespace zero;
using namespace zero::checkpoint;
using namespace zero::checkpoint::testing;
using zero::parallel::MpiComm;

namespace {

/// A directory every process agrees on (rank 0 names it), removed at the end of the scope.
struct SharedDir {
  MpiComm& comm;
  std::filesystem::path path;
  explicit SharedDir(MpiComm& c) : comm(c) {
    std::string name;
    if (comm.rank() == 0) {
      name =
          (std::filesystem::temp_directory_path() / ("zero-ckpt-mpi-" + std::to_string(::getpid())))
              .string();
    }
    path = parallel::broadcast_text(comm, name, 0);
  }
  ~SharedDir() {
    comm.barrier();
    std::error_code ignored;
    if (comm.rank() == 0) std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

TEST_CASE("MpiComm: a checkpoint saved by every process loads everywhere, bitwise", "[mpi]") {
  auto world = MpiComm::world();
  SharedDir dir(world);
  const auto tensors = make_tensors(8, 11);
  const auto pieces = random_segmentation(tensors, world.size(), 77);
  const SaveResult saved = save_pieces(world, dir.path, "step-1", tensors,
                                       pieces[static_cast<std::size_t>(world.rank())],
                                       {{"step", 1}, {"world", world.size()}});
  CHECK(saved.total_bytes > 0);

  const Reader reader = load(world, dir.path);
  CHECK(reader.tag() == "step-1");
  CHECK(reader.saved_world_size() == world.size());
  std::mt19937 rng(static_cast<std::uint32_t>(world.rank()));
  for (const auto& t : tensors) {
    const std::int64_t numel = t.spec.numel();
    const std::int64_t share = (numel + world.size() - 1) / world.size();
    const std::int64_t a = std::min(numel, share * world.rank()), b = std::min(numel, a + share);
    CHECK(same_bytes(t, a, read_bytes(reader, t, a, b - a)));
    const std::int64_t x = std::uniform_int_distribution<std::int64_t>(0, numel)(rng);
    const std::int64_t y = std::uniform_int_distribution<std::int64_t>(0, numel)(rng);
    const std::int64_t lo = std::min(x, y), hi = std::max(x, y);
    CHECK(same_bytes(t, lo, read_bytes(reader, t, lo, hi - lo)));
  }

  // Half the processes (another "world size") load it through their own communicator.
  MpiComm half = world.split(world.rank() % 2, world.rank());
  const Reader again = load(half, dir.path, "step-1");
  for (const auto& t : tensors) CHECK(same_bytes(t, 0, read_bytes(again, t, 0, t.spec.numel())));
}

TEST_CASE("MpiComm: a save failing on one process fails on all with the same error", "[mpi]") {
  auto world = MpiComm::world();
  SharedDir dir(world);
  const auto tensors = make_tensors(0);
  auto pieces = random_segmentation(tensors, world.size(), 5);
  if (world.rank() == world.size() - 1) pieces.back().push_back({2, 13, 1});  // past the end
  std::string error;
  try {
    save_pieces(world, dir.path, "bad", tensors, pieces[static_cast<std::size_t>(world.rank())],
                {});
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::Contains("rank " + std::to_string(world.size() - 1)) &&
                        Catch::Contains("outside"));
  const auto all = parallel::all_gather_text(world, error);
  for (const auto& e : all) CHECK(e == error);
  CHECK(list_tags(dir.path).empty());
}
