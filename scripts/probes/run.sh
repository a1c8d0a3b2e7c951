#!/usr/bin/env bash
# The probes behind #14's decode work, on one GPU of the device machine (nvcc and cuBLAS are
# there): the HBM read ceiling and TMA box patterns, DeepGEMM's masked instances on decode's
# expert shapes, and the step's small kernels against the forms they replaced. Output in $OUT.
#   device tool: kind nvidia-h200, command: bash scripts/probes/run.sh
# masked_gemm.cu needs DeepGEMM's headers: carry .venv-cuda/deep_gemm-0.2.5/include as made by
# scripts/cuda-toolchain.sh (DEEP_GEMM_INCLUDE), or leave it out.
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-out}
mkdir -p "$out" /tmp/probes
nv="nvcc -O3 -gencode=arch=compute_90a,code=sm_90a"
$nv -std=c++17 -o /tmp/probes/read_ceiling read_ceiling.cu -lcuda && /tmp/probes/read_ceiling | tee "$out/read_ceiling.txt"
$nv -std=c++17 -o /tmp/probes/step_kernels step_kernels.cu -lcublas && /tmp/probes/step_kernels | tee "$out/step_kernels.txt"
dg=${DEEP_GEMM_INCLUDE:-../../.venv-cuda/deep_gemm-0.2.5/include}
if [ -d "$dg" ]; then
  $nv -std=c++20 --expt-relaxed-constexpr -isystem "$dg" -o /tmp/probes/masked_gemm masked_gemm.cu -lcuda &&
    /tmp/probes/masked_gemm | tee "$out/masked_gemm.txt"
fi
