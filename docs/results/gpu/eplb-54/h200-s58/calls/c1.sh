# session 58 call 1 (one H200): staging in SCHED_IDLE (epserve) against nice 10 (epserve-old, main
# d5b0e40), the same load as session 57's call 4: one rank, 4 loads on the same 16 cores, a
# placement every 6 s (0: none), 30 s each.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:bf16:epserve:0 nccl-ep:bf16:epserve-old:6 nccl-ep:bf16:epserve:6 nccl:fp8:epserve:6 nccl:fp8:epserve-old:6; do
  IFS=: read be ex bin every <<< "$c"; d=$O/$be-$ex-$bin-$every; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=$every DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex $bin every $every s"; grep -E "^  OK|tokens/s|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -14
  tar xJf $d/moves-logs.tar.xz -C $d serve-moves.log && grep -c "batch staged" $d/serve-moves.log; grep "placement staged" $d/serve-moves.log | head -3 | cut -c60-260
  grep -c "runs at the serving threads" $d/serve-moves.log; rm $d/serve-moves.log
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
