# session 57 call 3 (one H200): call 2 again after staging made and quantized its experts on the load
# pool with a faster E4M3 encode (FP8 placements had not landed within 40 s: 1.3 s a batch of 8);
# bf16 on nccl-ep with the build before (epserve-old) and after, for what the parallel staging costs steps.
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl:fp8:epserve nccl-ep:fp8:epserve nccl-ep:bf16:epserve-old nccl-ep:bf16:epserve; do
  IFS=: read be ex bin <<< "$c"; d=$O/$be-$ex-$bin; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=6 DURATION=40 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 150 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex $bin"; grep -E "^  OK|rebalances|causes|over 1.1x: |beside the copies|placement's copies" $d/report.txt | sort | uniq -c | sort -rn | head -16
  tar xJf $d/moves-logs.tar.xz -C $d serve-moves.log && grep -E "weights loaded" $d/serve-moves.log | cut -c1-200
  grep "batch staged" $d/serve-moves.log | head -3 | cut -c60-200; rm $d/serve-moves.log
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
