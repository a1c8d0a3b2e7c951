# session 65 call 4 (call 3 as first run: its processes failed to read NaN back) (2x H200), #54: the bench after a host gap with each rank a process of its own
# (--rank-processes, new) against threads, alternating; then threads beside a host memory hog.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
b() { # name backend extra...
  local n=$1 be=$2; shift 2
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN RUN_LINES="^\| small|rror|panick" && run $n 150 .device/bin/epserve bench --ranks 2 --configs small \
    --backends $be --ep-modes ht --expert-dtype bf16 --iters 1500 --warmup 20 --gap-us 2000 --json $O/$n.json "$@")
}
b a-threads nccl-ep
b b-procs nccl-ep --rank-processes
b c-threads nccl-ep
b d-procs nccl-ep --rank-processes
b e-procs-nccl nccl --rank-processes
b f-procs-spread nccl-ep --rank-processes --gap-spread-us 150
hog='import numpy as np
a = np.ones(1 << 26); c = np.empty_like(a)
while True: np.copyto(c, a)'
pids=(); for i in $(seq 1 8); do python3 -c "$hog" & pids+=($!); done; sleep 2
b g-threads-hog nccl-ep
b h-procs-hog nccl-ep --rank-processes
kill ${pids[@]}; wait ${pids[@]} 2>/dev/null
python3 scripts/bench/gap-steps.py $O/*.json > $O/gap-steps.txt 2>&1; cut -c1-250 $O/gap-steps.txt
ls /tmp/epserve-bench-* 2>/dev/null | head -3
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
