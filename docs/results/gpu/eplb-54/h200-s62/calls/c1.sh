# session 62 call 1 (1x H200), a probe: calls/probe-experts.diff applied on 0c24001 (EPSERVE_EPLB_COPIES_AT=experts): a placement's parts started with the experts of the step beside them
# against with the step (the default). Also gpu_serve's placement test on the probe first (its 200 s limit cut it).
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
( source /tmp/nccl230/env.sh
  EPSERVE_EPLB_COPIES_AT=experts EPSERVE_EPLB_STEP_COPIES=1 EPSERVE_PLACEMENT_CASES=nccl/fp8/auto,nccl/bf16/auto,nccl-ep/fp8/ht,nccl-ep/bf16/auto \
    run placement-experts 200 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 a_placement_applied_between_graph_replays )
export EPSERVE_STEP_PHASE_TIMES=on
for c in step:a experts:b experts:c step:d; do
  IFS=: read at k <<< "$c"; d=$O/$k-128MiB-$at; mkdir -p $d
  EPSERVE_EPLB_COPIES_AT=$at EPSERVE_EPLB_STEP_COPIES=128MiB OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 85 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $at"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "^  all steps" $d/report.txt | tail -1; grep -A2 "every step beside the copies" $d/report.txt | tail -3; grep -o "copies done.*" $d/report.txt | head -3; grep -c "start with the experts" $d/*.log 2>/dev/null | head -2
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
