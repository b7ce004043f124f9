#!/usr/bin/env bash
# The README's main-example command: installs what is missing, builds and runs the main example,
# train_gpt (a small byte-level GPT-2 trained on the bundled corpus). Arguments go to train_gpt.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export OMP_WAIT_POLICY=PASSIVE
cmake --preset default >/dev/null
cmake --build --preset default -j 2 --target train_gpt
./build/default/examples/train_gpt/train_gpt "$@"
