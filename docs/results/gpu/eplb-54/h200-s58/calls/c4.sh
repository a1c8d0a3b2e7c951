# session 58 call 4 (one H200): the gRPC runtimes' threads at nice 3 (epserve-nice) against
# d177ec2 (epserve-idle), no placement: how often the step thread loses its core. A B B A.
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
export EPSERVE_STEP_PHASE_TIMES=on
i=0
for bin in epserve-idle epserve-nice epserve-nice epserve-idle; do
  i=$((i+1)); d=$O/$i-$bin; mkdir -p $d
  EPSERVE=.device/bin/$bin OUT=$d RANKS=1 MOVE_EVERY=0 DURATION=30 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 100 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $i $bin"; grep -E "tokens/s|causes of|^  all steps" $d/report.txt | sort | uniq -c | sort -rn | head -9
  grep "latency ms" $d/report.txt | awk '{print $4, $8}' | tr '\n' ' '; echo
  rm -f $d/moves-logs.tar.xz
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
