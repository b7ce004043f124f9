#!/usr/bin/env bash
# Trains a few steps of train_gpt with the metrics file and every observability section on, then
# draws it with plot_metrics.py and checks the figure is a non-empty PNG. Exits 77 (skipped)
# where matplotlib is missing. Usage: plot_metrics_test.sh TRAIN_GPT PLOT_SCRIPT OUT_DIR
set -euo pipefail
train_gpt=$1 plot=$2 out=$3
# The first Python 3 that has matplotlib (a pyenv python3 may shadow Debian's).
py=""
for candidate in python3 /usr/bin/python3; do
  if "$candidate" -c "import matplotlib" 2>/dev/null; then py=$candidate; break; fi
done
if [ -z "$py" ]; then
  echo "plot_metrics_test: matplotlib is missing (apt-get install python3-matplotlib); skipped"
  exit 77
fi
mkdir -p "$out"
rm -f "$out/run.jsonl" "$out/metrics.png"
"$train_gpt" --steps 6 --print-every 2 --layers 2 --channels 64 --seq 32 --profile \
  --metrics "$out/run.jsonl" >/dev/null
"$py" "$plot" "$out/run.jsonl" -o "$out/metrics.png"
size=$(stat -c %s "$out/metrics.png")
magic=$(head -c 8 "$out/metrics.png" | od -An -tx1 | tr -d ' \n')
[ "$magic" = "89504e470d0a1a0a" ] || { echo "not a PNG: $magic"; exit 1; }
[ "$size" -gt 10000 ] || { echo "PNG too small: $size bytes"; exit 1; }
# negative control: a file without step lines is refused
echo '{"step": 1, "flops_profile": {}}' >"$out/empty.jsonl"
if "$py" "$plot" "$out/empty.jsonl" -o "$out/empty.png" 2>/dev/null; then
  echo "plot_metrics accepted a file without losses"; exit 1
fi
echo "plot ok: $out/metrics.png ($size bytes)"
