// Soak ([slow]): 5,000 small stage-3 steps on 2 LocalComm ranks with a checkpoint every 500.
// After a warm-up, the activation arena's high-water mark, every category of the memory report
// (master, optimizer, accumulators, gathered parameters, the exchange's scratch pool) and the
// number of open file descriptors must stay exactly where they were: a leak of buffers, pool
// entries or checkpoint file handles over thousands of steps shows up here.
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

constexpr int soak_steps = 5000;
constexpr int checkpoint_every = 500;

// Resident set size of this process in KiB (VmRSS), or 0 where /proc does not say.
std::size_t rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  std::size_t value = 0;
  while (status >> key) {
    if (key == "VmRSS:") {
      status >> value;
      return value;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

// Open file descriptors of this process.
std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n;
}

// What one rank saw at each checkpoint.
struct Sample {
  int step = 0;
  std::size_t arena_peak = 0;
  engine::MemoryReport memory;
  std::size_t fds = 0;      // rank 0 only: the count is the process's
  std::size_t rss_kib = 0;  // rank 0 only
  float loss = 0;
};

bool same_memory(const engine::MemoryReport& a, const engine::MemoryReport& b) {
  return a.master_bytes == b.master_bytes && a.optimizer_bytes == b.optimizer_bytes &&
         a.grad_accumulator_bytes == b.grad_accumulator_bytes &&
         a.whole_param_bytes == b.whole_param_bytes && a.whole_grad_bytes == b.whole_grad_bytes &&
         a.secondary_param_bytes == b.secondary_param_bytes && a.scratch_bytes == b.scratch_bytes &&
         a.offloaded_bytes == b.offloaded_bytes;
}

}  // namespace

TEST_CASE("soak: 5,000 stage-3 steps with checkpoints keep memory and file descriptors flat",
          "[slow][engine]") {
  testing::TempDir dir("soak");
  const auto samples = testing::per_rank<std::vector<Sample>>(2, [&](parallel::LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(model, comm, adamw_config(3, 1, 1.0), options);
    std::vector<Sample> out;
    for (int step = 1; step <= soak_steps; ++step) {
      const GlobalBatch b(micro_rows * 2, step % 7, tiny().vocab_size);
      const float loss = eng.forward(b.micro(0, comm.rank(), 2));
      eng.backward();
      eng.step();
      if (step % checkpoint_every != 0) continue;
      // Keep only the newest checkpoint, as a training script rotating them would.
      eng.save_checkpoint(dir.path(), "step" + std::to_string(step));
      comm.barrier();
      if (comm.rank() == 0 && step > checkpoint_every) {
        std::filesystem::remove_all(dir.path() /
                                    ("step" + std::to_string(step - checkpoint_every)));
      }
      eng.synchronize();
      Sample s;
      s.step = step;
      s.arena_peak = eng.activation_peak_bytes();
      s.memory = eng.memory_report();
      s.loss = loss;
      if (comm.rank() == 0) {  // both ranks are between steps: no save has a file open
        s.fds = open_fds();
        s.rss_kib = rss_kib();
      }
      comm.barrier();
      out.push_back(s);
    }
    return out;
  });
  for (const auto& rank : samples) {
    REQUIRE(rank.size() == static_cast<std::size_t>(soak_steps / checkpoint_every));
    const Sample& warm = rank.front();  // after 500 steps and one checkpoint
    for (const Sample& s : rank) {
      INFO("step " << s.step << ": arena peak " << s.arena_peak << " (warm " << warm.arena_peak
                   << "), memory " << s.memory.total() << " (warm " << warm.memory.total()
                   << "), scratch " << s.memory.scratch_bytes << ", fds " << s.fds << " (warm "
                   << warm.fds << ")");
      CHECK(s.arena_peak == warm.arena_peak);
      CHECK(same_memory(s.memory, warm.memory));
      CHECK(s.fds == warm.fds);
    }
    // It trained: the loss on the repeating batches came down.
    CHECK(rank.back().loss < rank.front().loss);
  }
  // The heap may settle for a while, but a leak of even 4 KiB a step would add 18 MiB here.
  const auto& r0 = samples[0];
  const std::size_t settled = r0[1].rss_kib, last = r0.back().rss_kib;
  INFO("RSS " << settled << " KiB at step " << r0[1].step << ", " << last << " KiB at the end");
  CHECK(last < settled + 8 * 1024);
  std::printf(
      "soak: arena peak %zu B, model state %zu B, scratch %zu B, %zu fds, RSS %zu -> %zu KiB\n",
      r0.back().arena_peak, r0.back().memory.total(), r0.back().memory.scratch_bytes, r0.back().fds,
      settled, last);
}
