# session 58 call 2 (one H200): call 1 again with NCCL 2.30 carried (nccl-ep), the baselines with no
# placement, and FP8 on nccl with the server and the loads on cores apart (SERVE_CPUS/LOAD_CPUS).
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl:fp8:epserve:0:: nccl-ep:bf16:epserve-old:6:: nccl-ep:bf16:epserve:6:: nccl-ep:bf16:epserve:0:: nccl:fp8:epserve:6:0-11:12-15; do
  IFS=: read be ex bin every sc lc <<< "$c"; d=$O/$be-$ex-$bin-$every${sc:+-apart}; mkdir -p $d
  SERVE_CPUS=$sc LOAD_CPUS=$lc EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=$every DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex $bin every $every s $sc $lc"; grep -E "^  OK|tokens/s|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -14
  tar xJf $d/moves-logs.tar.xz -C $d serve-moves.log && grep -c "batch staged" $d/serve-moves.log; grep -E "placement staged|placement applied" $d/serve-moves.log | head -6 | cut -c60-260
  grep -c "runs at the serving threads" $d/serve-moves.log; rm $d/serve-moves.log
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
