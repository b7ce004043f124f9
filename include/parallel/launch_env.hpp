#pragma once
// LaunchEnv: this process's rank, world size, local rank and local size as the launcher that
// started it says, read from the environment: OpenMPI (mpirun, zero-launch's default), MPICH /
// Hydra (mpiexec), Slurm (srun), or torchrun-style variables. A program uses it to tell whether
// it was launched as one of many ranks (then it builds an MpiComm) and to pick its device by
// local rank before MPI is initialised. The first launcher whose variables are all present wins:
// the MPIs, then torchrun, then Slurm, so a launcher started inside another's allocation or step
// is the one heard. Slurm counts only inside an srun step (SLURM_STEP_NUM_TASKS): a batch script
// also has SLURM_PROCID and the job's SLURM_NTASKS, and a program it runs directly is one
// process, not rank 0 of the job's tasks.

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

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

namespace detail {

/// The count for node index node in a Slurm per-node task list ("2(x3),1": 2 tasks on each of
/// nodes 0-2, 1 on node 3); empty when the list does not parse or is shorter.
inline std::optional<int> slurm_tasks_on_node(std::string_view list, int node) {
  std::int64_t first = 0;  // node index of the item's first node
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    const std::string_view item = list.substr(0, comma);
    const char* const end = item.data() + item.size();
    int count = 0, repeat = 1;
    const auto [after_count, e1] = std::from_chars(item.data(), end, count);
    if (e1 != std::errc() || count < 0) return std::nullopt;
    if (after_count != end) {  // "(xK)"
      const std::string_view rest(after_count, static_cast<std::size_t>(end - after_count));
      if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')') return std::nullopt;
      const auto [after_repeat, e2] = std::from_chars(rest.data() + 2, end - 1, repeat);
      if (e2 != std::errc() || after_repeat != end - 1 || repeat < 1) return std::nullopt;
    }
    if (node < first + repeat) return count;
    first += repeat;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return std::nullopt;
}

/// Slurm's ranks on this node: this step's per-node task list at SLURM_NODEID (srun sets
/// SLURM_STEP_TASKS_PER_NODE; SLURM_TASKS_PER_NODE is the job's), else SLURM_NTASKS_PER_NODE
/// when it fits this launch (set only with --ntasks-per-node, and a step may run fewer tasks),
/// else at least local_rank + 1.
inline int slurm_local_size(const std::function<const char*(const char*)>& getenv, int local_rank,
                            int size) {
  const auto fits = [&](std::optional<int> v) { return v && *v > local_rank && *v <= size; };
  const char* node_text = getenv("SLURM_NODEID");
  int node = 0;
  if (node_text != nullptr) {
    const std::string_view t(node_text);
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), node);
    if (ec != std::errc() || end != t.data() + t.size() || node < 0) node = -1;
  }
  for (const char* name :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
    const char* list = getenv(name);
    // SLURM_NTASKS_PER_NODE is one count for every node ("4", or "4(x2)" on some versions);
    // SLURM_TASKS_PER_NODE is the job's list, right where the step spans the allocation.
    const bool per_job = std::string_view(name) == "SLURM_NTASKS_PER_NODE";
    if (list == nullptr || (node < 0 && !per_job)) continue;
    const auto v = slurm_tasks_on_node(list, per_job ? 0 : node);
    if (fits(v)) return *v;
  }
  return local_rank + 1;
}

}  // namespace detail

/// Reads the launch from getenv (std::getenv by default; tests pass a map); empty when no
/// launcher's variables are set. Throws ConfigError naming the variable when one is not a
/// non-negative integer or the numbers contradict each other.
inline std::optional<LaunchEnv> launch_env(const std::function<const char*(const char*)>& getenv =
                                               [](const char* name) { return std::getenv(name); }) {
  struct Names {
    const char *launcher, *rank, *size, *local_rank, *local_size;
  };
  // Slurm last: mpirun or torchrun inside a Slurm allocation sees both, and its own are right.
  static constexpr Names launchers[] = {
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
       nullptr}};  // slurm_local_size
  auto number = [&](const char* name) -> std::optional<int> {
    const char* v = getenv(name);
    if (v == nullptr) return std::nullopt;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    expect<ConfigError>(end != v && *end == '\0' && x >= 0 && x < (1L << 30),
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
    // Without local variables (MPICH's Hydra sets them only with some bootstraps, Slurm's PMI
    // plugins never) they come from the Slurm step this rank is (srun --mpi=pmi2 sets PMI_RANK
    // and PMI_SIZE), else every rank counts as its own host's only one.
    const auto local_rank = number(n.local_rank);
    const bool slurm = std::string_view(n.launcher) == "slurm";
    if (!slurm && !local_rank && number("SLURM_PROCID") == rank &&
        number("SLURM_STEP_NUM_TASKS") == size) {
      e.local_rank = number("SLURM_LOCALID").value_or(0);
      e.local_size = detail::slurm_local_size(getenv, e.local_rank, e.size);
    } else {
      e.local_rank = local_rank.value_or(0);
      e.local_size = n.local_size ? number(n.local_size).value_or(1)
                                  : detail::slurm_local_size(getenv, e.local_rank, e.size);
    }
    expect<ConfigError>(e.size >= 1 && e.rank < e.size, "launch environment (", e.launcher,
                        "): ", n.rank, "=", e.rank, " is not below ", n.size, "=", e.size);
    expect<ConfigError>(e.local_size >= 1 && e.local_rank < e.local_size && e.local_size <= e.size,
                        "launch environment (", e.launcher, "): ", n.local_rank, "=", e.local_rank,
                        ", ", n.local_size ? n.local_size : "the local size", "=", e.local_size,
                        " do not fit a launch of ", e.size, " ranks");
    return e;
  }
  return std::nullopt;
}

/// Whether a launch (launch_env's answer) started this process as an MPI rank, so that it builds
/// an MpiComm: mpirun or mpiexec, or one of several srun tasks (zero-launch drives all three).
/// No launch, torchrun's variables (its ranks meet over TCP, not MPI) or a lone srun task (a
/// batch script's own step) keep one process and its LocalComm ranks.
inline bool launched_by_mpi(const std::optional<LaunchEnv>& launch) {
  if (!launch || launch->launcher == "torchrun") return false;
  return launch->launcher != "slurm" || launch->size > 1;
}

}  // namespace zero::parallel
