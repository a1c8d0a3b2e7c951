#!/usr/bin/env bash
# #54's grouped GEMMs under skew (skew_gemm.cu): builds the probe, runs it twice over
# skew_counts.txt, then (NCU=1) once more under Nsight Compute over the S = 0 and S = 1 counts
# (DRAM throughput, L2 hit rate, SM throughput of each launch). Output in $OUT.
#   device tool: kind nvidia-h100-x1, carry .venv-cuda/deep_gemm-0.2.5/include (made by
#   scripts/cuda-toolchain.sh), command: [NCU=1] bash scripts/probes/skew_gemm.sh
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-out}
mkdir -p "$out" /tmp/probes
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
dg=${DEEP_GEMM_INCLUDE:-../../.venv-cuda/deep_gemm-0.2.5/include}
nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -isystem "$dg" -lcuda \
  -o /tmp/probes/skew_gemm skew_gemm.cu > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
status=0
for round in 1 2; do
  timeout 240 /tmp/probes/skew_gemm skew_counts.txt | tee "$out/skew_gemm-$round.txt" || status=1
done
if [ "${NCU:-0}" = 1 ]; then
  grep -E "^(s0|s1_r2) " skew_counts.txt > /tmp/probes/skew_counts_ncu.txt
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  PROBE_ONCE=1 timeout 300 "$ncu" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --csv --page details /tmp/probes/skew_gemm /tmp/probes/skew_counts_ncu.txt > "$out/ncu.csv" 2> "$out/ncu.err" || status=1
fi
exit $status
