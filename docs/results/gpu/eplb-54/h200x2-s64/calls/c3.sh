# session 64 call 3 (2 GPUs): the step after a host gap (`epserve bench --gap-us`), Qwen3-shaped `small` (build 2995e46 + --gap-us).
RUN_LINES="^\| small|rror|panicked"; source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
g() { # name gap dtype backends ep-modes [env...]
  local n=$1 gap=$2 d=$3 b=$4 m=$5; shift 5
  run $n 150 env "$@" .device/bin/epserve bench --ranks 2 --configs small --backends $b --ep-modes $m \
    --expert-dtype $d --iters 1500 --warmup 20 --gap-us $gap --json $out/$n.json
}
g g0-bf16 0 bf16 nccl,nccl-ep ht,ll X=1
g g2000-bf16 2000 bf16 nccl,nccl-ep ht,ll X=1
g g500-bf16 500 bf16 nccl,nccl-ep ht,ll X=1
g g5000-bf16 5000 bf16 nccl,nccl-ep ht,ll X=1
g g2000-fp8 2000 fp8 nccl,nccl-ep ht,ll X=1
g g2000-bf16-b 2000 bf16 nccl,nccl-ep ht,ll X=1
g g2000-ht-noguard 2000 bf16 nccl-ep ht NCCL_EP_DISABLE_GUARD=1
cd $out && tar czf /tmp/c3.tgz . && rm -f *.log *.json && mv /tmp/c3.tgz .
