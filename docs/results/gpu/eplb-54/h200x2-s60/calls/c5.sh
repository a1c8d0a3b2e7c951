# session 60 call 5 (2x H200, the machine of call 4, held warm): the moves load with no placement
# (nccl-ep bf16), then gpu_serve's placement test at world 2 (nccl, bf16), build 29f4e03.
source scripts/bench/device-env.sh; O=$out; export EPSERVE_STEP_PHASE_TIMES=on
d=$O/nccl-ep-bf16-0; mkdir -p $d
OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
  timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
grep -E "^  OK|tokens/s|causes of|^  all steps" $d/report.txt | sort | uniq -c | sort -rn | head
unset EPSERVE_STEP_PHASE_TIMES
EPSERVE_PLACEMENT_CASES=nccl/bf16/auto run gpu_serve_placement 320 .device/bin/gpu_serve --ignored \
  --nocapture --test-threads 1 a_placement_applied_between_graph_replays_equals_a_group_started_on_it --exact
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
