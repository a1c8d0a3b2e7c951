# session 64 call 9 (2x H200), #54's moves load with no placement (MOVE_EVERY=0), `nccl-ep` bf16:
# one bucket: --max-tokens-per-step 2048 (every step one 2,048-token request, 1,024 tokens a rank, the bench's `small` shape), one layer of 16 clients.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in 1:16:a 1:16:b; do
  IFS=: read L C k <<< "$c"; d=$O/$k-layers$L-max2048; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 MOVES_LAYERS=$L CONCURRENCY=$C MOVES_MAX_TOKENS=2048 \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k layers $L clients $C each"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
