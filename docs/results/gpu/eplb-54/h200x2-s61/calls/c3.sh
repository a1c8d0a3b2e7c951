# session 61 (2 GPUs, if lent): #54's FP8 pairs under the moves load with a placement every 6 s, the same machine's
# FP8 load with no placement (its own noise), nccl-ep FP8 with a placement every 10 s (each placement's copies then
# land with no staging beside them: at 6 s the next placement stages beside them), and nccl-ep FP8 in 64 MiB parts
# (half the steps beside the copies; on one H200 no step beside them over 1.1x, call 1); build 0b4d366.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:6:20:32MiB:a nccl:6:20:32MiB:b nccl-ep:0:20:32MiB:c nccl-ep:10:30:32MiB:d nccl-ep:6:20:64MiB:e; do
  IFS=: read be m s p k <<< "$c"; d=$O/$k-$be-fp8-$m-$p; mkdir -p $d
  EPSERVE_EPLB_STEP_COPIES=$p OUT=$d RANKS=2 MOVE_EVERY=$m DURATION=$s MOVES_BACKEND=$be MOVES_EXPERTS=fp8 \
    timeout $((s + 70)) bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $be fp8 every $m for $s s, $p parts"
  grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "^  all steps" $d/report.txt | tail -1; grep -A1 "every step beside the copies" $d/report.txt | tail -2
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
