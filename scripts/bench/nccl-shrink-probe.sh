#!/usr/bin/env bash
# Builds and runs nccl-shrink-probe.cu on a 2-GPU machine against the system's NCCL (the one
# the nccl backend loads), once per mode; logs under $OUT.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
# NCCL_HOME (../shared/tools/device-nccl230.sh's env.sh) picks another NCCL.
if [ -n "${NCCL_HOME:-}" ]; then
  inc=(-I"$NCCL_HOME/include" -L"$NCCL_HOME/lib" -Xlinker -rpath="$NCCL_HOME/lib")
  echo "NCCL at $NCCL_HOME ($(grep -m1 'define NCCL_VERSION_CODE' "$NCCL_HOME/include/nccl.h" | awk '{print $3}'))" | tee "$out/nccl-shrink.txt"
else
  inc=()
  lib=$(ls /usr/lib/x86_64-linux-gnu/libnccl.so.2.* | head -1)
  echo "NCCL ${lib##*libnccl.so.} ($lib)" | tee "$out/nccl-shrink.txt"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/nccl-shrink.txt"
bin=/tmp/nccl-shrink-probe
/usr/local/cuda/bin/nvcc -O2 -std=c++17 "${inc[@]}" scripts/bench/nccl-shrink-probe.cu -o "$bin" -l:libnccl.so.2
for mode in ${MODES:-shrink shrink-inherit revoke abort}; do
  id=/tmp/nccl-shrink-id-$mode
  rm -f "$id" "$id.pid1"
  echo "== $mode${BLOCKING:+ (blocking)}${GRAPH:+ (graph)}" | tee -a "$out/nccl-shrink.txt"
  "$bin" 1 "$id" "$mode" 2>&1 | sed 's/^/  [rank 1] /' &
  timeout "${PROBE_TIMEOUT:-120}" "$bin" 0 "$id" "$mode" 2>&1 | tee -a "$out/nccl-shrink.txt" || echo "rank 0 exited $?" | tee -a "$out/nccl-shrink.txt"
  wait || true
done
