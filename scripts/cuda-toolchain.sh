#!/usr/bin/env bash
# Installs pip's CUDA 13.0 toolchain (nvcc, nvvm, crt, runtime headers, CCCL) into .venv-cuda, and
# DeepGEMM's headers (with the CUTLASS/CuTe headers they need) from the pinned sgl-deep-gemm wheel
# into .venv-cuda/deep_gemm; prints NVCC and DEEP_GEMM_INCLUDE for `--features cuda`. Idempotent.
# Usage: eval "$(scripts/cuda-toolchain.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-cuda
if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
fi
nvcc=$(ls "$PWD/$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)

# Headers only: the wheel's compiled extension is not used. Pinned by version and checksum.
dg_version=0.2.5
dg_sha256=e13778e53f682b806dd2c799b5ad81701114d9346044643a8df7589a845f34e6
dg_wheel=sgl_deep_gemm-$dg_version-py3-none-manylinux2014_x86_64.whl
dg_dir=$PWD/$venv/deep_gemm-$dg_version
if [ ! -f "$dg_dir/include/deep_gemm/impls/sm90_bf16_gemm.cuh" ]; then
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    "sgl-deep-gemm==$dg_version" -d "$tmp" >&2
  echo "$dg_sha256  $tmp/$dg_wheel" | sha256sum -c --quiet - >&2
  rm -rf "$dg_dir" && mkdir -p "$dg_dir"
  python3 -m zipfile -e "$tmp/$dg_wheel" "$tmp/x" >&2
  mv "$tmp/x/deep_gemm/include" "$dg_dir/include"
  cp "$tmp"/x/sgl_deep_gemm-*.dist-info/licenses/* "$dg_dir/" 2>/dev/null || true
  rm -rf "$tmp"
fi
echo "export NVCC=$nvcc"
echo "export DEEP_GEMM_INCLUDE=$dg_dir/include"
