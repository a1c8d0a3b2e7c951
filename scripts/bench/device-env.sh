# Sourced by the GPU scripts of scripts/bench, on the GPU machine from the repository root: the
# carried binaries unpacked, the environment the device tool asks for, the GPUs said, and
# `run NAME LIMIT CMD...` (its log under $out; the lines matching $RUN_LINES shown).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
[ -x .device/bin/epserve ] || tar xJf .device/bin.tar.xz -C .device
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPSERVE_BIN=$PWD/.device/bin/epserve TMPDIR=/dev/shm
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
t0=$SECONDS
RUN_LINES=${RUN_LINES:-"^test |test result|skipped|worst|error|panicked|GPUs:|^\| "}
run() { # name limit cmd...
  local name=$1 lim=$2; shift 2; local s=$SECONDS
  timeout "$lim" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - s))s (total $((SECONDS - t0))s)"
  grep -E "$RUN_LINES" "$out/$name.log" | head -60
}
