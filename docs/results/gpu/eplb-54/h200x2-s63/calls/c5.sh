# session 63 call 5 (2x H200), build bcf5301 (main): #54's moves load with no placement (MOVE_EVERY=0), `nccl-ep` bf16,
# zero-copy on (the default) against off (EPSERVE_ZERO_COPY=off), alternating: does the exchange's own rate of slow steps follow the windows?
source scripts/bench/device-env.sh
O=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $O/gpus.txt
export EPSERVE_STEP_PHASE_TIMES=on
for c in on:a off:b on:c off:d; do
  IFS=: read zc k <<< "$c"; d=$O/$k-zc-$zc; mkdir -p $d
  EPSERVE_ZERO_COPY=$zc OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k zero-copy $zc"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  xz -dc $d/moves-logs.tar.xz 2>/dev/null | grep -a -m2 "nccl-ep$\|zero_copy=" | cut -c1-220
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-220
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
