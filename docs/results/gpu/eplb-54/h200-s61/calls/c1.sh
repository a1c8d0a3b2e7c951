# session 61 call 1 (1x H200): FP8 nccl-ep under the moves load, RANKS=1, a placement every 6 s, landed in parts of
# 32 MiB (the default), 128 MiB and 64 MiB a step, one run after the other: bigger parts land over fewer steps; do
# the steps beside them slow?  Build 0b4d366.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in 32MiB:a 128MiB:b 64MiB:c 128MiB:d 32MiB:e; do
  IFS=: read p k <<< "$c"; d=$O/$k-$p; mkdir -p $d
  EPSERVE_EPLB_STEP_COPIES=$p OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 90 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $p"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "^  all steps" $d/report.txt | tail -1; grep -A1 "every step beside the copies" $d/report.txt; grep -o "copies done.*" $d/report.txt | head -3
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
