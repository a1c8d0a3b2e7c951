# 2 GPUs (if lent): #54's rebalance under serving load on 2 GPUs, the three pairs not yet measured
# (RANKS=2: every slot staged from the model, the bench's blocks trade ranks), (build 29f4e03; session 60 call 4).
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:bf16 nccl:fp8 nccl-ep:fp8; do
  IFS=: read be ex <<< "$c"; d=$O/$be-$ex; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=6 DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 130 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex"; grep -E "^  OK|tokens/s|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -14
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
