# session 60 call 2 (one H200): the mend's build (29f4e03, the plan on the staging thread) against
# c0312e7's, one after the other in one call, the moves load (bf16, nccl-ep, a placement every 6 s),
# old, new, new, old; then no placement (new).
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
export EPSERVE_STEP_PHASE_TIMES=on
nproc; lscpu | grep -E "Model name|^CPU\(s\)" > $O/cpu.txt
for c in c0312e7:6:a epserve:6:b epserve:6:c c0312e7:6:d epserve:0:e; do
  IFS=: read b m k <<< "$c"; bin=.device/bin/epserve; [ $b = c0312e7 ] && bin=.device/bin/epserve-c0312e7
  d=$O/$k-$b-$m; mkdir -p $d
  EPSERVE=$bin OUT=$d RANKS=1 MOVE_EVERY=$m DURATION=20 MOVES_BACKEND=nccl-ep MOVES_EXPERTS=bf16 \
    timeout 85 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $k $b every $m"; grep -E "tokens/s|^  all steps|beside the copies" $d/report.txt | sort | uniq -c | sort -rn | head -8
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
