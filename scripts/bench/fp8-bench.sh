#!/usr/bin/env bash
# #35's figures on one GPU in one call: for each epserve binary given (builds to compare first),
# `epserve bench` on an EP4 rank's expert work and the DeepSeek-V3 layer (world 1, nccl) with
# bf16 and FP8 experts, twice in turn; then PyTorch's peers on the same shapes
# (torch._scaled_grouped_mm, dense torch._scaled_mm). Output in $OUT.
#   device tool: kind nvidia-h200, command: bash scripts/bench/fp8-bench.sh .device/old/epserve .device/new/epserve
# CONFIGS narrows the bench's configs, ROUNDS the rounds, TORCH=skip skips PyTorch.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
configs=${CONFIGS:-decode-rank,prefill-rank,decode-shared,prefill-shared}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for bin in "$@"; do
    name=$(basename "$(dirname "$bin")")
    echo "== round $round: $bin"
    "$bin" bench --configs "$configs" --expert-dtype bf16,fp8 --ranks 1 --iters 100 \
      --json "$out/bench-$name-$round.json" >"$out/bench-$name-$round.log" 2>&1 || status=1
    python3 - "$out/bench-$name-$round.json" <<'PY' || status=1
import json, sys
for r in json.load(open(sys.argv[1])):
    c, s = r["config"], r["summary"]
    print(f'{c["name"]:15} {c["expert_dtype"]:5} step {s["step_us"]:8.1f}  dispatch {s["dispatch_us"]:7.1f}'
          f'  experts {s["experts_us"]:8.1f}  combine {s["combine_us"]:7.1f}')
PY
  done
done
if [ "${TORCH:-}" != skip ]; then
  python3 -m torch.distributed.run --nproc_per_node 1 scripts/bench/torch-peers.py \
    --configs decode-rank,prefill-rank --json "$out/torch.json" >"$out/torch.log" 2>&1 || status=1
  tail -n 20 "$out/torch.log"
fi
exit $status
