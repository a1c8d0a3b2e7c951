#!/usr/bin/env bash
# The probes behind #14's decode work, on one GPU of the device machine (nvcc and cuBLAS are
# there): the HBM read ceiling and TMA box patterns, DeepGEMM's masked instances on decode's
# expert shapes, the step's small kernels against the forms they replaced, the weight-streaming
# decode GEMM against DeepGEMM, and the shared expert's GEMMs at decode. Output in $OUT.
#   device tool: kind nvidia-h200, command: bash scripts/probes/run.sh [probe ...]   (default: all
#   but swiglu_gemm_fp8, #35's fused gate/up + SwiGLU kernel, tried and not kept)
# masked_gemm.cu, decode_gemm.cu, shared_expert.cu and swiglu_gemm_fp8.cu need DeepGEMM's headers: carry
# .venv-cuda/deep_gemm-0.2.5/include as made by scripts/cuda-toolchain.sh (DEEP_GEMM_INCLUDE).
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-out}
what=" ${*:-read_ceiling step_kernels masked_gemm decode_gemm decode_fp8 shared_expert} "
want() { [[ "$what" == *" $1 "* ]]; }
mkdir -p "$out" /tmp/probes
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nv="nvcc -O3 -gencode=arch=compute_90a,code=sm_90a"
status=0
probe() {
  local name=$1; shift
  want "$name" || return 0
  $nv "$@" -o "/tmp/probes/$name" "$name.cu" && "/tmp/probes/$name" | tee "$out/$name.txt" || status=1
}
probe read_ceiling -std=c++17 -lcuda
probe step_kernels -std=c++17 -lcublas
probe decode_fp8 -std=c++17 -lcuda
dg=${DEEP_GEMM_INCLUDE:-../../.venv-cuda/deep_gemm-0.2.5/include}
if [ -d "$dg" ]; then
  probe masked_gemm -std=c++20 --expt-relaxed-constexpr -isystem "$dg" -lcuda
  probe decode_gemm -std=c++20 --expt-relaxed-constexpr -isystem "$dg" -lcuda
  probe shared_expert -std=c++20 --expt-relaxed-constexpr -isystem "$dg" -lcuda -lcublas
  probe swiglu_gemm_fp8 -std=c++20 --expt-relaxed-constexpr -isystem "$dg" -lcuda
fi
exit $status
