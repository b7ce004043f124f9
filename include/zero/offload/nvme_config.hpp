#pragma once
// NvmeConfig: every knob of NVMe offload in one struct, with DeepSpeed's defaults, built from a
// DeepSpeed config's zero_optimization.offload_optimizer / offload_param and aio sections.
//
// zero_optimization.sub_group_size is not one of them: a swapper's sub-group is what its owner
// hands it (the engine: one unit's master slice and states), so the buffers (buffer_count x the
// largest sub-group) shrink with smaller units, and the preflight says when they do not fit.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include <zero/config.hpp>
#include <zero/core/error.hpp>
#include <zero/offload/file_io.hpp>

namespace zero::offload {

/// Which DeepSpeed offload section (offload_optimizer or offload_param) a swapper is configured
/// from; where the state goes is an OffloadDevice.
enum class OffloadSection : unsigned char { optimizer, param };

/// The config section name ("offload_optimizer" or "offload_param").
constexpr const char* section_of(OffloadSection s) {
  return s == OffloadSection::optimizer ? "offload_optimizer" : "offload_param";
}

/// NVMe offload settings.
struct NvmeConfig {
  std::filesystem::path nvme_path;   ///< offload_*.nvme_path: swap files go under it
  int buffer_count = 4;              ///< offload_*.buffer_count: sub-group buffers (4 / 5 in DS)
  bool pin_memory = false;           ///< offload_*.pin_memory: mlock the buffers
  std::size_t block_size = 1 << 20;  ///< aio.block_size: bytes per request
  int queue_depth = 8;               ///< aio.queue_depth: requests in flight
  int thread_count = 1;              ///< aio.intra_op_parallelism: fallback worker threads
  bool single_submit = false;        ///< aio.single_submit
  bool overlap_events = true;        ///< aio.overlap_events
  bool direct_io = true;             ///< O_DIRECT (off only for tests on file systems without it)
  std::uint64_t host_budget_bytes = 0;  ///< cap on swap buffers; 0 = half the physical RAM

  /// The file-I/O options these settings give.
  IoOptions io_options() const {
    IoOptions o;
    o.block_size = block_size;
    o.queue_depth = queue_depth;
    o.thread_count = thread_count;
    o.single_submit = single_submit;
    o.overlap_events = overlap_events;
    return o;
  }

  /// Reads cfg's offload section (optimizer or param; its device must be "nvme") and its aio
  /// section; throws ConfigError naming the key path otherwise.
  static NvmeConfig from_config(const Config& cfg,
                                OffloadSection section = OffloadSection::optimizer) {
    const auto& z = cfg.zero_optimization;
    const auto& o = section == OffloadSection::optimizer ? z.offload_optimizer : z.offload_param;
    const std::string where = std::string("zero_optimization.") + section_of(section);
    expect<ConfigError>(o.device == OffloadDevice::nvme, where, ".device: is '", name_of(o.device),
                        "', NVMe offload needs \"nvme\"");
    expect<ConfigError>(!o.nvme_path.empty(), where, ".nvme_path: required when device is nvme");
    expect<ConfigError>(o.buffer_count >= 1 && o.buffer_count <= 64, where,
                        ".buffer_count: ", o.buffer_count, " must be in [1, 64]");
    NvmeConfig c;
    c.nvme_path = o.nvme_path;
    c.buffer_count = static_cast<int>(o.buffer_count);
    c.pin_memory = o.pin_memory;
    c.block_size = static_cast<std::size_t>(cfg.aio.block_size);
    c.queue_depth = static_cast<int>(cfg.aio.queue_depth);
    c.thread_count = static_cast<int>(cfg.aio.thread_count);
    c.single_submit = cfg.aio.single_submit;
    c.overlap_events = cfg.aio.overlap_events;
    return c;
  }
};

}  // namespace zero::offload
