#!/usr/bin/env bash
# Installs what zero's build, tests and examples need on Debian 12 (idempotent; quiet when all is
# present). CUDA and NCCL are optional and come from NVIDIA's repositories, not from here.
set -euo pipefail

packages=(
  cmake ninja-build g++ ccache pkg-config git clang-format
  catch2 nlohmann-json3-dev
  # oneDNN: bf16 GEMM on AMX / AVX512-BF16 (optional part zero::dnnl). It is found only with
  # ocl-icd-opencl-dev, left out on purpose (oneDNN 2.6's f32 bits vary with the thread count
  # on AVX2: docs/models.md), so the default build runs f32 on OpenBLAS.
  libopenblas-dev libdnnl-dev
  libboost-mpi-dev libopenmpi-dev openmpi-bin
  liburing-dev
  python3-matplotlib  # scripts/plot_metrics.py (its test skips without it)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
