# session 57 call 2 (one H200; x2 not lent): #54's rebalance under load with FP8 experts (nccl, nccl-ep)
# and bf16 on nccl-ep, one rank: a placement every 6 s in which every slot changes expert (130 slots,
# each layer's whole weights copied on the side stream while 4 clients send 2,048-token requests).
source scripts/bench/device-env.sh
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl:fp8 nccl-ep:fp8 nccl-ep:bf16; do
  be=${c%%:*}; ex=${c##*:}; mkdir -p $O/$be-$ex
  OUT=$O/$be-$ex RANKS=1 MOVE_EVERY=6 DURATION=40 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 150 bash scripts/bench/eplb-gpu.sh moves > $O/$be-$ex/report.txt 2>&1
  echo "#### $be $ex"; grep -E "^  OK|tokens/s|rebalances|causes|over 1.1x|placement .*applied|median" $O/$be-$ex/report.txt | sort | uniq -c | sort -rn | head -24
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
