#!/usr/bin/env bash
# Packs the CUDA test and benchmark binaries of a build directory, with the shared libraries they
# need beyond the CUDA runtime and libc, into .carry/pack.tar.xz (an ignored folder): what a
# machine with a GPU but without this project's packages needs to run the [cuda] suites and the
# GPU benchmarks (scripts/device/run.sh there). Build the binaries first, e.g.
#   cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90
#   ninja -C build/cuda zero_cuda_ops_tests zero_cuda_engine_backend_tests test_optim_cuda \
#     zero_cuda_comm_tests zero_cuda_core_tests zero_cuda_engine_backend_no_device_tests \
#     kernel_bench gpu_step train_gpt_cuda train_llama_cuda optim_bench
#   bash scripts/device/pack.sh build/cuda
# or pack CI's build, which holds them all for sm_80 and sm_90 (49 MB packed: within the device
# tool's 64 MiB carry):
#   cmake --build --preset ci && bash scripts/device/pack.sh build/ci
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/cuda}
stage=.carry/stage
rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib" "$stage/data"
missing=0
for t in zero_cuda_ops_tests zero_cuda_engine_backend_tests test_optim_cuda zero_cuda_comm_tests \
         zero_cuda_core_tests zero_cuda_engine_backend_no_device_tests kernel_bench gpu_step \
         train_gpt_cuda train_llama_cuda optim_bench; do
  f=$(find "$build" -name "$t" -type f -perm -u+x | head -1)
  if [[ -n $f ]]; then cp "$f" "$stage/bin/"; else echo "pack.sh: no $t in $build"; missing=1; fi
done
# The libraries the device machine lacks (its CUDA runtime, cuBLAS and NCCL are its own).
for f in "$stage"/bin/*; do
  ldd "$f" | awk '/=>/ {print $3}' |
    grep -v -E 'libcuda|libcudart|libcublas|libnccl|libc\.so|libm\.so|libstdc|libgcc_s|ld-linux|libpthread|libdl|librt' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
cp data/corpus.txt "$stage/data/" 2>/dev/null || true
tar -C "$stage" -cJf .carry/pack.tar.xz .
ls -la .carry/pack.tar.xz
exit $missing
