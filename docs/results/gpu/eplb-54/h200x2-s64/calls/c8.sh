# session 64 call 8 (2x H200), #54's moves load with no placement (MOVE_EVERY=0), `nccl-ep` bf16:
# the model's 4 layers (4 load generators of 4 clients) against 1 layer (one of 16 clients), alternating.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
export EPSERVE_STEP_PHASE_TIMES=on
for c in 4:4:a 1:16:b 4:4:c 1:16:d; do
  IFS=: read L C k <<< "$c"; d=$O/$k-layers$L; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 MOVES_LAYERS=$L CONCURRENCY=$C \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k layers $L clients $C each"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
