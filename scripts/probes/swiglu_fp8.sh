#!/usr/bin/env bash
# Builds scripts/probes/swiglu_fp8.cu's variants, times each twice in turn, and counts the bytes
# of codes and scales where each differs from the base. Output in $OUT.
#   device tool: kind nvidia-h200, command: bash scripts/probes/swiglu_fp8.sh
cd "$(dirname "$0")"; out=${OUT:-out}; mkdir -p "$out" /tmp/sw
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nv="/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a"
declare -A V=([base]="" [fast]="-DFAST_SILU" [rcp]="-DRCP" [fastrcp]="-DFAST_SILU -DRCP" [inexact]="-DFAST_SILU -DRCP_INEXACT")
for k in "${!V[@]}"; do $nv ${V[$k]} -o /tmp/sw/$k swiglu_fp8.cu > "$out/build-$k.log" 2>&1 & done; wait
for round in 1 2; do for k in base fast rcp fastrcp inexact; do /tmp/sw/$k /tmp/sw/$k.bin | tee -a "$out/swiglu.txt"; done; done
for k in fast rcp fastrcp inexact; do echo "$k vs base: $(cmp -l /tmp/sw/base.bin /tmp/sw/$k.bin | wc -l) bytes differ" | tee -a "$out/swiglu.txt"; done
