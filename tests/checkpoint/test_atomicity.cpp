// Atomicity under SIGKILL: a forked child saves checkpoints in a loop (2 LocalComm ranks, new
// tags and one tag replaced over and over) and the parent kills it after a random short delay,
// 20 times. After every kill, `latest` and every complete tag must load and verify fully, with
// data that match the version its engine state names: the previous complete save or the new
// one, never a partial one. (A killed process leaves its written pages in the page cache, so
// this tests crash atomicity of the protocol, not power loss; fsync covers the latter.)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>

#include "../support/temp_dir.hpp"
#include "checkpoint_test_util.hpp"

using namespace zero;
using namespace zero::checkpoint;
using namespace zero::checkpoint::testing;
using zero::parallel::LocalComm;
using zero::testing::TempDir;

namespace {

constexpr std::int64_t scale = 2000;  // ~4.6 MB per checkpoint: a save takes a few ms

/// Saves version v under tag step-v and under the replaced tag "rolling", forever.
[[noreturn]] void child_save_loop(const std::filesystem::path& dir, std::uint64_t first) {
  try {
    for (std::uint64_t v = first;; ++v) {
      const auto tensors = make_tensors(v, scale);
      const nlohmann::json engine = {{"version", v}};
      save_with_ranks(2, dir, "step-" + std::to_string(v), tensors, static_cast<std::uint32_t>(v),
                      engine);
      save_with_ranks(2, dir, "rolling", tensors, static_cast<std::uint32_t>(v + 1), engine);
    }
  } catch (...) {
    std::_Exit(3);
  }
}

/// The version a tag holds after checking that it loads completely and its data equal the
/// version its engine state names; -1 and a description in problem otherwise.
std::int64_t check_tag(const std::filesystem::path& dir, const std::string& tag,
                       std::string& problem) {
  try {
    const Reader reader(dir, tag);
    const auto v = reader.engine_state().at("version").get<std::uint64_t>();
    for (const auto& t : make_tensors(v, scale)) {
      if (!same_bytes(t, 0, read_bytes(reader, t, 0, t.spec.numel()))) {
        problem = tag + ": tensor " + t.spec.name + " differs from version " + std::to_string(v);
        return -1;
      }
    }
    return static_cast<std::int64_t>(v);
  } catch (const std::exception& e) {
    problem = tag + ": " + e.what();
    return -1;
  }
}

}  // namespace

TEST_CASE("a save killed at a random point leaves the previous or the new checkpoint", "[unit]") {
  TempDir dir("ckpt-kill");
  save_with_ranks(2, dir.path(), "step-0", make_tensors(0, scale), 0, {{"version", 0}});
  std::mt19937 rng(20261123);
  int interrupted = 0;
  std::uint64_t next_version = 1;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 20; ++round) {
    const auto delay =
        std::chrono::microseconds(std::uniform_int_distribution<int>(500, 25000)(rng));
    const pid_t child = ::fork();
    if (child == 0) child_save_loop(dir.path(), next_version);
    REQUIRE(child > 0);
    std::this_thread::sleep_for(delay);  // the randomised kill point, not a wait for the child
    ::kill(child, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    INFO("round " << round << ", killed after " << delay.count() << " us");
    REQUIRE(WIFSIGNALED(status));  // it was still saving: exited neither normally nor by error

    bool temp_left = false;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      temp_left |= e.path().filename().string().find(temp_marker) != std::string::npos;
    }
    interrupted += temp_left ? 1 : 0;
    std::string problem;
    std::int64_t newest = -1;
    for (const std::string& tag : list_tags(dir.path())) {
      const std::int64_t v = check_tag(dir.path(), tag, problem);
      CHECK(problem == "");
      newest = std::max(newest, v);
    }
    // `latest` is the newest complete save or the one before it (killed before `latest` moved).
    const std::string latest = read_latest(dir.path());
    const std::int64_t latest_version = check_tag(dir.path(), latest, problem);
    CHECK(problem == "");
    CHECK(latest_version >= newest - 1);
    // Keep the directory small: only what `latest` names and the newest step stay.
    for (const std::string& tag : list_tags(dir.path())) {
      if (tag != latest && tag != "rolling" && tag != "step-" + std::to_string(newest)) {
        std::filesystem::remove_all(dir.path() / tag);
      }
    }
    next_version = static_cast<std::uint64_t>(newest) + 1;  // the next child goes on from there
  }
  // The kills did land inside saves (a save's temporary directory was left behind).
  CHECK(interrupted > 0);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}
