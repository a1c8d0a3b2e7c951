# session 63 call 2 (2x H200), build bcf5301 (main): #54's moves load on `nccl`, 32 MiB parts, a placement every 6 s:
# bf16 twice and FP8 twice, alternating (the pairs not run in session 62).
source scripts/bench/device-env.sh
O=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $O/gpus.txt
export EPSERVE_STEP_PHASE_TIMES=on
for c in bf16:a fp8:b bf16:c fp8:d; do
  IFS=: read ex k <<< "$c"; d=$O/$k-nccl-$ex; mkdir -p $d
  OUT=$d RANKS=2 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl MOVES_EXPERTS=$ex \
    timeout 130 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k nccl $ex"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m2 -E "every step beside|their causes" | cut -c1-160
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
