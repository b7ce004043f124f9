#!/usr/bin/env bash
# Fails when a Catch test name would break CTest's list of tests: catch_discover_tests joins the
# names with ';' (a name holding one becomes two tests that match nothing) and CMake's lists keep
# what lies between '[' and ']' as one element (an unbalanced '[' swallows the names after it
# into one test). Arguments: test executables, or '-' to read names from standard input.
set -euo pipefail
bad=0
check() {
  local where=$1 name
  while IFS= read -r name; do
    case "$name" in
      *';'* | *'['* | *']'*)
        echo "$where: test name '$name' holds ';', '[' or ']', which break CTest's list of tests"
        bad=1
        ;;
    esac
  done
}
for exe in "$@"; do
  if [ "$exe" = - ]; then
    check "standard input"
  else
    check "$(basename "$exe")" < <("$exe" --list-test-names-only)
  fi
done
exit $bad
