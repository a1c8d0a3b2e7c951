#!/usr/bin/env bash
# #58's load figures on a GPU machine (docs/benchmarks.md "Load"): the synthetic DeepSeek-V3
# layer's time to serve on 2 GPUs (`nccl`), its weights made serially (--load-threads 1, as
# before this change) and on the load pool, bf16 and FP8; then a Qwen3-30B-A3B-shaped bf16
# checkpoint (scripts/bench/make-checkpoint.py) loaded cold and warm against dd of its files.
# On the GPU machine, from the repository root, with .device/bin.tar.xz carried:
#   bash scripts/bench/load-gpu.sh synth1 synth fp8 ckpt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
[ -x .device/bin/epserve ] || tar xJf .device/bin.tar.xz -C .device
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TMPDIR=/dev/shm
B=$PWD/.device/bin/epserve
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
nproc | tee "$out/nproc.txt"
serve() { # name limit flags...: seconds from start to "serving gRPC", and the load lines
  local name=$1 lim=$2; shift 2
  local log="$out/$name.log" t0=$SECONDS
  timeout "$lim" $B launch --ranks 2 --backend nccl --listen 127.0.0.1:0 --metrics-listen off \
    --http-listen off "$@" >"$log" 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null && ! grep -q "serving gRPC on" "$log"; do sleep 0.2; done
  echo "== $name ($*): serving after $((SECONDS - t0)) s"
  grep -E "weights loaded|checkpoint read|startup:|error" "$log" | cut -c1-300
  kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
}
for part in "$@"; do
case "$part" in
synth1) serve synth-bf16-serial 400 --model synthetic:deepseek-v3 --layers 1 --load-threads 1 ;;
synth) serve synth-bf16 300 --model synthetic:deepseek-v3 --layers 1 ;;
fp8) serve synth-fp8 400 --model synthetic:deepseek-v3 --layers 1 --expert-dtype fp8 ;;
fp8serial) serve synth-fp8-serial 560 --model synthetic:deepseek-v3 --layers 1 --expert-dtype fp8 --load-threads 1 ;;
ckpt)
  python3 scripts/bench/make-checkpoint.py /dev/shm/ckq --preset qwen3-30b --layers 4 2>&1 | tail -1
  # /dev/shm is memory: "cold" there is only the page tables; the disk's checkpoint below.
  mkdir -p /tmp/ckq && cp /dev/shm/ckq/* /tmp/ckq/ && rm -rf /dev/shm/ckq
  bash scripts/bench/load-bench.sh /tmp/ckq 2 --backend nccl -- "serial=$B --load-threads 1" "after=$B" 2>&1 | tee "$out/ckpt.txt" | grep -v "group ready"
  ;;
esac
done
