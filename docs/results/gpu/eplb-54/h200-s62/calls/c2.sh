# session 62 call 2 (1x H200), a probe: calls/probe-behind.diff applied on 0c24001 (EPSERVE_EPLB_COPIES_AT=behind): a placement's parts put behind the step just enqueued, to run as soon as it ends
# against beside the next step (the default).
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in step:a:128MiB behind:b:128MiB behind:c:128MiB step:d:128MiB behind:e:32MiB; do
  IFS=: read at k size <<< "$c"; d=$O/$k-$size-$at; mkdir -p $d
  EPSERVE_EPLB_COPIES_AT=$at EPSERVE_EPLB_STEP_COPIES=$size OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 \
    timeout 85 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $size $at $(grep -c 'go on behind' $d/report.txt)"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "serve-moves.log group, least device|every step beside the copies|their causes" $d/report.txt | sed -n 3,5p | cut -c1-160
  grep -o "copies done.*" $d/report.txt | head -3
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
