# session 60 call 3 (one H200): the moves load with FP8 experts on nccl-ep, the build of 29f4e03,
# a placement every 6 s, then none (one rank: every rewritten slot copied on the rank).
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
export EPSERVE_STEP_PHASE_TIMES=on
for m in 6 0; do
  d=$O/nccl-ep-fp8-epserve-$m; mkdir -p $d
  EPSERVE=.device/bin/epserve OUT=$d RANKS=1 MOVE_EVERY=$m DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### every $m"; grep -E "^  OK|tokens/s|rebalances|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -12
  grep -oE "(placement's slots|copies enqueued).*epoch=[0-9]+ (staged|slots)=[0-9]+( from_slots_here=[0-9]+)?" $d/report.txt | head -2
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
