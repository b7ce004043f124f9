// Offload<NVMe> with Compute<Host>: the optimizer states live in files (io_uring + O_DIRECT, or
// pread/pwrite where io_uring is missing) and stream through the swapper's buffers at each step.
// After several steps the parameters equal those of the same run without offload, bit for bit,
// at stages 1-3 and world sizes 1, 2 and 4; the states' memory is gone from memory_report(); a
// checkpoint saved from an offloading engine resumes in a plain one and back.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>

#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;

namespace {

Config offload_config(int stage, const std::filesystem::path& nvme, double lr = 0.001) {
  Config c = adamw_config(stage, 1, 1.0);
  c.optimizer->params["lr"] = {lr};
  if (!nvme.empty()) {
    c.zero_optimization.offload_optimizer.device = config::OffloadDevice::nvme;
    c.zero_optimization.offload_optimizer.nvme_path = nvme.string();
    c.zero_optimization.offload_optimizer.buffer_count = 2;
  }
  return c;
}

struct Result {
  std::vector<float> params;
  engine::MemoryReport report;
};

template <int S, class... Extra>
Result train(int world, const Config& cfg, int steps, const std::filesystem::path& ckpt = {},
             bool save = false, int first_step = 0) {
  Result out;
  LocalComm::run(world, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    engine::Engine<nn::GPT<float>, ZeroStage<S>, Extra...> eng(model, comm, cfg, options);
    if (!ckpt.empty() && !save) eng.load_checkpoint(ckpt);
    for (int step = first_step; step < steps; ++step) {
      const GlobalBatch b(micro_rows * world, step, tiny().vocab_size);
      eng.forward(b.micro(0, comm.rank(), world));
      eng.backward();
      eng.step();
    }
    if (save) eng.save_checkpoint(ckpt, "t");
    std::vector<float> mine;
    for (int u = 0; u < eng.units(); ++u) {
      const auto v = eng.gather_unit_values(u);
      mine.insert(mine.end(), v.begin(), v.end());
    }
    if (comm.rank() == 0) {
      out.params = mine;
      out.report = eng.memory_report();
    }
  });
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <int S>
void check_stage(const std::filesystem::path& nvme) {
  for (int world : {1, 2, 4}) {
    INFO("stage " << S << " world " << world);
    const auto plain = train<S>(world, offload_config(S, {}), 3);
    const auto offloaded = train<S, Offload<NVMe>>(world, offload_config(S, nvme), 3);
    CHECK(same_bits(plain.params, offloaded.params));
    CHECK(offloaded.report.optimizer_bytes == 0);
    CHECK(offloaded.report.offloaded_bytes >= plain.report.optimizer_bytes);
    const auto wrong = train<S, Offload<NVMe>>(world, offload_config(S, nvme, 0.002), 3);
    CHECK_FALSE(same_bits(plain.params, wrong.params));  // negative control
  }
}

}  // namespace

TEST_CASE("Offload<NVMe> trains exactly like no offload at stages 1-3 and 1, 2, 4 ranks",
          "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme", "/var/tmp");
  check_stage<1>(nvme.path());
  check_stage<2>(nvme.path());
  check_stage<3>(nvme.path());
  // Every swap file is removed with its engine.
  const auto swap = nvme.path() / "zero_swap";
  const bool clean = !std::filesystem::exists(swap) ||
                     std::filesystem::recursive_directory_iterator(swap) ==
                         std::filesystem::recursive_directory_iterator() ||
                     std::none_of(std::filesystem::recursive_directory_iterator(swap),
                                  std::filesystem::recursive_directory_iterator(),
                                  [](const auto& e) { return e.is_regular_file(); });
  CHECK(clean);
}

TEST_CASE("checkpoints move between offloading and plain engines", "[unit][engine][offload]") {
  zero::testing::TempDir nvme("engine-nvme-ckpt", "/var/tmp");
  const auto ckpt = nvme.path() / "ckpt";
  const auto uninterrupted = train<3>(2, offload_config(3, {}), 4);
  train<3, Offload<NVMe>>(2, offload_config(3, nvme.path()), 2, ckpt, true);
  const auto resumed_plain = train<2>(2, offload_config(2, {}), 4, ckpt, false, 2);
  CHECK(std::ranges::equal(resumed_plain.params, uninterrupted.params,
                           [](float a, float b) { return std::abs(a - b) < 2e-5f; }));
  train<1>(2, offload_config(1, {}), 2, ckpt, true);
  const auto resumed_nvme = train<3, Offload<NVMe>>(2, offload_config(3, nvme.path()), 4, ckpt,
                                                    false, 2);
  CHECK(std::ranges::equal(resumed_nvme.params, uninterrupted.params,
                           [](float a, float b) { return std::abs(a - b) < 2e-5f; }));
}
