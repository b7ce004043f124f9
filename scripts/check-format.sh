#!/usr/bin/env bash
# Checks (changes nothing) that every tracked C++/CUDA file under include/ tests/ examples/
# benchmarks/ is formatted with the repo's .clang-format: prints the files that are not, with
# the command that fixes them (scripts/format.sh), and exits 1 if there are any.
exec bash "$(dirname "$0")/format.sh" --check "$@"
