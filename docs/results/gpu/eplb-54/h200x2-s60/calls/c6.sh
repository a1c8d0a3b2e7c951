# session 60 call 6 (2x H200, another start of the kind): nccl-ep bf16 under the moves load, placements in 32 MiB parts (the
# default) against 8 MiB parts, then none; one machine, build 29f4e03.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in 32MiB:6:a 8MiB:6:b none:0:c 8MiB:6:d; do
  IFS=: read p m k <<< "$c"; d=$O/$k-$p; mkdir -p $d
  [ $p = none ] || export EPSERVE_EPLB_STEP_COPIES=$p
  OUT=$d RANKS=2 MOVE_EVERY=$m DURATION=25 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 75 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  unset EPSERVE_EPLB_STEP_COPIES
  echo "#### $k $p every $m"; grep -E "^  all steps|beside the copies" $d/report.txt | sed -n '7p;8p;9p;10p'
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
