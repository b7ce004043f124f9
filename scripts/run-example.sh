#!/usr/bin/env bash
# The README's main-example command: installs what is missing, builds and runs the main example.
# Arguments are passed to the example.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j 2 --target core_tour
./build/default/examples/core_tour "$@"
