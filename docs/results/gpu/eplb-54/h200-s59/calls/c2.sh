# session 59 call 2 (one H200): what moving costs the serving beside it, same call. bf16 on
# nccl-ep: no placement, then the new build (slots copied here) moving every 6 s; FP8 on nccl:
# no placement, d177ec2 (epserve-old: every slot staged from the model), the new build.
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:bf16:epserve:0 nccl-ep:bf16:epserve:6 nccl:fp8:epserve:0 nccl:fp8:epserve-old:6 nccl:fp8:epserve:6; do
  IFS=: read be ex bin every <<< "$c"; d=$O/$be-$ex-$bin-$every; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=$every DURATION=30 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 108 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $be $ex $bin every $every s"; grep -E "^  OK|tokens/s|latency|rebalances|causes of|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -16
  grep -oE "placement's slots.*staged=[0-9]+ from_slots_here=[0-9]+" $d/report.txt | head -2
  grep -oE "placement staged epoch=[0-9]+ bytes=[0-9]+ load_ms=[0-9.]+ upload_ms=[0-9.]+" $d/report.txt | head -3
  grep -oE "placement applied epoch=[0-9]+ moved_bytes=[0-9]+ seconds=[0-9.]+" $d/report.txt | head -3
  grep -oE "copies enqueued.*epoch=[0-9]+ slots=[0-9]+" $d/report.txt | head -1
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
