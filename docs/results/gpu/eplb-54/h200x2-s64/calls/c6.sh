# session 64 call 6 (2 GPUs): call 3's order again (nccl, nccl-ep HT, LL in one process) after host gaps, with phases, launch times and enqueue times (build 2995e46 + --gap-us).
RUN_LINES="^\| small|rror|panicked"; source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
g() { # name gap dtype backends ep-modes [env...]
  local n=$1 gap=$2 d=$3 b=$4 m=$5; shift 5
  run $n 150 env "$@" .device/bin/epserve bench --ranks 2 --configs small --backends $b --ep-modes $m \
    --expert-dtype $d --iters 1500 --warmup 20 --gap-us $gap --json $out/$n.json
}
g all-2000-a 2000 bf16 nccl,nccl-ep ht,ll X=1
g all-5000-a 5000 bf16 nccl,nccl-ep ht,ll X=1
g all-2000-b 2000 bf16 nccl,nccl-ep ht,ll X=1
cd $out && tar czf /tmp/c6.tgz . && rm -f *.log *.json && mv /tmp/c6.tgz .
