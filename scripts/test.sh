#!/usr/bin/env bash
# The README's test command: installs what is missing, configures, builds and runs the tests.
#   bash scripts/test.sh            unit, package and MPI tests (the default CTest run)
#   bash scripts/test.sh --slow     also the [slow] tests
# Exits non-zero when anything fails, after printing the failing tests' output.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

preset=ci
ctest_args=(--preset "$preset" -j 2)
if [ "${1:-}" = "--slow" ]; then
  ctest_args=(--test-dir "build/$preset" --output-on-failure -j 2)
fi

# mpiexec refuses root unless told; the tests oversubscribe the 2 cores on purpose.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j 2
ctest "${ctest_args[@]}"
