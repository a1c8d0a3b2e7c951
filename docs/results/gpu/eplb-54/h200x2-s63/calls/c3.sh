# session 63 call 3 (2x H200), build bcf5301 (main): #54's moves load with no placement (MOVE_EVERY=0),
# `nccl-ep` against `nccl`, bf16 and FP8, alternating: each exchange's own rate of steps over 1.1x.
source scripts/bench/device-env.sh
O=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $O/gpus.txt
export EPSERVE_STEP_PHASE_TIMES=on
for c in nccl-ep:bf16:a nccl:bf16:b nccl-ep:bf16:c nccl:bf16:d nccl-ep:fp8:e nccl:fp8:f; do
  IFS=: read be ex k <<< "$c"; d=$O/$k-$be-$ex; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=$be MOVES_EXPERTS=$ex \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $be $ex"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
