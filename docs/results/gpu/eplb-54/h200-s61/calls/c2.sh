# session 61 call 2 (1x H200): does work in SCHED_IDLE on every core slow the serving steps? Staging a placement
# runs the load pool (cores / ranks threads a rank) in SCHED_IDLE; at RANKS=1 nothing is staged (every slot is
# copied on the rank), so the moves load with no placement runs beside N SCHED_IDLE burners instead (numpy RNG
# into a 64 MiB array, compute and memory like a synthetic load), N = 0, 16, 4, 16, 0. Build 0b4d366.
source scripts/bench/device-env.sh
O=$out
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|NUMA" | tee $O/lscpu.txt
export EPSERVE_STEP_PHASE_TIMES=on
burn() { for i in $(seq 1 $1); do chrt -i 0 python3 -c "
import numpy as np
a = np.empty((64 << 20) // 8); g = np.random.default_rng($i)
while True: g.random(out=a)" & done; }
for c in 0:a 16:b 4:c 16:d 0:e; do
  IFS=: read n k <<< "$c"; d=$O/$k-burn$n; mkdir -p $d
  burn $n; sleep 1; [ $n -gt 0 ] && chrt -p $(pgrep -f "default_rng" | head -1) | tail -1
  OUT=$d RANKS=1 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  pkill -f default_rng; sleep 1
  echo "#### $k $n burners"
  grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "tokens/s" $d/report.txt | awk '{t+=$2} END {printf "  tokens/s %.0f\n", t}'
  grep -E "^  all steps|^  causes of" $d/report.txt
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
