# session 59 call 1 (one H200): slots copied from slots of the same rank (epserve) against d177ec2
# (epserve-old: every rewritten slot staged from the model). First gpu_serve's placement test on
# the new build at world 1 (B reverses A's block: every slot copied here, swaps through the spare),
# a slot a part (cycles inside parts) and bitwise against a fresh group; then the moves load.
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
EPSERVE_EPLB_STEP_COPIES=1 EPSERVE_PLACEMENT_CASES=nccl/bf16/auto,nccl/fp8/auto \
  run gpu_serve_placement 270 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
  a_placement_applied_between_graph_replays_equals_a_group_started_on_it --exact
grep -E "placement's slots|placement staged" $O/gpu_serve_placement.log | cut -c1-300 | head -8
export EPSERVE_STEP_PHASE_TIMES=on
for bin in epserve-old epserve; do
  d=$O/nccl-ep-bf16-$bin-6; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $bin"; grep -E "^  OK|tokens/s|latency|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -16
  grep -oE "placement's slots.*staged=[0-9]+ from_slots_here=[0-9]+" $d/report.txt | head -3
  grep -oE "placement staged epoch=[0-9]+ bytes=[0-9]+ load_ms=[0-9.]+ upload_ms=[0-9.]+" $d/report.txt
  grep -oE "placement applied epoch=[0-9]+ moved_bytes=[0-9]+ seconds=[0-9.]+" $d/report.txt
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
