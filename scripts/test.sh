#!/usr/bin/env bash
# The README's test command: installs what is missing, checks the formatting, configures,
# builds and runs the tests.
#   bash scripts/test.sh            unit, package and MPI tests (the default CTest run), then
#                                   the ASan + UBSan subset (scripts/sanitize.sh ci)
#   bash scripts/test.sh --slow     also the [slow] tests
#   bash scripts/test.sh --sanitize the whole ASan/UBSan and TSan runs (scripts/sanitize.sh)
# Exits non-zero when anything fails, after printing the failing tests' output. Unformatted
# files (scripts/check-format.sh) fail the run too, but only after the tests ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache hashes paths relative to the clone and leaves the build directory out of debug builds'
# hashes, so a clean clone at another path reuses what an earlier clone compiled.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1

bash scripts/install-deps.sh
if [ "${1:-}" = "--sanitize" ]; then
  exec bash scripts/sanitize.sh
fi

preset=ci
ctest_args=(--preset "$preset" -j 2)
if [ "${1:-}" = "--slow" ]; then
  ctest_args=(--test-dir "build/$preset" --output-on-failure -j 2)
fi

# mpiexec refuses root unless told; the tests oversubscribe the 2 cores on purpose.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE

# check-format.sh exits 1 for files that are not formatted and 2 when it cannot check (no git
# checkout, no clang-format 14): the message at the end says which.
format_status=0
bash scripts/check-format.sh || format_status=$?

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j 2
ctest "${ctest_args[@]}"

# The communicators and the readers of untrusted files under ASan + UBSan, leak detection on.
bash scripts/sanitize.sh ci

if [ $format_status -eq 1 ]; then
  echo "test.sh: the tests passed, but some files are not formatted (listed above)" >&2
  exit 1
elif [ $format_status -ne 0 ]; then
  echo "test.sh: the tests passed, but the formatting could not be checked (see above)" >&2
  exit 1
fi
