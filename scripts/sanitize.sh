#!/usr/bin/env bash
# The sanitizer runs (scripts/test.sh --sanitize runs this): an ASan + UBSan build (preset
# debug-asan) and a TSan build (preset tsan) of the communicator and engine tests, each run
# through CTest without the [slow] cases. Suppressions: tests/sanitizers/ (LSan: allocations
# Open MPI keeps until exit; TSan: what the tool cannot see; each one commented).
#   bash scripts/sanitize.sh            both
#   bash scripts/sanitize.sh asan|tsan  one of them
#   bash scripts/sanitize.sh ci         the ASan + UBSan subset CI runs (scripts/test.sh): the
#                                       communicator tests and the readers of untrusted files
#                                       (config, safetensors, checkpoints, token files)
# Sanitizer builds are CPU-heavy (about 10x a ci build of the same targets), so CI runs only the
# subset (docs/reliability.md). Set ZERO_SANITIZE_JOBS to build with more than 2 jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
jobs=${ZERO_SANITIZE_JOBS:-2}
which=${1:-all}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE

# detect_leaks stays on: zero's own leaks are reported, Open MPI's listed ones are not. Open MPI
# is built without frame pointers, so the fast unwinder stops at its first frame ("<unknown
# module>") and no suppression can match; the slow unwinder gives whole stacks.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:fast_unwind_on_malloc=0"
export LSAN_OPTIONS="suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

if [ "$which" = ci ]; then
  cmake --preset debug-asan >/dev/null
  cmake --build build/debug-asan -j "$jobs" --target zero_parallel_tests zero_config_tests \
    zero_io_tests zero_checkpoint_tests zero_data_tests
  ctest --test-dir build/debug-asan --output-on-failure -j "$jobs" -LE slow \
    -R '^zero_(parallel|config|io|checkpoint|data)_tests:'
  exit 0
fi

if [ "$which" = all ] || [ "$which" = asan ]; then
  cmake --preset debug-asan >/dev/null
  cmake --build build/debug-asan -j "$jobs" --target zero_parallel_tests zero_engine_tests \
    zero_parallel_mpi_tests zero_engine_mpi_tests kill_rank_resume
  ctest --test-dir build/debug-asan --output-on-failure -j "$jobs" -LE slow \
    -R '^zero_(parallel|engine)_(mpi_)?tests|^zero_engine_mpi:'
fi

if [ "$which" = all ] || [ "$which" = tsan ]; then
  export TSAN_OPTIONS="suppressions=$here/tests/sanitizers/tsan.supp:second_deadlock_stack=1:halt_on_error=0"
  cmake --preset tsan >/dev/null
  cmake --build build/tsan -j "$jobs" --target zero_parallel_tests zero_engine_tests
  ctest --test-dir build/tsan --output-on-failure -j "$jobs" -LE slow \
    -R '^zero_(parallel|engine)_tests:'
fi
