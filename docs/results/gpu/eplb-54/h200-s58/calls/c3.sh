# session 58 call 3 (one H200): bf16 slots staged through a page-locked buffer (epserve) against
# d177ec2 (epserve-idle: SCHED_IDLE, pageable copies). First gpu_serve's placement test on the new
# build (bf16, nccl and nccl-ep: slots staged fresh, then into kept ones; bitwise against a fresh
# group), then the moves load of calls 1-2 on both builds.
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
(source /tmp/nccl230/env.sh; EPSERVE_PLACEMENT_CASES=nccl/bf16/auto,nccl-ep/bf16/auto \
  run gpu_serve_placement 220 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
  a_placement_applied_between_graph_replays_equals_a_group_started_on_it --exact)
export EPSERVE_STEP_PHASE_TIMES=on
for bin in epserve-idle epserve; do
  d=$O/nccl-ep-bf16-$bin-6; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $bin"; grep -E "^  OK|tokens/s|latency|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -16
  grep -oE "placement staged epoch=[0-9]+ bytes=[0-9]+ load_ms=[0-9.]+ upload_ms=[0-9.]+" $d/report.txt
  grep -oE "placement applied epoch=[0-9]+ moved_bytes=[0-9]+ seconds=[0-9.]+" $d/report.txt
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
