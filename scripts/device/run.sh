#!/usr/bin/env bash
# On a machine with a GPU, in the repository root with .carry/pack.tar.xz beside it (made by
# scripts/device/pack.sh): unpacks the binaries and runs what $1 names, writing the logs under
# $OUT (the device tool's result folder; /tmp/out elsewhere) and a summary.txt there:
#   quick    the [cuda] suites, kernel_bench, gpu_step, five short train_gpt_cuda runs and two
#            of train_llama_cuda
#   tests    the [cuda] suites only
#   bench    gpu_step, PyTorch's GPT-2 step on the same GPU, kernel_bench, the host AdamW (on
#            every core, and on one fewer, as the delayed update runs it)
#   all      tests, bench, the train_gpt_cuda runs and profile
#   profile  nsys over two of gpu_step's runs, ncu over a few of kernel_bench's kernels (where the
#            machine has them)
# Each phase's logs reach $OUT as soon as it ends (summary.txt and logs.tar.gz are rewritten after
# every phase), so a call that runs past the device tool's limit still returns what finished. A
# phase that starts with less than its usual time left of ZERO_DEVICE_BUDGET_S seconds from the
# start (default 540, under the tool's 600 per call) is skipped; phases.txt says what each took.
# Every failure of the tests, bench and train phases (a suite or binary that exits non-zero, 77
# included: a [cuda] suite that sees no GPU skips, which here is a failure; no gpu_step line), a
# library ldd cannot find, or a pack that does not unpack is listed in failures.txt, at the top
# of summary.txt, and the script then exits 1. The baselines (PyTorch, the host AdamW) and the
# profilers only log their exit status: the machine may lack them.
set -uo pipefail
mode=${1:-quick}
final=${OUT:-/tmp/out}
logs=/tmp/zero-device-logs
root=$(pwd)
budget=${ZERO_DEVICE_BUDGET_S:-540}
started=$(date +%s)
rm -rf "$logs" && mkdir -p "$logs" "$final"
: > "$logs/failures.txt"
# fail WHAT: records a failure (from any phase, background jobs included).
fail() { echo "FAILED: $*" >> "$logs/failures.txt"; }
rm -rf /tmp/zero-device && mkdir -p /tmp/zero-device
if ! tar -C /tmp/zero-device -xJf .carry/pack.tar.xz; then
  echo "FAILED: cannot unpack .carry/pack.tar.xz (make it with scripts/device/pack.sh)" \
    | tee "$final/summary.txt"
  exit 1
