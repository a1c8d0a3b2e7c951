# session 57 call 4 (one H200): what parallel staging costs the steps beside it, one call: the build
# before (epserve-old: experts made one at a time), call 3's (epserve-p16: on the 16-thread load pool),
# and this one (epserve: a staging pool of 4), bf16 on nccl-ep with a placement every 6 s, against
# the same load with no placement; then FP8 on nccl with the pool of 4.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:bf16:epserve:0 nccl-ep:bf16:epserve-old:6 nccl-ep:bf16:epserve-p16:6 nccl-ep:bf16:epserve:6 nccl:fp8:epserve:6; do
  IFS=: read be ex bin every <<< "$c"; d=$O/$be-$ex-$bin-$every; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=$every DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 120 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex $bin every $every s"; grep -E "^  OK|tokens/s|p50.*mean|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -16
  tar xJf $d/moves-logs.tar.xz -C $d serve-moves.log && grep -c "batch staged" $d/serve-moves.log; grep "batch staged" $d/serve-moves.log | sed -n '2p;20p' | cut -c60-200
  grep "copies done" $d/serve-moves.log | cut -c100-200; rm $d/serve-moves.log
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
