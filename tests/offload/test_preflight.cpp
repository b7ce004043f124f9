// NvmeConfig from DeepSpeed JSON (offload sections and aio, with key-path errors) and the
// preflight's messages: missing or unwritable path, no O_DIRECT, too little space or memory.
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include <catch2/catch.hpp>

#include <zero/offload/nvme_swapper.hpp>
#include <zero/offload/preflight.hpp>

#include "scratch.hpp"

using namespace zero;
using namespace zero::offload;
using zero::testing::TempDir;

TEST_CASE("NvmeConfig reads offload_optimizer, offload_param and aio with DeepSpeed defaults",
          "[unit][offload][config]") {
  const auto cfg = Config::from_json_string(R"({
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": "/other", "buffer_count": 6}},
    "aio": {"block_size": 262144, "queue_depth": 16, "single_submit": true,
            "overlap_events": false, "thread_count": 2}})");
  const auto o = NvmeConfig::from_config(cfg);
  CHECK(o.nvme_path == "/local_nvme");
  CHECK(o.buffer_count == 4);  // DeepSpeed's optimizer default
  CHECK(o.pin_memory);
  CHECK(o.block_size == 262144);
  CHECK(o.queue_depth == 16);
  CHECK(o.thread_count == 2);
  CHECK(o.single_submit);
  CHECK(!o.overlap_events);
  const auto p = NvmeConfig::from_config(cfg, OffloadSection::param);
  CHECK(p.nvme_path == "/other");
  CHECK(p.buffer_count == 6);

  const auto d = Config::from_json_string(R"({"zero_optimization": {"stage": 2,
      "sub_group_size": 2e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}})");
  const auto dn = NvmeConfig::from_config(d);
  CHECK(dn.block_size == 1'048'576);
  CHECK(dn.queue_depth == 8);
  CHECK(dn.thread_count == 1);
  CHECK(!dn.single_submit);
  CHECK(dn.overlap_events);
  CHECK(d.warnings.empty());
}

TEST_CASE("bad NVMe and aio values name the key path", "[unit][offload][config]") {
  auto error_of = [](const std::string& json) {
    try {
      const auto c = Config::from_json_string(json);
      (void)NvmeConfig::from_config(c);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // The error of an NVMe config with the "aio" section aio.
  const auto aio_error_of = [&](const std::string& aio) {
    return error_of(
        R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "aio": )" +
        aio + "}");
  };
  const std::pair<const char*, const char*> bad_aio[] = {
      {R"({"block_size": 1000})", "aio.block_size: 1000 must be a positive multiple of 512"},
      {R"({"queue_depth": 0})", "aio.queue_depth: 0 must be in [1, 4096]"},
      {R"({"single_submit": "yes"})", "aio.single_submit: expected true or false"},
      {R"({"use_gds": true})", "aio.use_gds"},
      // More than Linux moves in one request (io_uring's length is 32 bits): every request
      // came back short, or with 4 GiB as 0 bytes.
      {R"({"block_size": 4294967296})", "aio.block_size: 4294967296 is more than 1 GiB"},
      // A bad thread count is named by the spelling the config used.
      {R"({"thread_count": 0})", "aio.thread_count: 0 must be in [1, 256]"},
      {R"({"intra_op_parallelism": 0})", "aio.intra_op_parallelism: 0 must be in [1, 256]"},
      {R"({"thread_count": 2, "intra_op_parallelism": 0})", "aio.intra_op_parallelism: 0"},
  };
  for (const auto& [aio, message] : bad_aio) {
    INFO(aio);
    CHECK_THAT(aio_error_of(aio), Catch::Contains(message));
  }
  CHECK(aio_error_of(R"({"block_size": 1073741824})") == "no error");
  CHECK_THAT(
      error_of(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})"),
      Catch::Contains("zero_optimization.offload_optimizer.device: is 'cpu'"));
  CHECK_THAT(
      error_of(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})"),
      Catch::Contains("zero_optimization.offload_optimizer.nvme_path: required"));
  CHECK_THAT(
      error_of(
          R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 0}}})"),
      Catch::Contains("zero_optimization.offload_optimizer.buffer_count: 0 must be positive"));
  IoOptions too_large;
  too_large.block_size = std::size_t{2} << 30;
  CHECK_THROWS_WITH(make_file_io(too_large, IoBackend::posix), Catch::Contains("at most 1 GiB"));
  const auto w = Config::from_json_string(R"({"aio": {"blok_size": 4096}})");
  REQUIRE(w.warnings.size() == 1);
  CHECK_THAT(w.warnings[0], Catch::Contains("aio.blok_size"));
}

