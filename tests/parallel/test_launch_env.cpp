// LaunchEnv reads rank, size and local rank/size from OpenMPI, MPICH, Slurm and torchrun
// variables, and names a bad one.
#include <map>
#include <string>

#include <catch2/catch.hpp>

#include <parallel/launch_env.hpp>

using zero::parallel::launch_env;
using zero::parallel::launched_by_mpi;

namespace {
auto from(const std::map<std::string, std::string>& env) {
  return [env](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST_CASE("launch_env reads each launcher's variables", "[unit][comm]") {
  CHECK_FALSE(launch_env(from({})));
  const auto ompi = launch_env(from({{"OMPI_COMM_WORLD_RANK", "3"},
                                     {"OMPI_COMM_WORLD_SIZE", "4"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  REQUIRE(ompi);
  CHECK(ompi->launcher == "openmpi");
  CHECK(ompi->rank == 3);
  CHECK(ompi->size == 4);
  CHECK(ompi->local_rank == 1);
  CHECK(ompi->local_size == 2);
  const auto mpich = launch_env(from({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}}));
  REQUIRE(mpich);
  CHECK(mpich->launcher == "mpich");
  CHECK(mpich->rank == 2);
  CHECK(mpich->local_rank == 0);  // no local variables: its own host's only rank
  CHECK(mpich->local_size == 1);
  const auto slurm = launch_env(from({{"SLURM_PROCID", "5"},
                                      {"SLURM_STEP_NUM_TASKS", "8"},
                                      {"SLURM_LOCALID", "1"},
                                      {"SLURM_NTASKS_PER_NODE", "4(x2)"}}));
  REQUIRE(slurm);
  CHECK(slurm->launcher == "slurm");
  CHECK(slurm->local_size == 4);
  // mpirun inside a Slurm allocation: OpenMPI's variables win.
  const auto both = launch_env(from({{"SLURM_PROCID", "0"},
                                     {"SLURM_NTASKS", "1"},
                                     {"OMPI_COMM_WORLD_RANK", "1"},
                                     {"OMPI_COMM_WORLD_SIZE", "2"}}));
  REQUIRE(both);
  CHECK(both->launcher == "openmpi");
  CHECK(both->rank == 1);
  const auto torch = launch_env(from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}));
  REQUIRE(torch);
  CHECK(torch->launcher == "torchrun");
  // torchrun inside an srun step: the inner launcher's variables win, as mpirun's do.
  const auto torch_in_srun = launch_env(from({{"SLURM_PROCID", "1"},
                                              {"SLURM_STEP_NUM_TASKS", "2"},
                                              {"SLURM_LOCALID", "0"},
                                              {"RANK", "5"},
                                              {"WORLD_SIZE", "16"},
                                              {"LOCAL_RANK", "1"},
                                              {"LOCAL_WORLD_SIZE", "8"}}));
  REQUIRE(torch_in_srun);
  CHECK(torch_in_srun->launcher == "torchrun");
  CHECK(torch_in_srun->rank == 5);
  CHECK(torch_in_srun->local_size == 8);
  // A batch script running a program directly: the batch step has SLURM_PROCID 0 and the
  // job's SLURM_NTASKS, but no step of tasks (it counted as rank 0 of 8).
  CHECK_FALSE(launch_env(from({{"SLURM_PROCID", "0"},
                               {"SLURM_NTASKS", "8"},
                               {"SLURM_LOCALID", "0"},
                               {"SLURM_TASKS_PER_NODE", "4(x2)"}})));
  // srun --mpi=pmi2: PMI_RANK and PMI_SIZE without MPICH's local variables; the node's ranks
  // come from the Slurm step (every rank counted as its own host's only one).
  const auto pmi2 = launch_env(from({{"PMI_RANK", "3"},
                                     {"PMI_SIZE", "8"},
                                     {"SLURM_PROCID", "3"},
                                     {"SLURM_STEP_NUM_TASKS", "8"},
                                     {"SLURM_LOCALID", "3"},
                                     {"SLURM_NODEID", "0"},
                                     {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}}));
  REQUIRE(pmi2);
  CHECK(pmi2->launcher == "mpich");
  CHECK(pmi2->local_rank == 3);
  CHECK(pmi2->local_size == 4);
}

TEST_CASE("launched_by_mpi: the MPIs and several srun tasks build an MpiComm", "[unit][comm]") {
  CHECK_FALSE(launched_by_mpi(launch_env(from({}))));
  CHECK(launched_by_mpi(
      launch_env(from({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}))));
  CHECK(launched_by_mpi(launch_env(from({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}))));
  CHECK(launched_by_mpi(launch_env(from({{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}}))));
  // One srun task (a batch script's own step) and torchrun's variables keep one process.
  CHECK_FALSE(
      launched_by_mpi(launch_env(from({{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}}))));
  CHECK_FALSE(launched_by_mpi(launch_env(
      from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}}))));
}

TEST_CASE("launch_env names a malformed or contradictory variable", "[unit][comm]") {
  CHECK_THROWS_WITH(launch_env(from({{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}})),
                    Catch::Contains("PMI_RANK='x'"));
  CHECK_THROWS_WITH(launch_env(from({{"PMI_RANK", "2"}, {"PMI_SIZE", "2"}})),
                    Catch::Contains("PMI_RANK=2 is not below PMI_SIZE=2"));
  CHECK_THROWS_WITH(launch_env(from({{"OMPI_COMM_WORLD_RANK", "0"},
                                     {"OMPI_COMM_WORLD_SIZE", "2"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})),
                    Catch::Contains("OMPI_COMM_WORLD_LOCAL_RANK=2"));
}

TEST_CASE("launch_env: Slurm's ranks on a node come from the step's per-node task list",
          "[unit][comm]") {
  // SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node (and is the job's, not the
  // step's): srun -n4 without it failed on ranks 1-3 ("do not fit"), srun -n2 in an allocation
  // of 8 per node on every rank.
  const auto plain = launch_env(from({{"SLURM_PROCID", "1"},
                                      {"SLURM_STEP_NUM_TASKS", "4"},
                                      {"SLURM_LOCALID", "1"},
                                      {"SLURM_NODEID", "0"},
                                      {"SLURM_STEP_TASKS_PER_NODE", "4"}}));
  REQUIRE(plain);
  CHECK(plain->local_rank == 1);
  CHECK(plain->local_size == 4);
  const auto uneven = launch_env(from({{"SLURM_PROCID", "5"},
                                       {"SLURM_STEP_NUM_TASKS", "9"},
                                       {"SLURM_LOCALID", "2"},
                                       {"SLURM_NODEID", "2"},
                                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2),5"}}));
  REQUIRE(uneven);
  CHECK(uneven->local_size == 5);
  const auto fewer = launch_env(from({{"SLURM_PROCID", "1"},
                                      {"SLURM_STEP_NUM_TASKS", "2"},
                                      {"SLURM_LOCALID", "1"},
                                      {"SLURM_NTASKS_PER_NODE", "8"},
                                      {"SLURM_STEP_TASKS_PER_NODE", "2"}}));
  REQUIRE(fewer);
  CHECK(fewer->local_size == 2);
  // Nothing usable: at least the ranks up to this one.
  const auto bare = launch_env(
      from({{"SLURM_PROCID", "3"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "3"}}));
  REQUIRE(bare);
  CHECK(bare->local_size == 4);
  CHECK(zero::parallel::detail::slurm_tasks_on_node("2(x3),1", 3) == 1);
  CHECK(zero::parallel::detail::slurm_tasks_on_node("2(x3),1", 2) == 2);
  CHECK_FALSE(zero::parallel::detail::slurm_tasks_on_node("2(x3),1", 4));
  CHECK_FALSE(zero::parallel::detail::slurm_tasks_on_node("2(y3)", 0));
}
