# session 63 call 1 (2x H200): #54's moves load, nccl-ep bf16, 32 MiB parts, a placement every 6 s:
# the steps' streams at the default priority (today) or the greatest (EPSERVE_STEP_PRIORITY=greatest), alternating.
source scripts/bench/device-env.sh
O=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $O/gpus.txt
export EPSERVE_STEP_PHASE_TIMES=on
for c in default:a greatest:b default:c greatest:d greatest:e; do
  IFS=: read pr k <<< "$c"; ex=bf16; d=$O/$k-$pr-$ex; mkdir -p $d
  EPSERVE_STEP_PRIORITY=$pr OUT=$d RANKS=2 MOVE_EVERY=6 DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=$ex \
    timeout 130 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $pr $ex"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  echo "  priority lines: $(cat $d/*.log 2>/dev/null | grep -c 'greatest priority') in logs; $(xz -dc $d/moves-logs.tar.xz 2>/dev/null | grep -a -c 'greatest priority') in tar"
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m2 -E "every step beside|their causes" | cut -c1-160
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