fi
bin=/tmp/zero-device/bin
libs=/tmp/zero-device/lib
for name in libcudart.so libcublasLt.so libcublas.so libnccl.so; do
  d=$(ldconfig -p | awk -v n="$name" '$1 ~ n {print $NF; exit}' | xargs -r dirname)
  [[ -z $d ]] && d=$(find /usr/local/cuda* /usr/lib /opt -name "${name}*" 2>/dev/null | head -1 | xargs -r dirname)
  [[ -n $d ]] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  git -C "$root" log --oneline -1 2>/dev/null
} > "$logs/env.txt" 2>&1
for b in "$bin"/*; do
  missing=$(ldd "$b" 2>&1 | grep "not found")
  [[ -n $missing ]] && fail "$(basename "$b") needs libraries ldd cannot find: $missing"
done
cd /tmp/zero-device || exit 1  # train_gpt_cuda finds data/corpus.txt here

run_tests() {
  for t in zero_cuda_ops_tests zero_cuda_engine_backend_tests zero_cuda_comm_tests zero_cuda_core_tests; do
    (timeout 150 "$bin/$t" > "$logs/test_$t.txt" 2>&1; checked "$t" $? "$logs/tests.txt") &
  done
  timeout 150 "$bin/test_optim_cuda" > "$logs/test_optim_cuda.txt" 2>&1
  checked test_optim_cuda $? "$logs/tests.txt"
  # With no device visible, as ctest runs it: the error paths it checks need that.
  CUDA_VISIBLE_DEVICES=-1 timeout 100 "$bin/zero_cuda_engine_backend_no_device_tests" \
    > "$logs/test_no_device.txt" 2>&1
  checked no_device $? "$logs/tests.txt"
  wait
  # The GEMMs and the layers' fused epilogues again with every shape's algorithm timed (the
  # measured tuning runs candidates into scratch; beta 1 must still add once).
  ZERO_GEMM_TUNING=measured timeout 120 "$bin/zero_cuda_ops_tests" "[gemm],[layers]" \
    > "$logs/test_ops_measured_gemm.txt" 2>&1
  checked ops_measured_gemm $? "$logs/tests.txt"
  for f in "$logs"/test_*.txt; do
    echo "== $f"; tail -3 "$f"; grep -B2 -A12 "FAILED" "$f" | head -60
  done >> "$logs/tests.txt"
}
run_bench() {
  timeout 210 "$bin/gpu_step" --warmup 2 --steps 6 > "$logs/gpu_step.txt" 2>&1
  checked gpu_step $? "$logs/gpu_step.txt"
  grep -q '"bench": "gpu_step"' "$logs/gpu_step.txt" || fail "gpu_step measured nothing"
  timeout 150 "$bin/kernel_bench" --repeats 10 > "$logs/kernel_bench.txt" 2>&1
  checked kernel_bench $? "$logs/kernel_bench.txt"
}
# PyTorch's GPT-2 step on the same GPU (the device machine has PyTorch), and the host AdamW
# that Offload<CPU> runs, on this machine's cores.
run_baselines() {
  (cd "$root" && timeout 100 python3 benchmarks/engine/torch_gpt2_step.py > "$logs/torch.txt" 2>&1
   echo "rc $?" >> "$logs/torch.txt")
  OMP_WAIT_POLICY=PASSIVE timeout 60 "$bin/optim_bench" --elements 124000000 --repeats 3 \
    > "$logs/optim_bench.txt" 2>&1
  { echo "rc $?"; nproc; lscpu | grep -E "Model name|Socket|Thread|NUMA"; } >> "$logs/optim_bench.txt"
  # The delayed update's host AdamW leaves one thread to the thread that drives the device.
  OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 )) timeout 60 "$bin/optim_bench" \
    --elements 124000000 --repeats 3 >> "$logs/optim_bench.txt" 2>&1
  echo "rc $? (one thread fewer)" >> "$logs/optim_bench.txt"
}
run_train() {
  local extra
  for extra in "--stage 2" "--stage 3 --offload-cpu" "--stage 2 --offload-cpu --delayed-update 2" \
               "--stage 2 --offload-cpu --grad-accum 2 --grads-on-device" \
               "--stage 2 --offload-cpu --offload-ratio 0.5 --delayed-update 2"; do
    read -ra flags <<< "$extra"
    timeout 100 "$bin/train_gpt_cuda" --data data/corpus.txt --steps 8 --layers 2 --channels 64 \
      --seq 32 --precision bf16 --ranks 2 "${flags[@]}" >> "$logs/train_gpt_cuda.txt" 2>&1
    checked "train_gpt_cuda $extra" $? "$logs/train_gpt_cuda.txt"
  done
  # The Llama decoder on the GPU: ZeRO-3, and ZeRO-2 with the host optimizer (ZeRO-Offload).
  for extra in "--stage 3" "--stage 2 --offload-cpu"; do
    read -ra flags <<< "$extra"
    timeout 100 "$bin/train_llama_cuda" --data data/corpus.txt --steps 8 --layers 2 --channels 64 \
      --seq 32 --precision bf16 --ranks 2 "${flags[@]}" >> "$logs/train_gpt_cuda.txt" 2>&1
    checked "train_llama_cuda $extra" $? "$logs/train_gpt_cuda.txt"
  done
}

# Where the device time goes, with the machine's profilers where it has them: nsys's per-kernel
# and per-copy sums over stage 0's step and the delayed Offload<CPU> step (gpu_step --runs), and
# ncu's throughput, occupancy and warp-stall sections for the attention, LayerNorm-backward and
# fused cross-entropy kernels (kernel_bench --only), each within what is left of the budget.
find_tool() {
  command -v "$1" || ls /usr/local/cuda*/bin/"$1" /opt/nvidia/nsight-*/"$1" \
    /opt/nvidia/nsight-*/*/"$1" 2>/dev/null | head -1
}
run_profile() {
  local nsys ncu left only name kernels count
  nsys=$(find_tool nsys)
  ncu=$(find_tool ncu)
  left=$(( budget - ($(date +%s) - started) ))
  if [[ -n $nsys ]]; then
    timeout $(( left / 2 )) "$nsys" profile -o /tmp/zero-prof --force-overwrite true \
      "$bin/gpu_step" --warmup 1 --steps 2 --runs stage0,offload_delayed > "$logs/nsys_run.txt" 2>&1
    echo "rc $?" >> "$logs/nsys_run.txt"
    "$nsys" stats -r cuda_gpu_kern_sum,cuda_gpu_mem_time_sum /tmp/zero-prof.nsys-rep \
      > "$logs/nsys_kernels.txt" 2>&1
  else
    echo "no nsys on this machine" > "$logs/nsys_run.txt"
  fi
  if [[ -z $ncu ]]; then
    echo "no ncu on this machine" > "$logs/ncu.txt"
    return
  fi
  left=$(( budget - ($(date +%s) - started) ))
  # kernel_bench --only NAME_PART, then the kernels to profile (their launches in that run:
  # warm-up and one repeat each).
  for only in "flash_attention forward_kernel|delta_kernel|backward_dq_kernel|backward_dkdv_kernel 12" \
              "layer_norm_backward layer_norm_backward_warp_kernel|finish_kernel 4" \
              "cross_entropy_forward_backward cross_entropy_fused_kernel 2"; do
    read -r name kernels count <<< "$only"
    timeout $(( left / 4 )) "$ncu" -k "regex:$kernels" -c "$count" --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      "$bin/kernel_bench" --only "$name" --repeats 1 > "$logs/ncu_$name.txt" 2>&1
    echo "rc $?" >> "$logs/ncu_$name.txt"
  done
}

# checked NAME RC LOG: appends "NAME rc RC" to LOG, and records a failure unless RC is 0.
checked() {
  echo "$1 rc $2" >> "$3"
  (( $2 == 0 )) || fail "$1 exited $2$( (( $2 == 124 )) && echo ' (timed out)')"
}

# What has finished, into $OUT: the summary (failures first), kernel_bench's lines and every log.
save() {
  tar -C "$logs" -czf "$final/logs.tar.gz" .
  cat "$logs"/failures.txt "$logs"/env.txt "$logs"/phases.txt "$logs"/tests.txt \
    "$logs"/gpu_step.txt "$logs"/torch.txt \
    "$logs"/optim_bench.txt "$logs"/train_gpt_cuda.txt "$logs"/nsys_kernels.txt \
    > "$final/summary.txt" 2>/dev/null
  cp "$logs"/kernel_bench.txt "$final/" 2>/dev/null
  return 0
}
# phase NAME USUAL_S: runs run_NAME and saves, unless fewer than USUAL_S seconds of the budget
# are left (then notes that it was skipped).
phase() {
  local name=$1 usual=$2 now
  now=$(( $(date +%s) - started ))
  if (( now + usual > budget )); then
    echo "$name skipped at ${now} s: it usually takes ${usual} s, past the budget of ${budget} s" \
      >> "$logs/phases.txt"
    return
  fi
  "run_$name"
  echo "$name took $(( $(date +%s) - started - now )) s (from ${now} s)" >> "$logs/phases.txt"
  save
}

case $mode in
  quick) phase tests 120; phase bench 120; phase train 60 ;;
  tests) phase tests 120 ;;
  bench) phase bench 120; phase baselines 60 ;;
  all) phase tests 120; phase bench 120; phase baselines 60; phase train 60; phase profile 90 ;;
  profile) phase profile 120 ;;
  *) echo "run.sh: unknown mode $mode (quick, tests, bench, all, profile)"; exit 2 ;;
esac
echo "finished after $(( $(date +%s) - started )) s" >> "$logs/env.txt"
save
if [[ -s $logs/failures.txt ]]; then
  cat "$logs/failures.txt"
  exit 1
fi
exit 0
