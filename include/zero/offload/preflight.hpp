#pragma once
// Preflight for NVMe offload: before any training step, check that nvme_path exists and is
// writable, that its file system accepts O_DIRECT, that it has room for every swap file
// (statvfs) and that the swap buffers fit the host budget (and RLIMIT_MEMLOCK with pin_memory).
// Each problem comes with what to change; require_preflight throws them all at once.

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include <parallel/launch_env.hpp>
#include <zero/core/error.hpp>
#include <zero/offload/direct_io.hpp>
#include <zero/offload/nvme_config.hpp>

namespace zero::offload {

/// What a swapper will use.
struct PreflightNeeds {
  std::uint64_t swap_bytes = 0;    ///< bytes of swap files on nvme_path
  std::uint64_t buffer_bytes = 0;  ///< bytes of host swap buffers
};

/// The outcome of preflight.
struct PreflightReport {
  std::vector<std::string> problems;  ///< empty when everything is fine
  DirectIoSupport direct;             ///< what the probe found
  std::uint64_t free_bytes = 0;       ///< available to this user on nvme_path
  std::uint64_t budget_bytes = 0;     ///< host budget for swap buffers
  /// True when there are no problems.
  bool ok() const { return problems.empty(); }
  /// All problems, one per line.
  std::string summary() const {
    std::string s;
    for (const auto& p : problems) s += (s.empty() ? "" : "\n") + p;
    return s;
  }
};

/// Bytes as "12.3 GiB".
inline std::string human_bytes(std::uint64_t bytes) {
  char text[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(text, sizeof text, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else
    std::snprintf(text, sizeof text, "%.2f MiB", b / (1024.0 * 1024));
  return text;
}

/// The ranks the launcher started on this host (parallel::launch_env's local size; 1 when no
/// launcher says, or its variables do not parse).
inline int ranks_on_this_host() {
  try {
    const auto env = parallel::launch_env();
    return env ? std::max(1, env->local_size) : 1;
  } catch (const std::exception&) {
    return 1;
  }
}

/// The default host budget for one rank's swap buffers: half the physical memory, shared by the
/// ranks on this host (each checks only its own buffers, and together they must fit).
inline std::uint64_t default_host_budget_bytes(int ranks_on_host = ranks_on_this_host()) {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) / 2 /
         static_cast<std::uint64_t>(std::max(1, ranks_on_host));
}

/// The advice for a path without O_DIRECT.
inline std::string direct_io_advice(const std::filesystem::path& path, const DirectIoSupport& d) {
  return zero::detail::concat(
      "nvme_path '", path.string(), "' (", d.fs_type, ") does not support O_DIRECT: ", d.reason,
      ". tmpfs before Linux 6.6, overlayfs and many network/FUSE file systems refuse direct I/O; "
      "set zero_optimization.offload_*.nvme_path to a directory on a local NVMe drive (ext4, "
      "xfs), or use \"device\": \"cpu\" to offload to host memory instead");
}

/// Checks cfg against needs; never throws for a problem it can describe.
inline PreflightReport preflight(const NvmeConfig& cfg, const PreflightNeeds& needs) {
  namespace fs = std::filesystem;
  PreflightReport r;
  const fs::path& p = cfg.nvme_path;
  const int host_ranks = cfg.host_budget_bytes != 0 ? 1 : ranks_on_this_host();
  r.budget_bytes =
      cfg.host_budget_bytes != 0 ? cfg.host_budget_bytes : default_host_budget_bytes(host_ranks);
  if (needs.buffer_bytes > r.budget_bytes)
    r.problems.push_back(zero::detail::concat(
        "swap buffers need ", human_bytes(needs.buffer_bytes), " of host memory (buffer_count ",
        cfg.buffer_count, " x the largest sub-group) but the budget is ",
        human_bytes(r.budget_bytes),
        host_ranks > 1 ? zero::detail::concat(" (half the physical memory over the ", host_ranks,
                                              " ranks on this host)")
                       : std::string(),
        ": lower offload_*.buffer_count, make the largest "
        "sub-group smaller (the engine's is one unit's shard: wrap smaller modules as units, or "
        "shard over more ranks) or raise the host budget"));
  if (cfg.pin_memory) {
    struct rlimit lim {};
    if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        lim.rlim_cur < needs.buffer_bytes)
      r.problems.push_back(zero::detail::concat(
          "pin_memory is true but RLIMIT_MEMLOCK (ulimit -l) is ", human_bytes(lim.rlim_cur),
          ", less than the ", human_bytes(needs.buffer_bytes),
          " of swap buffers: raise it (ulimit -l unlimited, or memlock in "
          "/etc/security/limits.conf) or set offload_*.pin_memory to false"));
  }
  std::error_code ec;
  if (p.empty()) {
    r.problems.push_back(
        "offload_*.nvme_path is empty: set it to a directory on a local NVMe drive");
    return r;
  }
  if (!fs::exists(p, ec)) {
    r.problems.push_back(zero::detail::concat("nvme_path '", p.string(),
                                              "' does not exist: create it (mkdir -p) or set "
                                              "zero_optimization.offload_*.nvme_path"));
    return r;
  }
  if (!fs::is_directory(p, ec)) {
    r.problems.push_back(zero::detail::concat("nvme_path '", p.string(), "' is not a directory"));
    return r;
  }
  if (::access(p.c_str(), W_OK | X_OK) != 0) {
    r.problems.push_back(zero::detail::concat("nvme_path '", p.string(),
                                              "' is not writable by this user: fix its "
                                              "permissions or choose another directory"));
    return r;
  }
  if (cfg.direct_io) {
    r.direct = probe_direct_io(p);
    if (!r.direct.supported) r.problems.push_back(direct_io_advice(p, r.direct));
  }
  struct statvfs vfs {};
  if (::statvfs(p.c_str(), &vfs) == 0) {
    r.free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (r.free_bytes < needs.swap_bytes)
      r.problems.push_back(zero::detail::concat("nvme_path '", p.string(), "' has ",
                                                human_bytes(r.free_bytes),
                                                " free but the swap "
                                                "files need ",
                                                human_bytes(needs.swap_bytes),
                                                ": free space there or point "
                                                "offload_*.nvme_path at a larger drive"));
  }
  return r;
}

/// preflight, throwing ConfigError with every problem when there is any.
inline PreflightReport require_preflight(const NvmeConfig& cfg, const PreflightNeeds& needs) {
  PreflightReport r = preflight(cfg, needs);
  expect<ConfigError>(r.ok(), "NVMe offload preflight failed:\n", r.summary());
  return r;
}

}  // namespace zero::offload
