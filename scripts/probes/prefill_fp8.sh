#!/usr/bin/env bash
# Builds scripts/probes/prefill_fp8.cu once per DeepGEMM FP8 psum instance (in parallel), then
# runs each in turn, and the quantization kernels on the same rows. Output in $OUT.
#   device tool: kind nvidia-h200, command: bash scripts/probes/prefill_fp8.sh ["BN ST MC MCA [SPEC SWD GR]" ...]
#   (SPEC 1: compile-time N and K; SWD: the D swizzle, 128 or 64; GR: kNumGroups; all three or none, 0 128 256 if none)
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-out}
mkdir -p "$out" /tmp/probes
rm -f /tmp/probes/quant-before
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
dg=${DEEP_GEMM_INCLUDE:-../../.venv-cuda/deep_gemm-0.2.5/include}
nv="nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -isystem $dg -lcuda"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=("192 4 1 0" "192 4 2 0" "192 4 2 1" "128 5 1 0" "128 5 2 0" "128 5 2 1")
$nv -DQUANT -o /tmp/probes/quant prefill_fp8.cu > "$out/build-quant.log" 2>&1 &
# QUANT_BEFORE: another build's kernels/fp8.cu (a path from here, one that takes `Live` by value), timed beside this one's.
[ -z "${QUANT_BEFORE:-}" ] || $nv -DQUANT -DFP8_KERNELS="\"$QUANT_BEFORE\"" -o /tmp/probes/quant-before prefill_fp8.cu > "$out/build-quant-before.log" 2>&1 &
for c in "${configs[@]}"; do
  set -- $c 0 128 256
  $nv -DBN=$1 -DST=$2 -DMC=$3 -DMCA=$4 -DPF_SPEC=$5 -DPF_SWD=$6 -DPF_GR=$7 -o "/tmp/probes/pf_$1_$2_$3_$4_$5_$6_$7" prefill_fp8.cu > "$out/build-$1-$2-$3-$4-$5-$6-$7.log" 2>&1 &
done
wait
status=0
for q in ${QUANT_BEFORE:+quant-before} quant quant-before; do
  [ -x "/tmp/probes/$q" ] || continue
  echo "$q:" | tee -a "$out/prefill_fp8.txt"
  timeout 20 "/tmp/probes/$q" | tee -a "$out/prefill_fp8.txt" || status=1
done
for round in 1 2; do
  for c in "${configs[@]}"; do
    set -- $c 0 128 256
    # A hung instance (a bad tile) must not take the call's time with it.
    timeout 20 "/tmp/probes/pf_$1_$2_$3_$4_$5_$6_$7" | tee -a "$out/prefill_fp8.txt" || { status=1; echo "pf_$1_$2_$3_$4_$5_$6_$7 failed or hung" | tee -a "$out/prefill_fp8.txt"; }
  done
done
exit $status
