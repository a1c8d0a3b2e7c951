# session 61 call 4 (2 GPUs): call 3 again, longer, on the next lease: nccl FP8 (0 of 82 beside the copies in call 3, 2 placements
# landed), nccl-ep FP8 (12 of 127) and nccl-ep bf16, a placement every 6 s for 30 s each; build 0b4d366.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl:fp8:f nccl-ep:fp8:g nccl-ep:bf16:h; do
  IFS=: read be ex k <<< "$c"; d=$O/$k-$be-$ex-6; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=6 DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $be $ex every 6 for 30 s"
  grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "^  all steps" $d/report.txt | sed -n 3p; grep -A2 "every step beside the copies" $d/report.txt | head -2
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
