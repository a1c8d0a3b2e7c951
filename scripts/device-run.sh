#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what scripts/gpu-check.sh built into
# .device/bin: the GPU tests, then `epserve bench`. Logs and the bench JSON go to $OUT (or ./out).
#   device tool: kind nvidia-h200-x4, carry [".device"], command: bash scripts/device-run.sh [tests] [ep] [drill] [bench] | all
set -uo pipefail
what=" ${*:-all} "
# Parts asked for: any of tests, ep, drill, bench (or all).
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
out=${OUT:-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPSERVE_BIN=$PWD/.device/bin/epserve
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
status=0
run() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0))s"; tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
if want tests; then
  run gpu_kernels .device/bin/gpu_kernels --ignored --test-threads 1
  run gpu_nccl .device/bin/gpu_nccl --ignored --test-threads 1
  run gpu_ep .device/bin/gpu_ep --ignored --nocapture --test-threads 1
  run gpu_serve .device/bin/gpu_serve --ignored --nocapture --test-threads 1 --skip matches_the_nccl_backend --skip fault_drill
fi
if want drill; then
  # A rank stopped and killed under load, on both GPU backends (nccl-ep on the carried NCCL 2.30).
  run drill_nccl timeout 300 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 nccl_fault_drill
  grep -E "^(test |fault drill)" "$out/drill_nccl.log" || true
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    (source /tmp/nccl230/env.sh &&
      run drill_nccl_ep timeout 300 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 nccl_ep_fault_drill) || status=1
    grep -E "^(test |fault drill)" "$out/drill_nccl_ep.log" || true
  fi
fi
if want ep; then
  # NCCL 2.30.7 + NCCL EP, packed here by ../shared/tools/device-nccl230.sh .device (the image
  # has NCCL 2.28): unpacked and used in a subshell, so the other runs keep the image's NCCL.
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    # NCCL_DEBUG=WARN: NCCL EP says why it refuses a call only in NCCL's log.
    (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
      run gpu_nccl_ep timeout 300 .device/bin/gpu_nccl_ep --ignored --nocapture --test-threads 1) || status=1
    grep -E "^(test |NCCL|[0-9]+ GPUs|LL|step)" "$out/gpu_nccl_ep.log" || true
    (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
      run gpu_serve_ep timeout 500 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 matches_the_nccl_backend) || status=1
    grep -E "^(test |nccl-ep)" "$out/gpu_serve_ep.log" || true
  else
    echo "== gpu_nccl_ep: skipped (no .device/nccl230.tar.xz)"
  fi
fi
if want bench; then
  if [ -f .device/nccl230.tar.xz ]; then
    # Both backends in one run, on NCCL 2.30.7.
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    (source /tmp/nccl230/env.sh && run bench "$EPSERVE_BIN" bench --configs decode,small,prefill \
      --backends nccl,nccl-ep --ep-modes ht,ll --zero-copy on,off --iters 100 --json "$out/bench.json") || status=1
  else
    run bench "$EPSERVE_BIN" bench --configs decode,small,prefill --iters 100 --json "$out/bench.json"
  fi
fi
exit $status
