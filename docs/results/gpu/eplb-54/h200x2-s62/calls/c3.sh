# session 62 call 3 (2x H200), build 2fc05d6: #54's moves load on nccl-ep FP8, a placement every 6 s, in parts of
# 32 MiB (the default) and 16 MiB a step, one run after the other, and one run with no placement (the machine's rate).
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in 32MiB:a:6 16MiB:b:6 0:c:0 16MiB:d:6 32MiB:e:6; do
  IFS=: read size k every <<< "$c"; d=$O/$k-$size-$every; mkdir -p $d
  if [ "$size" = 0 ]; then size=32MiB; fi
  EPSERVE_EPLB_STEP_COPIES=$size OUT=$d RANKS=2 MOVE_EVERY=$every DURATION=$([ $every = 0 ] && echo 15 || echo 20) MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $size every $every"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m2 -E "every step beside|their causes" | cut -c1-160
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
