# session 56 call 1: where a stalled host stalls (enqueue parts), steal time, NCCL after idle
source scripts/bench/device-env.sh
O=$out
steal() { awk '/^cpu /{print "steal jiffies (all cpus): " $9 "  total: " $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
nproc; grep -m1 "model name" /proc/cpuinfo; grep -c hypervisor /proc/cpuinfo
for r in 1 2; do
  steal | tee -a $O/steal.txt
  extra=""; [ $r = 2 ] && export EPSERVE_STEP_PHASE_TIMES=on
  OUT=$O/r$r RANKS=$r MOVE_EVERY=0 DURATION=30 timeout 150 bash scripts/bench/eplb-gpu.sh moves > $O/r$r-report.txt 2>&1
  steal | tee -a $O/steal.txt
  grep -E "causes|over 1.1x:|after .* idle" $O/r$r-report.txt | head -20
done
unset EPSERVE_STEP_PHASE_TIMES
timeout 120 python3 -m torch.distributed.run --nproc_per_node 2 scripts/bench/nccl-after-idle.py 150 16 > $O/nccl-after-idle.txt 2>&1
grep -v "^W\|warn" $O/nccl-after-idle.txt | tail -30
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