TEST_CASE("preflight passes on a good directory and says what to change otherwise",
          "[unit][offload]") {
  TempDir dir("preflight", zero::testing::direct_io_base());
  NvmeConfig cfg;
  cfg.nvme_path = dir.path();
  const auto ok = preflight(cfg, {1 << 20, 1 << 20});
  CHECK(ok.ok());
  CHECK(ok.direct.supported);
  CHECK(ok.free_bytes > (1u << 20));

  SECTION("missing path") {
    cfg.nvme_path = dir / "nope";
    const auto r = preflight(cfg, {});
    REQUIRE(!r.ok());
    CHECK_THAT(r.summary(), Catch::Contains("does not exist: create it"));
    CHECK_THROWS_WITH(require_preflight(cfg, {}), Catch::Contains("preflight failed"));
  }
  SECTION("a file, not a directory") {
    zero::testing::write_file(dir / "file", "x");
    cfg.nvme_path = dir / "file";
    CHECK_THAT(preflight(cfg, {}).summary(), Catch::Contains("is not a directory"));
  }
  SECTION("not enough space and too little memory, both reported") {
    cfg.host_budget_bytes = 1 << 20;
    const auto r = preflight(cfg, {ok.free_bytes * 2, 8u << 20});
    REQUIRE(r.problems.size() == 2);
    CHECK_THAT(r.summary(), Catch::Contains("free but the swap files need"));
    CHECK_THAT(r.summary(), Catch::Contains("lower offload_*.buffer_count, make the largest"));
    // The swapper runs the preflight before creating anything.
    CHECK_THROWS_WITH(NvmeSwapper(cfg, {{{"master", 4'000'000}}}),
                      Catch::Contains("buffer_count 4 x the largest sub-group"));
    CHECK(!std::filesystem::exists(dir / "zero_swap"));
  }
  SECTION("the default budget is shared by the ranks the launcher put on this host") {
    // Each rank checked its own buffers against half the memory: four ranks passed with two
    // memories' worth between them.
    const std::uint64_t whole = default_host_budget_bytes(1);
    CHECK(default_host_budget_bytes(4) == whole / 4);
    const std::uint64_t buffers = whole * 3 / 5;  // 0.3 of the physical memory
    CHECK(preflight(cfg, {1 << 20, buffers}).ok());
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "4", 1);
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("LOCAL_WORLD_SIZE", "4", 1);
    const auto shared = preflight(cfg, {1 << 20, buffers});
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) ::unsetenv(v);
    CHECK(shared.budget_bytes == whole / 4);
    CHECK_THAT(shared.summary(), Catch::Contains("swap buffers need") &&
                                     Catch::Contains("over the 4 ranks on this host"));
    cfg.host_budget_bytes = buffers;  // a budget given is this rank's own
    CHECK(preflight(cfg, {1 << 20, buffers}).ok());
  }
  SECTION("a read-only directory") {
    if (::geteuid() == 0) {
      WARN("skipped the read-only case: root writes anywhere");
      return;
    }
    std::filesystem::create_directory(dir / "ro");
    ::chmod((dir / "ro").c_str(), 0500);
    cfg.nvme_path = dir / "ro";
    CHECK_THAT(preflight(cfg, {}).summary(), Catch::Contains("not writable"));
  }
}

TEST_CASE("preflight on a small tmpfs reports the space and, where refused, O_DIRECT",
          "[unit][offload]") {
  zero::testing::TmpfsMount fs("1m");
  if (!fs.mounted()) {
    WARN("skipped: cannot mount a tmpfs here (" << fs.why() << ")");
    return;
  }
  NvmeConfig cfg;
  cfg.nvme_path = fs.path();
  const auto r = preflight(cfg, {8u << 20, 1u << 20});
  CHECK(r.direct.fs_type == "tmpfs");
  CHECK_THAT(r.summary(), Catch::Contains("free but the swap files need 8.00 MiB"));
  if (!r.direct.supported)  // tmpfs before Linux 6.6
    CHECK_THAT(r.summary(), Catch::Contains("does not support O_DIRECT"));
  // The swapper refuses to start instead of failing mid-training.
  CHECK_THROWS_AS(NvmeSwapper(cfg, {{{"master", 2'000'000}}}), ConfigError);
}

TEST_CASE("the O_DIRECT advice names the file system and the alternatives", "[unit][offload]") {
  DirectIoSupport d;
  d.fs_type = "tmpfs";
  d.reason = "open with O_DIRECT failed: Invalid argument";
  const auto m = direct_io_advice("/dev/shm/x", d);
  CHECK_THAT(m, Catch::Contains("'/dev/shm/x' (tmpfs) does not support O_DIRECT"));
  CHECK_THAT(m, Catch::Contains("\"device\": \"cpu\""));
}
