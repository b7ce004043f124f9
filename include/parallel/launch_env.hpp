#pragma once
// LaunchEnv: this process's rank, world size, local rank and local size as the launcher that
// started it says, read from the environment: OpenMPI (mpirun, zero-launch's default), MPICH /
// Hydra (mpiexec), Slurm (srun), or torchrun-style variables. A program uses it to tell whether
// it was launched as one of many ranks (then it builds an MpiComm) and to pick its device by
// local rank before MPI is initialised. The first launcher whose variables are all present wins.

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include <zero/core/error.hpp>

namespace zero::parallel {

/// Where this process sits among the ranks of a launch.
struct LaunchEnv {
  int rank = 0;          ///< in the whole launch
  int size = 1;          ///< ranks in the launch
  int local_rank = 0;    ///< among the ranks on this host
  int local_size = 1;    ///< ranks on this host
  std::string launcher;  ///< "openmpi", "mpich", "slurm" or "torchrun"
};

/// Reads the launch from getenv (std::getenv by default; tests pass a map); empty when no
/// launcher's variables are set. Throws ConfigError naming the variable when one is not a
/// non-negative integer or the numbers contradict each other.
inline std::optional<LaunchEnv> launch_env(const std::function<const char*(const char*)>& getenv =
                                               [](const char* name) { return std::getenv(name); }) {
  struct Names {
    const char *launcher, *rank, *size, *local_rank, *local_size;
  };
  // Slurm after the MPIs: mpirun inside a Slurm allocation sets both, and its own are right.
  static constexpr Names launchers[] = {
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}};
  auto number = [&](const char* name) -> std::optional<int> {
    const char* v = getenv(name);
    if (v == nullptr) return std::nullopt;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    // Slurm writes SLURM_NTASKS_PER_NODE as "2" or "2(x3)"; the count before '(' is ours.
    expect<ConfigError>(end != v && (*end == '\0' || *end == '(') && x >= 0 && x < (1L << 30),
                        "launch environment: ", name, "='", v, "' is not a non-negative integer");
    return static_cast<int>(x);
  };
  for (const Names& n : launchers) {
    const auto rank = number(n.rank), size = number(n.size);
    if (!rank || !size) continue;
    LaunchEnv e;
    e.launcher = n.launcher;
    e.rank = *rank;
    e.size = *size;
    // Without local variables (MPICH's Hydra sets them only with some bootstraps) every rank
    // counts as its own host's only one.
    e.local_rank = number(n.local_rank).value_or(0);
    e.local_size = number(n.local_size).value_or(1);
    expect<ConfigError>(e.size >= 1 && e.rank < e.size, "launch environment (", e.launcher,
                        "): ", n.rank, "=", e.rank, " is not below ", n.size, "=", e.size);
    expect<ConfigError>(e.local_size >= 1 && e.local_rank < e.local_size && e.local_size <= e.size,
                        "launch environment (", e.launcher, "): ", n.local_rank, "=", e.local_rank,
                        ", ", n.local_size, "=", e.local_size, " do not fit a launch of ", e.size,
                        " ranks");
    return e;
  }
  return std::nullopt;
}

}  // namespace zero::parallel
