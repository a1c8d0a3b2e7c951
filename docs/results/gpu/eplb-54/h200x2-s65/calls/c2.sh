# session 65 call 2 (2x H200), #54: the bench after a host gap with the ranks started apart
# (--gap-spread-us, new), then the moves load with placements (nccl-ep bf16) with phase times on
# and off, and which processes hold a context on each GPU while it serves.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
for c in ht:0 ht:100 ht:200 ht:400 ht:0 nccl:0 nccl:200; do
  IFS=: read m sp <<< "$c"; b=nccl-ep; [ $m = nccl ] && b=nccl
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN RUN_LINES="^\| small" && run gap-$m-$sp 120 .device/bin/epserve bench --ranks 2 --configs small \
    --backends $b --ep-modes ht --expert-dtype bf16 --iters 1500 --warmup 20 --gap-us 2000 --gap-spread-us $sp --json $O/gap-$m-$sp-$SECONDS.json)
done
python3 scripts/bench/gap-steps.py $O/gap-*.json > $O/gap-steps.txt 2>&1; cat $O/gap-steps.txt | cut -c1-250
one() { # key phase every
  local d=$O/$1; mkdir -p $d
  ( sleep 45; nvidia-smi --query-compute-apps=pid,process_name,gpu_uuid,used_memory --format=csv > $d/apps.txt 2>&1; nvidia-smi -L >> $d/apps.txt ) &
  EPSERVE_STEP_PHASE_TIMES=$2 OUT=$d RANKS=2 MOVE_EVERY=$3 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 120 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  wait
  echo "#### $1 phase=$2 every=$3 (total $((SECONDS - t0))s)"; cat $d/apps.txt
  grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "beside the copies|placement applied" $d/report.txt | grep -v "^.*TRACE" | head -8 | cut -c1-250
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-300
}
one m-on on 6
one m-off off 6
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
