// The Engine 2 seams over MpiComm (mpiexec at 2 and 4 ranks): stage slices equal the whole
// model at stages 0-3, and an engine over each data-parallel group of a (tp x dp) grid equals
// one process on that group's batch with traffic on the dp groups only.
#include <string>

#include <catch2/catch.hpp>

#include <parallel/comm/mpi_comm.hpp>

#include "engine_mpi_util.hpp"
#include "seam_checks.hpp"

using namespace zero;
using namespace zero::test;

TEMPLATE_TEST_CASE_SIG("MpiComm: stage slices equal the whole model", "[mpi][engine][slices]",
                       ((int S), S), 0, 1, 2, 3) {
  const auto want = reference_sgd(micro_rows * 2 * world().size(), 2, 1.0);
  CHECK(worst(sliced_error<S>(world(), 2, 2, 2, want)) < 1e-12);
  CHECK(worst(sliced_error<S>(world(), 2, 2, 2, want, 1e-3)) > 1e-9);  // negative control
}

TEMPLATE_TEST_CASE_SIG(
    "MpiComm: an engine over each dp group equals the reference and talks on "
    "the dp groups, and on tp only for the gradient-norm statistics",
    "[mpi][engine][groups]", ((int S), S), 0, 1, 2, 3) {
  for (int tp : {1, 2}) {
    INFO("stage " << S << " ranks " << world().size() << " tp " << tp);
    const GroupRun r = grid_run<S>(world(), tp, 2, 2);
    CHECK(worst(r.error) < 1e-10);
    CHECK(r.wrong_reference_error > 1e-3);
    // Every op ran on the dp group (one-rank ops too, when each dp group is a single rank),
    // except the norm statistics' all-reduce over tp (two doubles per boundary) when tp > 1,
    // and the construction's check over all the engine's ranks (tp-dp) that their options
    // agree.
    for (const std::string& g : r.groups) {
      CHECK((g == "dp" || ((g == "tp" || g == "tp-dp") && tp > 1)));
    }
    if (world().size() / tp > 1) CHECK(r.dp_bytes > 0);
    CHECK(r.tp_bytes == (tp > 1 ? 2u * 2 * sizeof(double) : 0u));
  }
}
