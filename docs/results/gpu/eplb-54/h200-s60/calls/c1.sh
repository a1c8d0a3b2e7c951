# session 60 call 1 (one H200): build of the mend (plan on the staging thread). gpu_serve's placement test at world 1
# (nccl, bf16 and FP8, a slot a part: every slot copied here, swaps through the spare), then the
# moves load once (bf16, nccl-ep).
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
EPSERVE_EPLB_STEP_COPIES=1 EPSERVE_PLACEMENT_CASES=nccl/bf16/auto,nccl/fp8/auto \
  run gpu_serve_placement 330 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
  a_placement_applied_between_graph_replays_equals_a_group_started_on_it --exact
export EPSERVE_STEP_PHASE_TIMES=on
d=$O/nccl-ep-bf16-epserve-6; mkdir -p $d
EPSERVE=.device/bin/epserve OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
  timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
grep -E "^  OK|tokens/s|rebalances|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -12
grep -oE "(placement's slots|copies enqueued).*epoch=[0-9]+ (staged|slots)=[0-9]+( from_slots_here=[0-9]+)?" $d/report.txt | head -4
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
