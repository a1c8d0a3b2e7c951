# session 65 call 7 (2x H200), #54: the bench after a host gap with the host waiting for each step
# as a serving rank does (--gap-poll, new: cuEventQuery in a spin, then naps), alone and with
# everything else serving's step has that the bench can (copies, processes, a client's routing,
# the slot table, gaps of 1-3 ms); alternating with the plain step.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
b() { # name extra...
  local n=$1; shift 1
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN RUN_LINES="^\| small|rror|panick" && run $n 150 .device/bin/epserve bench --ranks 2 --configs small \
    --backends nccl-ep --ep-modes ht --expert-dtype bf16 --iters 1500 --warmup 20 --json $O/$n.json "$@")
}
all=(--gap-copies --gap-poll --rank-processes --skew 0 --eplb on --redundant-experts 2)
b a-plain --gap-us 2000
b b-poll --gap-us 2000 --gap-poll
b c-all --gap-us 2000 "${all[@]}"
b d-poll --gap-us 2000 --gap-poll
b e-all-1to3ms --gap-us 1000 --gap-spread-us 2000 "${all[@]}"
b f-plain --gap-us 2000
python3 scripts/bench/gap-steps.py $O/*.json > $O/gap-steps.txt 2>&1; cut -c1-250 $O/gap-steps.txt
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
