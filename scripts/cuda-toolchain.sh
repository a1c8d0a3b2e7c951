#!/usr/bin/env bash
# Installs pip's CUDA 13.0 toolchain (nvcc, nvvm, crt, runtime headers, CCCL) into .venv-cuda and
# prints the NVCC path for `--features cuda`. Idempotent. Usage: eval "$(scripts/cuda-toolchain.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-cuda
if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
fi
nvcc=$(ls "$PWD/$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
echo "export NVCC=$nvcc"
