# session 65 call 5 (2x H200), #54: the bench after a host gap with each step's rows and small
# values moved as serving moves them (--gap-copies, new), threads and processes, router and
# client routing, against the plain step; alternating.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
b() { # name extra...
  local n=$1; shift 1
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN RUN_LINES="^\| small|rror|panick" && run $n 150 .device/bin/epserve bench --ranks 2 --configs small \
    --backends nccl-ep --ep-modes ht --expert-dtype bf16 --iters 1500 --warmup 20 --gap-us 2000 --json $O/$n.json "$@")
}
b a-plain
b b-copies --gap-copies
b c-copies-procs --gap-copies --rank-processes
b d-copies-client --gap-copies --skew 0
b e-plain
b f-copies-client-procs --gap-copies --skew 0 --rank-processes
b g-copies --gap-copies
b h-copies-client-slots --gap-copies --skew 0 --eplb on --redundant-experts 2
python3 scripts/bench/gap-steps.py $O/*.json > $O/gap-steps.txt 2>&1; cut -c1-250 $O/gap-steps.txt
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
