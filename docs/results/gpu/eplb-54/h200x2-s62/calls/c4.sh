# session 62 call 4 (2x H200), build 2fc05d6: #54's moves load, a placement every 6 s in 32 MiB parts (the default):
# nccl-ep bf16 twice (the pair with no run free of slow steps so far), then nccl-ep FP8 again.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in bf16:a bf16:b fp8:c; do
  IFS=: read ex k <<< "$c"; d=$O/$k-nccl-ep-$ex; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=$ex \
    timeout 130 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $ex"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m2 -E "every step beside|their causes" | cut -c1-160
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
